"""Decode-step kernels at k3-small's shapes against what they replace, each timed inside a CUDA graph.

A decode step runs inside a CUDA graph, where a small kernel costs its own time plus a gap of about a
microsecond, not a host launch; so each call here is captured `--reps` times in one graph and the graph's
replay is timed (the best of `--rounds`), giving microseconds per call as the step sees them.

Rows (ours against the baseline, same inputs, same run):
- few-rows linear (`miles_k3.kernels.few_rows_linear`) against `F.linear` (cuBLAS), at the engine's linear
  shapes for 1 to MAX_ROWS rows;
- the routed experts' gate and up as one grouped GEMM over the stacked w13 (`EngineExperts.share_gate_up`)
  against two grouped GEMMs, at a decode step's (token, expert) pairs for batch 1 / 8 / 64 / 256 / 512;
- the bf16 routed experts' GEMMs through `rollout.kernels.expert_gemm.grouped_matmul` (each tile setting of
  EXPERT_TILES) against `torch._grouped_mm` (cuBLAS), at the same pairs;
- the short conv (in place, q / k / v in one launch) and AttnRes mixing against their torch definitions.

    python scripts/bench_decode_kernels.py --json out.json      # CUDA only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from miles_k3 import kernels as seam  # noqa: E402
from miles_k3.model.config import K3Config  # noqa: E402
from rollout.forward import capture_graph  # noqa: E402

LINEAR_SHAPES = [
    (4232, 1024),
    (2048, 1024),
    (1024, 1024),
    (1024, 768),
    (1024, 512),
    (128, 1024),
    (1024, 4096),
    (163840, 1024),
]  # (out, in): KDA's shared GEMM ... the lm_head (k3-small, after share_input_gemms)


def graph_us(fn, reps: int, rounds: int) -> float:
    """Microseconds per call of `fn` replayed from a CUDA graph of `reps` calls (best of `rounds`)."""
    graph, _ = capture_graph(lambda: [fn() for _ in range(reps)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(rounds):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def linear_rows(args) -> list[dict]:
    from miles_k3.kernels.few_rows_linear import MAX_ROWS, linear

    rows = []
    for n, k in LINEAR_SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
        for m in range(1, MAX_ROWS + 1):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ours = graph_us(lambda: linear(x, w), args.reps, args.rounds)
            base = graph_us(lambda: F.linear(x, w), args.reps, args.rounds)
            rows.append(
                {
                    "kernel": "few_rows_linear",
                    "shape": f"{m} x {k} -> {n}",
                    "ours_us": ours,
                    "baseline": "F.linear",
                    "baseline_us": base,
                }
            )
    return rows


def decode_pairs(config: K3Config):
    """(batch, its (token, expert) pairs, rows per expert, their cumulative ends) for a decode step of batch 1 /
    8 / 64 / 256 / 512, experts drawn uniformly."""
    e = config.num_experts
    for batch in (1, 8, 64, 256, 512):
        pairs = batch * config.num_experts_per_token
        counts = torch.bincount(torch.randint(0, e, (pairs,), device="cuda"), minlength=e)
        yield batch, pairs, counts, counts.cumsum(0).to(torch.int32)


def gate_up_rows(args, config: K3Config) -> list[dict]:
    e, w, i = config.num_experts, config.expert_width, config.moe_intermediate_size
    w1, w3 = (torch.randn(e, i, w, device="cuda", dtype=torch.bfloat16) * 0.03 for _ in range(2))
    w13 = torch.cat([w1, w3], dim=1)
    rows = []
    for batch, pairs, counts, offs in decode_pairs(config):
        x = torch.randn(pairs, w, device="cuda", dtype=torch.bfloat16)
        ours = graph_us(lambda: torch._grouped_mm(x, w13.transpose(1, 2), offs=offs), args.reps, args.rounds)
        base = graph_us(
            lambda: (
                torch._grouped_mm(x, w1.transpose(1, 2), offs=offs),
                torch._grouped_mm(x, w3.transpose(1, 2), offs=offs),
            ),
            args.reps,
            args.rounds,
        )
        rows.append(
            {
                "kernel": "experts_gate_up",
                "shape": f"batch {batch}: {pairs} rows, {e} x {2 * i} x {w}",
                "ours_us": ours,
                "baseline": "w1, w3 apart",
                "baseline_us": base,
            }
        )
    return rows


# (block_n, block_k, num_warps, num_stages) tried for the bf16 expert GEMM; the first is grouped_matmul's default
EXPERT_TILES = [(64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 4, 4), (128, 64, 8, 3), (32, 64, 2, 4), (128, 128, 8, 3)]


def expert_gemm_rows(args, config: K3Config) -> list[dict]:
    """The bf16 routed experts' GEMMs (w13 after share_gate_up, then w2) through `expert_gemm.grouped_matmul` at
    each tile setting against `torch._grouped_mm`, at a decode step's (token, expert) pairs; the row keeps the
    default tile's time as ours and lists every setting's."""
    from rollout.kernels.expert_gemm import grouped_matmul

    e, w, i = config.num_experts, config.expert_width, config.moe_intermediate_size
    weights = {
        "w13": torch.randn(e, 2 * i, w, device="cuda", dtype=torch.bfloat16) * 0.03,
        "w2": torch.randn(e, w, i, device="cuda", dtype=torch.bfloat16) * 0.03,
    }
    rows = []
    for batch, pairs, counts, offs in decode_pairs(config):
        for name, wt in weights.items():
            x = torch.randn(pairs, wt.shape[2], device="cuda", dtype=torch.bfloat16)
            sweep = {}
            for bn, bk, warps, stages in EXPERT_TILES:

                def call(x=x, wt=wt, bn=bn, bk=bk, warps=warps, stages=stages):
                    return grouped_matmul(x, counts, wt, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)

                sweep[f"{bn}x{bk}x{warps}x{stages}"] = graph_us(call, args.reps, args.rounds)
            base = graph_us(lambda: torch._grouped_mm(x, wt.transpose(1, 2), offs=offs), args.reps, args.rounds)
            best = min(sweep, key=sweep.get)
            rows.append(
                {
                    "kernel": f"experts_{name}_bf16",
                    "shape": f"batch {batch}: {pairs} rows, {e} x {wt.shape[1]} x {wt.shape[2]}",
                    "ours_us": next(iter(sweep.values())),  # the default tile
                    "baseline": f"torch._grouped_mm; best tile {best}: {sweep[best]:.2f} us",
                    "baseline_us": base,
                    "all_weights_gb_s": wt.numel() * 2 / sweep[best] / 1e3,
                    "sweep": sweep,
                }
            )
    return rows


def row_kernel_rows(args, config: K3Config) -> list[dict]:
    """The short conv and AttnRes mixing: our kernels (inference mode) against the definitions (no_grad)."""
    from miles_k3.ops.attnres import attn_res_mix
    from miles_k3.ops.kda import PooledState
    from miles_k3.ops.short_conv import causal_short_convs

    d = config.kda_num_heads * config.kda_head_dim
    width = config.kda_conv_kernel
    h = config.hidden_size
    rows = []
    for batch in (1, 8, 256):
        pool = torch.randn(2 * batch + 8, 3, d, width - 1, device="cuda", dtype=torch.bfloat16)
        qkv = torch.randn(batch, 1, 3 * d + 136, device="cuda", dtype=torch.bfloat16)  # a shared GEMM's columns
        xs = [qkv[..., j * d : (j + 1) * d] for j in range(3)]
        weights = [torch.randn(d, width, device="cuda") * 0.3 for _ in range(3)]
        index = torch.randperm(pool.shape[0], device="cuda")[:batch]
        states = [PooledState(pool[:, j], index) for j in range(3)]
        conv = [lambda: causal_short_convs(xs, weights, states=states)]
        srcs = [torch.randn(batch, 1, h, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
        nw, pw = torch.rand(h, device="cuda"), torch.randn(1, h, device="cuda")
        mix = [lambda: attn_res_mix(srcs[-1], srcs[:-1], nw, pw, 1e-6)]
        for name, shape, fn in (
            ("short_conv", f"batch {batch}: 3 x {d}, width {width}", conv[0]),
            ("attn_res_mix", f"batch {batch}: 5 sources x {h}", mix[0]),
        ):
            with torch.inference_mode():
                ours = graph_us(fn, args.reps, args.rounds)
            with torch.no_grad():
                base = graph_us(fn, args.reps, args.rounds)
            rows.append(
                {"kernel": name, "shape": shape, "ours_us": ours, "baseline": "torch definition", "baseline_us": base}
            )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--reps", type=int, default=20, help="calls captured in one graph")
    ap.add_argument("--rounds", type=int, default=10, help="replays timed; the best is kept")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_kernels.py: needs CUDA (the kernels' CPU path is Triton's interpreter)")
    if not seam.available("cuda"):
        raise SystemExit("bench_decode_kernels.py: MILES_K3_KERNELS=0 turns the kernels off; unset it")
    torch.manual_seed(0)
    config = K3Config.from_preset(args.preset)
    rows = (
        linear_rows(args) + gate_up_rows(args, config) + expert_gemm_rows(args, config) + row_kernel_rows(args, config)
    )
    print(
        f"decode kernels, {args.preset} shapes, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
        f"us per call inside a CUDA graph (best of {args.rounds} replays of {args.reps} calls)"
    )
    print(f"{'kernel':18s} {'shape':42s} {'ours':>8s} {'baseline':>9s} {'speedup':>8s}  baseline is")
    for r in rows:
        r["speedup"] = r["baseline_us"] / r["ours_us"]
        print(
            f"{r['kernel']:18s} {r['shape']:42s} {r['ours_us']:8.2f} {r['baseline_us']:9.2f} "
            f"{r['speedup']:7.2f}x  {r['baseline']}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"argv": sys.argv, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                indent=1,
            )
        )
    return rows


if __name__ == "__main__":
    main()
