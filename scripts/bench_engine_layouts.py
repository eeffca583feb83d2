"""The sharded engine's layouts against one device: greedy agreement, decode tok/s by batch size, and the
logical MLA KV capacity a device's pool holds.

    python scripts/bench_engine_layouts.py --device cuda --layouts single,tp2,tp2_dcp2,ep2 --batch-sizes 1,64,256 \
        --json engine_layouts.json
    python scripts/bench_engine_layouts.py --layouts single,tp2 --batch-sizes 2 --gen-len 6   # the CPU check

Each layout but `single` is one group of processes (nccl with a GPU per rank on CUDA, gloo on CPU), each
building its rank of the sharded engine (`rollout.build.build_sharded_engine`: attention heads split,
routed experts split by their intermediate dim or, with EP, whole per rank; DCP shards MLA's KV by position)
from the same seeded weights of --preset, made peaked (`bench_spec.peak`: the greedy next token wins by a
wide margin, so bf16 rounding between layouts does not flip it; every layer still runs in full). `single`
is the one-process engine. Rank 0 runs, per batch size, an untimed then a timed `generate` of that many
greedy requests (random prompts of --prompt-len tokens, --gen-len new tokens); the other ranks follow.

decode_tok_s: the tokens after each request's first over the seconds after every request has its first (the
prefill samples it), as `bench_spec.py` measures. agree: the share of rows whose tokens equal `single`'s;
prefix: their mean common prefix over --gen-len (fp32 on CPU must agree exactly). kv_tokens: the logical
tokens of MLA KV the pools of --memory-gb hold per device (a DCP group spreads a page's rows over its
ranks, so more pages fit). A layout that fails is a row with its error, and the next one runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layouts import names_from  # noqa: E402  (scripts/, next to this file)
from bench_spec import drive, random_prompts, target_state  # noqa: E402

from megatron_patches.parallel import end_world, free_port  # noqa: E402
from miles_k3.model.config import PRESETS, K3Config  # noqa: E402
from rollout.config import EngineConfig  # noqa: E402
from rollout.engine import Engine  # noqa: E402
from rollout.model_runner import build_engine_model  # noqa: E402
from rollout.request import SamplingParams  # noqa: E402

# name -> (ranks, whole experts per rank (EP), DCP group size)
LAYOUTS = {
    "single": (1, False, 1),
    "tp2": (2, False, 1),
    "tp2_dcp2": (2, False, 2),
    "ep2": (2, True, 1),
    "tp4": (4, False, 1),
    "tp4_dcp2": (4, False, 2),
    "tp4_dcp4": (4, False, 4),
    "ep4": (4, True, 1),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="default: k3-small on cuda, k3-tiny on cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument(
        "--layouts", type=names_from(LAYOUTS), default="single,tp2", help=f"comma-separated, from {', '.join(LAYOUTS)}"
    )
    ap.add_argument("--batch-sizes", default="1,64,256", help="decode batch sizes, e.g. 1,64,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64, help="new tokens per request (>= 2)")
    ap.add_argument("--memory-gb", type=float, help="each device's pool budget (default: 16 on cuda, 0.25 on cpu)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds a layout may take")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        ap.error(f"--batch-sizes: expected comma-separated integers, got {args.batch_sizes!r}")
    if min(args.batch_sizes) < 1 or args.prompt_len < 1 or args.gen_len < 2:
        ap.error("--batch-sizes and --prompt-len must be >= 1, --gen-len >= 2")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    args.preset = args.preset or ("k3-small" if cuda else "k3-tiny")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.memory_gb = args.memory_gb or (16.0 if cuda else 0.25)
    most = max(LAYOUTS[n][0] for n in args.layouts)
    if cuda and torch.cuda.device_count() < most:
        ap.error(f"--layouts need {most} GPUs, {torch.cuda.device_count()} visible")
    return args


def engine_config(args, dcp: int) -> EngineConfig:
    return EngineConfig(
        memory_bytes=int(args.memory_gb * 2**30),
        max_running=max(args.batch_sizes),
        max_seq_len=max(256, args.prompt_len + args.gen_len + 1),
        dcp_size=dcp,
    )


def weights(args) -> tuple[K3Config, dict]:
    """The preset's seeded weights, peaked: the same on every rank."""
    return target_state(f"preset:{args.preset}", peaked=True)


def timed(engine: Engine, prompts: list[list[int]], gen_len: int) -> tuple[list[list[int]], float]:
    """Greedy outputs and decode tok/s (the tokens after each request's first over the seconds after every
    request has it)."""
    done, _, seconds = drive(engine, prompts, [SamplingParams(temperature=0, max_new_tokens=gen_len)] * len(prompts))
    outs = [c.output_ids for c in done]
    return outs, round(sum(len(o) - 1 for o in outs) / max(seconds, 1e-9), 1)


