"""Count the compute ops of one engine decode step: a device-independent proxy for its GPU kernel count.

    python scripts/count_decode_ops.py --preset k3-small [--adapter] [--conversions] [--kernels] [--by-line [N]]
                                       [--json ops.json]

A CUDA-graph decode step replays one kernel per compute op, so at batch 1 (where every kernel is tiny)
its time tracks their number. This builds the engine on CPU in bf16 (random weights of the preset,
vocabulary 512), decodes one request a few steps, profiles one decode step and counts the aten ops that
compute and call no op that computes (so a GEMM counts once, as `aten::mm`, not as the `aten::linear` that
called it), minus views, no-op conversions and copies of 0-dim CPU scalars (reported apart: CUDA passes a
scalar in the kernel's arguments); a `_grouped_mm` counts as one (CPU runs it as a loop of matmuls, CUDA as
one kernel). Until 2026-12-02 an op counted only when it called no aten op at all, which missed every GEMM
(`aten::mm` calls `aten::resolve_conj`) and counted a scalar wrap instead of the op that made it. `--adapter` adds a
rank-16 policy adapter and MXFP4
experts, the RL rollout's decode. Prints the total and the most frequent ops. `--conversions` also runs the
step once more under a dispatch mode and counts the dtype conversions (`.to(dtype)` calls that change the
dtype) by the source line in this repository that asked for them: where the copy kernels come from.
`--by-line` attributes every counted op of the same step to the innermost source line of this repository on
its Python stack (a Triton launch to the line that launched it) and prints the N (25) lines with the most,
with their ops: where to look for ops to fuse or remove.

`--kernels` counts the step as CUDA runs it with the Triton kernels of `miles_k3.kernels`: the step runs
under MILES_K3_KERNELS=interpret and TRITON_INTERPRET=1 (the script re-runs itself in a subprocess with them
when they are not both set), each Triton launch counts as one op ("triton::<kernel>"), and the aten ops the
interpreter runs inside a launch (its host copies of the arguments) are not counted: each launch runs in a
profiler range (`miles_k3.kernels.interpreted_launches`) and events under one are left out. Kernels that
dispatch on `is_cuda` alone (rollout/kernels: MXFP4 experts, mixed-adapter LoRA rows) still count as their
CPU fallbacks' aten ops.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from miles_k3 import kernels
from miles_k3.model.config import K3Config
from miles_k3.model.lora_spec import LoraSpec
from miles_k3.model.modeling import reference_state
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.model_runner import build_engine_model
from rollout.request import SamplingParams

NOT_COMPUTE = {
    "aten::select",
    "aten::unsqueeze",
    "aten::t",
    "aten::transpose",
    "aten::reshape",
    "aten::view",
    "aten::slice",
    "aten::expand",
    "aten::as_strided",
    "aten::squeeze",
    "aten::permute",
    "aten::_unsafe_view",
    "aten::alias",
    "aten::detach",
    "aten::lift_fresh",
    "aten::empty",
    "aten::empty_like",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::empty_strided",
    "aten::result_type",
    "aten::is_nonzero",
    "aten::split",
    "aten::unbind",
    "aten::chunk",
    "aten::narrow",
    "aten::flatten",
    "aten::view_as",
    "aten::movedim",
    "aten::contiguous",
    "aten::to",
    "aten::_to_copy",
    "aten::_reshape_alias",
    "aten::detach_",
    "aten::resize_",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::promote_types",
}  # a dtype rule the profiler records as an op; it launches nothing


def _inside(event, test) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if test(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def _inside_grouped_mm(event) -> bool:
    return _inside(event, lambda name: name == "aten::_grouped_mm")


def _inside_launch(event) -> bool:
    # a Triton launch's range (`miles_k3.kernels.interpreted_launches`): one CUDA kernel, whatever the
    # interpreter runs under it
    return _inside(event, lambda name: name.startswith("triton::"))


def _scalar_copy(event) -> bool:
    return event.name == "aten::copy_" and bool(event.input_shapes) and event.input_shapes[0] == []


def count_step_ops(
    engine: Engine, triton_launches: bool = False, by_line: dict | None = None
) -> tuple[collections.Counter, int]:
    """(compute ops of one step by name, copies of 0-dim tensors left out of them).

    An op counts when it computes (not in NOT_COMPUTE) and no op it calls does: `aten::mm` counts although it
    calls `aten::resolve_conj`, `aten::linear` does not (its `aten::mm` does). Copies of a 0-dim tensor are CPU
    scalar wraps (`x * 0.5` converts its Python scalar; on CUDA the scalar rides in the kernel's arguments):
    they are not counted, so the op that wrapped it counts, and their number is returned apart.

    `triton_launches` (the step running its kernels under the interpreter): each Triton launch counts once,
    as "triton::<kernel>", and the aten ops inside a launch do not count.

    `by_line` (a dict, filled in): the counted ops by the source line that ran them, {"path:line": Counter of
    op names} (`_SourceLines`)."""
    launching = kernels.interpreted_launches() if triton_launches else contextlib.nullcontext()
    lines = _SourceLines().located() if by_line is not None else contextlib.nullcontext()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, launching, lines:
        engine.step()
    launches = [e for e in prof.events() if e.name.startswith("triton::") and not _inside_launch(e)]
    events = [
        e for e in prof.events() if e.name.startswith("aten::") and not _inside_grouped_mm(e) and not _inside_launch(e)
    ]
    computing = [e for e in events if e.name not in NOT_COMPUTE and not _scalar_copy(e)]
    calls_kernel = set()  # ops with a counted op below them
    for e in computing:
        parent = e.cpu_parent
        while (
            parent is not None
            and parent.name.startswith(("aten::", _LINE, "PythonDispatchMode"))
            and id(parent) not in calls_kernel
        ):
            # (`--by-line`'s dispatch mode records each op twice, the call and, below its own range and a
            # "PythonDispatchMode" range, the op it runs: the outer one has the inner below it)
            calls_kernel.add(id(parent))
            parent = parent.cpu_parent
    counted = [e for e in computing if id(e) not in calls_kernel] + launches
    if by_line is not None:
        for e in counted:
            by_line.setdefault(_line_of(e), collections.Counter())[e.name] += 1
    return collections.Counter(e.name for e in counted), sum(1 for e in events if _scalar_copy(e))


REPO = Path(__file__).resolve().parents[1]


class _ConversionSites(TorchDispatchMode):
    """Counts `aten.to.dtype` calls that change the dtype, by the innermost repository source line."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.to.dtype and args[0].dtype != args[1]:
            ours = [
                f
                for f in traceback.extract_stack()
                if f.filename.startswith(str(REPO)) and "/.venv/" not in f.filename and f.filename != __file__
            ]
            where = f"{Path(ours[-1].filename).relative_to(REPO)}:{ours[-1].lineno}" if ours else "?"
            self.sites[f"{where} {args[0].dtype}->{args[1]}".replace("torch.", "")] += 1
        return func(*args, **(kwargs or {}))


_REPO_PREFIX = str(REPO) + os.sep
_LINE = "line::"  # the profiler ranges `--by-line` runs each op in: "line::<path:line>"


def _repo_line() -> str:
    """The innermost frame of the calling stack in this repository (not this script, not the venv):
    "path:line" relative to the repository, "?" when there is none. Walks frames rather than calling
    `traceback.extract_stack`, which reads source text: this runs once per op of the step."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_REPO_PREFIX) and "/.venv/" not in name and name != __file__:
            return f"{name[len(_REPO_PREFIX) :]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class _SourceLines(TorchDispatchMode):
    """Runs each op dispatched to it (and each Triton launch) inside a profiler range "line::<path:line>",
    the source line in this repository that called it; `_line_of` reads it back off a profiled event.

    A range rather than a count here: the profiler decides which events count (`count_step_ops`), and an
    event's nearest range names the line of the op the code called, whatever aten ops that one ran below it
    (`aten::copy_` inside `aten::_to_copy` goes to the `.to` line). Ops inside a Triton launch (the
    interpreter's host copies, never counted) run without a range, which keeps the step fast."""

    def __init__(self):
        super().__init__()
        self._in_launch = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._in_launch:
            return func(*args, **(kwargs or {}))
        with torch.profiler.record_function(_LINE + _repo_line()):
            return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def located(self) -> Iterator[None]:
        """This mode, and each interpreted Triton launch in a line range of its own (entered inside
        `kernels.interpreted_launches`, so the line range encloses its "triton::" range)."""
        if not _interpreting():
            with self:
                yield
            return
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run
        mode = self

        def located(fn, *args, **kwargs):
            if kwargs.get("warmup") or mode._in_launch:
                return run(fn, *args, **kwargs)
            mode._in_launch = True
            try:
                with torch.profiler.record_function(_LINE + _repo_line()):
                    return run(fn, *args, **kwargs)
            finally:
                mode._in_launch = False

        InterpretedFunction.run = located
        try:
            with self:
                yield
        finally:
            InterpretedFunction.run = run


def _line_of(event) -> str:
    """The line range above a counted event, else the first below it (an outer `_grouped_mm` counts, not
    the one its range holds: see `_inside_grouped_mm`)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(_LINE):
            return parent.name[len(_LINE) :]
        parent = parent.cpu_parent
    below = list(event.cpu_children)
    while below:
        child = below.pop(0)
        if child.name.startswith(_LINE):
            return child.name[len(_LINE) :]
        below.extend(child.cpu_children)
    return "?"


def conversion_sites(engine: Engine) -> collections.Counter:
    with _ConversionSites() as mode:
        engine.step()
    return mode.sites


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--adapter", action="store_true", help="policy adapter (rank 16) and MXFP4 experts")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--conversions", action="store_true", help="also count dtype conversions by source line")
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="count with miles_k3's Triton kernels, each launch one op (runs them interpreted)",
    )
    ap.add_argument(
        "--by-line",
        type=int,
        nargs="?",
        const=25,
        metavar="N",
        help="also attribute the step's ops to source lines and print the N (25) lines with most",
    )
    ap.add_argument(
        "--mla-attention",
        choices=["torch", "triton"],
        help="EngineConfig.mla_attention (triton needs --kernels on CPU: the interpreter runs it); "
        "default: what the engine runs on CUDA, triton with --kernels, torch without",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.mla_attention = args.mla_attention or ("triton" if args.kernels else "torch")
    if args.kernels and not _interpreting():
        return _rerun_interpreted(sys.argv[1:] if argv is None else argv, args.json)
    config = K3Config.from_preset(args.preset, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    lora = LoraSpec(rank=16) if args.adapter else None
    model, pool = build_engine_model(
        config,
        reference_state(config, 0),
        lora=lora,
        max_adapters=1,
        quantize="experts" if args.adapter else "none",
        dtype=torch.bfloat16,
    )
    engine = Engine(
        model,
        EngineConfig(
            memory_bytes=256 << 20,
            max_running=4,
            chunk_size=32,
            max_prefill_tokens=64,
            mla_attention=args.mla_attention,
        ),
        adapters=pool,
    )
    adapter = None
    if args.adapter:
        g = torch.Generator().manual_seed(0)
        tensors = {f"{n}.lora_A": (torch.randn(a.shape[1:], generator=g) * 0.01).bfloat16() for n, a in pool.A.items()}
        tensors |= {f"{n}.lora_B": torch.zeros(b.shape[1:], dtype=torch.bfloat16) for n, b in pool.B.items()}
        engine.add_adapter("policy", tensors)
        adapter = "policy"
    engine.submit(list(range(3, 20)), SamplingParams(temperature=1.0, max_new_tokens=20, seed=1), adapter=adapter)
    for _ in range(4):  # prefill and first decode steps: lazy initialization stays out of the count
        engine.step()
    lines = {} if args.by_line else None
    ops, scalar_copies = count_step_ops(engine, triton_launches=args.kernels, by_line=lines)
    total = sum(ops.values())
    print(
        f"{args.preset}, bs=1 decode step{' with adapter + MXFP4 experts' if args.adapter else ''}: {total} compute ops"
        f" (and {scalar_copies} copies of 0-dim CPU scalars left out: no CUDA kernel)"
    )
    if args.kernels:
        launches = sum(n for name, n in ops.items() if name.startswith("triton::"))
        print(f"of which {launches} Triton kernel launches (miles_k3.kernels) and {total - launches} aten ops")
    for name, n in ops.most_common(args.top):
        print(f"{n:6d}  {name}")
    result = {
        "preset": args.preset,
        "adapter": args.adapter,
        "compute_ops": total,
        "scalar_copies": scalar_copies,
        "by_op": dict(ops.most_common()),
        "torch": torch.__version__,
    }
    if args.kernels:
        result["kernels"] = True
    if lines is not None:
        ranked = sorted(lines.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
        print(f"ops by source line ({len(ranked)} lines), top {args.by_line}:")
        for where, names in ranked[: args.by_line]:
            detail = " ".join(
                f"{name.split('::', 1)[1]}x{n}" if n > 1 else name.split("::", 1)[1] for name, n in names.most_common()
            )
            print(f"{sum(names.values()):6d}  {where}  {detail}")
        result["by_line"] = {where: dict(names.most_common()) for where, names in ranked}
    if args.conversions:
        sites = conversion_sites(engine)  # the next decode step: same shapes, same ops
        print(f"dtype conversions of the next step: {sum(sites.values())}")
        for where, n in sites.most_common(args.top):
            print(f"{n:6d}  {where}")
        result["conversions"] = sum(sites.values())
        result["conversions_by_site"] = dict(sites.most_common())
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _interpreting() -> bool:
    return os.environ.get("MILES_K3_KERNELS") == "interpret" and os.environ.get("TRITON_INTERPRET") == "1"


def _rerun_interpreted(argv: list[str], json_path: Path | None) -> dict:
    """Run this script again with MILES_K3_KERNELS=interpret and TRITON_INTERPRET=1 (which must be set before
    triton defines a kernel, so not in this process) and return its result; its report prints as it runs."""
    env = {**os.environ, "MILES_K3_KERNELS": "interpret", "TRITON_INTERPRET": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = json_path or Path(tmp) / "ops.json"
        if json_path is None:
            argv = [*argv, "--json", str(out)]
        subprocess.run([sys.executable, __file__, *argv], env=env, check=True)
        return json.loads(out.read_text())


if __name__ == "__main__":
    main()
