"""Forward throughput of the reference K3 model, with transformers' KimiLinear as the peer.

    python scripts/bench_forward.py --preset k3-small --device cuda --seq-lens 1024,4096,16384 \
        --peer hf --json bench_forward.json

For each sequence length it times one full forward (prefill: logits for every
position) and reports tokens/s (median of --iters after --warmup). With
`--peer hf` it also builds the Kimi-Linear form of the preset (same widths,
no AttnRes / LatentMoE / SiTU / gates, which transformers lacks), times our
model and transformers' `KimiLinearForCausalLM` on the same weights in the
same run, and reports the ratio. Prints a table; writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from miles_k3.compat.transformers_kimi import use_torch_fallbacks
from miles_k3.model import K3Config, K3ForCausalLM

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def kimi_linear_form(config: K3Config) -> K3Config:
    """The nearest configuration transformers' KimiLinear can run: K3 minus its K3-only features."""
    return config.kimi_linear_form()


def time_forward(model, ids: torch.Tensor, warmup: int, iters: int) -> float:
    """Median seconds of one forward over `ids`."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    times = []
    with torch.inference_mode():
        for i in range(warmup + iters):
            sync()
            start = time.perf_counter()
            model(ids)
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_ours(config: K3Config, dtype, device) -> K3ForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        return K3ForCausalLM(config).to(dtype).eval()


def hf_peer(ours: K3ForCausalLM, dtype, device):
    """transformers' KimiLinearForCausalLM loaded from our checkpoint of `ours` (same weights)."""
    from transformers import KimiLinearForCausalLM

    if device.type != "cuda":
        use_torch_fallbacks()
    with tempfile.TemporaryDirectory() as tmp:
        ours.float().save_pretrained(Path(tmp))
        ours.to(dtype)
        return KimiLinearForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--seq-lens", default="256,1024")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--peer", choices=["none", "hf"], default="none")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    config = K3Config.from_preset(args.preset)

    rows = []
    runs = [("miles-k3", config, None)]
    if args.peer == "hf":
        runs += [
            ("miles-k3 (kimi-linear form)", kimi_linear_form(config), "ours"),
            ("transformers KimiLinear", kimi_linear_form(config), "hf"),
        ]
    peer_model = None
    for label, cfg, role in runs:
        model = build_ours(cfg, dtype, device)
        if role == "hf":
            model = hf_peer(peer_model, dtype, device)
        elif role == "ours":
            peer_model = model
        for t in seq_lens:
            ids = torch.randint(0, cfg.vocab_size, (args.batch, t), device=device)
            try:
                sec = time_forward(model, ids, args.warmup, args.iters)
                rows.append(
                    {"model": label, "seq_len": t, "batch": args.batch, "ms": sec * 1e3, "tok_s": args.batch * t / sec}
                )
            except torch.OutOfMemoryError:
                rows.append({"model": label, "seq_len": t, "batch": args.batch, "ms": None, "tok_s": None})
                torch.cuda.empty_cache()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    by = {(r["model"], r["seq_len"]): r for r in rows}
    for r in rows:
        peer = by.get(("transformers KimiLinear", r["seq_len"]))
        if r["model"] == "miles-k3 (kimi-linear form)" and peer and peer["tok_s"] and r["tok_s"]:
            r["vs_transformers"] = r["tok_s"] / peer["tok_s"]
    print(f"{'model':<30} {'seq':>7} {'batch':>5} {'ms':>10} {'tok/s':>12} {'vs HF':>7}")
    for r in rows:
        ms = f"{r['ms']:.2f}" if r["ms"] else "OOM"
        tok = f"{r['tok_s']:.0f}" if r["tok_s"] else "-"
        ratio = f"{r['vs_transformers']:.2f}x" if "vs_transformers" in r else ""
        print(f"{r['model']:<30} {r['seq_len']:>7} {r['batch']:>5} {ms:>10} {tok:>12} {ratio:>7}")
    result = {
        "preset": args.preset,
        "dtype": args.dtype,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "params": config.num_parameters(),
        "active_params": config.num_active_parameters(),
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