def measure(engine: Engine, args, vocab: int) -> dict:
    """Rank 0's runs: per batch size, the greedy outputs and decode tok/s, and the pools' KV capacity."""
    out = {"kv_tokens": engine.kv.allocator.capacity * engine.config.page_size, "batches": {}}
    for b in args.batch_sizes:
        prompts = random_prompts(b, args.prompt_len, vocab)
        timed(engine, prompts, args.gen_len)  # untimed: graphs, autotuning
        outs, tok_s = timed(engine, prompts, args.gen_len)
        out["batches"][b] = {"outputs": outs, "decode_tok_s": tok_s}
    return out


def single(args) -> dict:
    config, state = weights(args)
    model, _ = build_engine_model(config, state, quantize="none", dtype=DTYPES[args.dtype], device=args.device)
    return measure(Engine(model, engine_config(args, 1)), args, config.vocab_size)


def worker(rank: int, world: int, port: int, ep: bool, dcp: int, args, out: str) -> None:
    import faulthandler

    from rollout.build import build_sharded_engine

    faulthandler.dump_traceback_later(args.timeout, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        rank=rank,
        world_size=world,
        **({"device_id": torch.device("cuda", rank)} if cuda else {}),
    )
    try:
        config, state = weights(args)
        engine = build_sharded_engine(
            state,
            engine_config(args, dcp),
            model_config=config,
            ep=ep,
            quantize="none",
            dtype=DTYPES[args.dtype],
            device=f"cuda:{rank}" if cuda else "cpu",
        )
        if engine.is_leader:
            result = measure(engine, args, config.vocab_size)
            engine.stop_followers()
            Path(out).write_text(json.dumps(result))
        else:
            engine.follow()
    finally:
        end_world()


def run_layout(name: str, args) -> dict:
    """The layout's rank-0 measurements, or {"error": its last line}."""
    ranks, ep, dcp = LAYOUTS[name]
    try:
        if ranks == 1:
            result = single(args)
            gc.collect()  # its pools leave the device before the ranks of the next layout allocate theirs
            if args.device == "cuda":
                torch.cuda.empty_cache()
            return result
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rank0.json")
            mp.spawn(worker, args=(ranks, free_port(), ep, dcp, args, out), nprocs=ranks, join=True)
            return json.loads(
                Path(out).read_text(), object_hook=lambda d: {int(k) if k.isdigit() else k: v for k, v in d.items()}
            )
    except Exception as e:  # noqa: BLE001 - a failed layout is a row, and the next one runs
        lines = [ln for ln in (str(e) or traceback.format_exc()).strip().splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else type(e).__name__}


def rows_of(results: dict[str, dict], args) -> list[dict]:
    """One row per (layout, batch size), against `single`'s outputs and rate where it ran."""
    one = results.get("single", {})
    rows = []
    for name, res in results.items():
        ranks = LAYOUTS[name][0]
        if "error" in res:
            rows.append(dict(layout=name, ranks=ranks, status=f"failed: {res['error']}"))
            continue
        for b in args.batch_sizes:
            got, base = res["batches"][b], one.get("batches", {}).get(b)
            row = dict(
                layout=name,
                ranks=ranks,
                status="ok",
                batch=b,
                decode_tok_s=got["decode_tok_s"],
                kv_tokens=res["kv_tokens"],
            )
            if base is not None:
                pairs = list(zip(got["outputs"], base["outputs"]))
                row["agree"] = round(sum(a == c for a, c in pairs) / len(pairs), 3)
                row["prefix"] = round(sum(_common(a, c) for a, c in pairs) / (len(pairs) * args.gen_len), 3)
                row["vs_single"] = round(got["decode_tok_s"] / base["decode_tok_s"], 3)
                row["kv_vs_single"] = round(res["kv_tokens"] / one["kv_tokens"], 3)
            rows.append(row)
    return rows


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    results = {}
    for name in args.layouts:
        start = time.perf_counter()
        results[name] = run_layout(name, args)
        print(
            f"{name}: {'failed: ' + results[name]['error'] if 'error' in results[name] else 'ok'} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    rows = rows_of(results, args)
    head = (
        "layout",
        "ranks",
        "batch",
        "status",
        "agree",
        "prefix",
        "decode_tok_s",
        "vs_single",
        "kv_tokens",
        "kv_vs_single",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join("-" if r.get(h) is None else str(r.get(h)) for h in head) + " |")
    if args.json:
        meta = dict(
            device=args.device,
            preset=args.preset,
            dtype=args.dtype,
            memory_gb=args.memory_gb,
            prompt_len=args.prompt_len,
            gen_len=args.gen_len,
            gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            command=" ".join(
                ["python", "scripts/bench_engine_layouts.py", *(argv if argv is not None else sys.argv[1:])]
            ),
        )
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
