"""One MLA layer's decode attention over the KV pages: the engine's torch path against the Triton kernel.

    python scripts/bench_mla.py --device cuda --batch-sizes 1,64,256 --histories 512,2048,8192 --json mla.json

Per batch size N and history length S (every request at S - 1 computed positions, one query each, its rows
scattered over the page buffer as the engine's pages are): `rollout.attention.gathered_attention` (gathers
[N, S, R + Dr] out of the pages, upcasts, materializes scores and softmax: `EngineConfig(mla_attention=
"torch")`, the default) against `rollout.attention.paged_attention` (the kernel reading the pages in place:
`mla_attention="triton"`), at the preset's MLA widths (k3-small: 8 heads, R = 256, Dr = 64). On CUDA each
path is captured in a CUDA graph, as the engine's decode step is, and replayed --steps times; the table gives
the median microseconds a call, the history bytes a call must read (N x S rows of R + Dr) over that time, and
the largest difference between the two outputs. On CPU only the torch path runs (the kernel needs CUDA).
Writes JSON with --json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from miles_k3.model import K3Config  # noqa: E402
from rollout.attention import gathered_attention, paged_attention  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _sizes(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,64,256, got {text!r}")
    return values


def inputs(config: K3Config, n: int, s: int, dtype: torch.dtype, device: str, seed: int) -> dict:
    """A decode step's attention inputs: N requests at position S - 1, their rows a random permutation of the
    buffer's (row 0 kept as the zero row)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, r, dr = config.mla_num_heads, config.kv_lora_rank, config.qk_rope_head_dim
    rows = n * s + 1
    buf = torch.randn(rows, r + dr, device=device, generator=g).to(dtype)
    hist_rows = (torch.randperm(n * s, device=device, generator=g) + 1).view(n, s)
    q_pos = torch.full((n, 1), s - 1, dtype=torch.long, device=device)
    arange = torch.arange(n, device=device)
    lay = SimpleNamespace(hist_rows=hist_rows, q_pos=q_pos, q_index=arange[:, None], out_index=arange)
    hidden = torch.arange(s, device=device)[None, None, None, :] > q_pos[:, None, :, None]
    q_lat = torch.randn(n, h, r, device=device, generator=g).to(dtype)
    q_rope = torch.randn(n, h, dr, device=device, generator=g).to(dtype)
    return dict(q_lat=q_lat, q_rope=q_rope, buf=buf, lay=lay, scale=(config.qk_head_dim) ** -0.5, r=r, hidden=hidden)


def time_call(fn, steps: int, device: str) -> float:
    """Median microseconds of fn(): replayed from a CUDA graph on CUDA, eager elsewhere."""
    fn()  # warm-up: Triton compiles, cuBLAS picks its kernels
    if device != "cuda":
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bench(config: K3Config, n: int, s: int, dtype: torch.dtype, device: str, steps: int, seed: int) -> dict:
    x = inputs(config, n, s, dtype, device, seed)
    row = {"batch": n, "history": s, "history_mb": n * s * x["buf"].shape[1] * x["buf"].element_size() / 1e6}
    with torch.inference_mode():

        def torch_path():
            return gathered_attention(x["q_lat"], x["q_rope"], x["buf"], x["lay"], x["scale"], x["r"], x["hidden"])

        def kernel_path():
            return paged_attention(x["q_lat"], x["q_rope"], x["buf"], x["lay"], x["scale"], x["r"])

        try:
            row["torch_us"] = time_call(torch_path, steps, device)
        except torch.OutOfMemoryError:
            row["torch_us"] = None  # the gathered fp32 history does not fit
        if device == "cuda":
            torch.cuda.empty_cache()
            row["kernel_us"] = time_call(kernel_path, steps, device)
            if row["torch_us"] is not None:
                row["max_abs_diff"] = float((kernel_path().float() - torch_path().float()).abs().max())
    for key in ("torch_us", "kernel_us"):
        if row.get(key):
            row[key.replace("_us", "_gb_s")] = row["history_mb"] / 1e3 / (row[key] / 1e6)
    if row.get("torch_us") and row.get("kernel_us"):
        row["speedup"] = row["torch_us"] / row["kernel_us"]
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--batch-sizes", type=_sizes, default=[1, 64, 256])
    ap.add_argument("--histories", type=_sizes, default=[512, 2048, 8192])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine")
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    config = K3Config.from_preset(args.preset)
    rows = []
    for n in args.batch_sizes:
        for s in args.histories:
            rows.append(bench(config, n, s, DTYPES[args.dtype], args.device, args.steps, args.seed))
            print("row", json.dumps(rows[-1]), flush=True)

    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    print(
        f"\nMLA decode attention, {args.preset} ({config.mla_num_heads} heads, R={config.kv_lora_rank}, "
        f"Dr={config.qk_rope_head_dim}), {args.dtype}, {name}, median of {args.steps}"
    )
    columns = [
        ("batch", "batch", 6, "d"),
        ("history", "history", 8, "d"),
        ("MB read", "history_mb", 8, ".1f"),
        ("torch us", "torch_us", 9, ".1f"),
        ("GB/s", "torch_gb_s", 6, ".0f"),
        ("kernel us", "kernel_us", 10, ".1f"),
        ("GB/s", "kernel_gb_s", 6, ".0f"),
        ("speedup", "speedup", 8, ".2f"),
        ("max diff", "max_abs_diff", 9, ".1e"),
    ]
    print(" ".join(f"{head:>{width}s}" for head, _, width, _ in columns))
    for r in rows:  # a dash where a path did not run
        print(
            " ".join(
                f"{r[key]:{width}{spec}}" if r.get(key) is not None else f"{'-':>{width}s}"
                for _, key, width, spec in columns
            )
        )
    result = {
        "rows": rows,
        "device": name,
        "torch": torch.__version__,
        "preset": args.preset,
        "dtype": args.dtype,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_mla.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
