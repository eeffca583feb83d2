"""`miles-k3`: inspect K3 configurations and check a model end to end on this machine.

miles-k3 info --preset k3                 # parameter counts, layer plan
miles-k3 info --config path/to/config.json
miles-k3 plan --preset k3 --gpus 64 --gpu-memory-gb 288     # the RL loop per GPU: both phases, layouts, offloads
miles-k3 generate --model builtin:k3-tiny-arith --prompts p.jsonl --json out.json   # batch generation
miles-k3 export-adapter --adapter ckpt/adapter --model /ckpt --out out [--format peft|merged]
    a LoRA adapter in the naming of --model's family (PEFT), or folded into a full checkpoint
miles-k3 smoke --preset k3-tiny --out outputs/k3-tiny-random
    builds a randomly initialized model, writes it as an HF checkpoint, loads it back, greedy-decodes
    with the incremental cache and checks every decode step against a full forward pass.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from miles_k3.cli.export_adapter import __doc__ as export_adapter_doc
from miles_k3.cli.export_adapter import add_arguments as add_export_adapter_arguments
from miles_k3.cli.export_adapter import cmd_export_adapter
from miles_k3.cli.generate import __doc__ as generate_doc
from miles_k3.cli.generate import add_arguments as add_generate_arguments
from miles_k3.cli.generate import cmd_generate
from miles_k3.cli.plan import add_arguments as add_plan_arguments
from miles_k3.cli.plan import cmd_plan
from miles_k3.errors import OneLineParser, guarded
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.generate import greedy_generate
from miles_k3.trainer.base import quiet_megatron


def _config(args) -> K3Config:
    if args.config is not None and not args.config.is_file():
        raise ValueError(f"--config {args.config}: no such file")
    try:
        return K3Config.from_json_file(args.config) if args.config else K3Config.from_preset(args.preset)
    except (ValueError, TypeError, KeyError) as e:
        flag = f"--config {args.config}" if args.config else f"--preset {args.preset}"
        raise ValueError(f"{flag}: {e}") from None


def cmd_info(args) -> int:
    c = _config(args)
    kinds = "".join("K" if k == "kda" else "M" for k in c.layer_kinds)
    print(f"layers        {c.num_hidden_layers} ({c.layer_kinds.count('kda')} KDA, {c.layer_kinds.count('mla')} MLA)")
    print(f"layer plan    {kinds}")
    print(f"hidden        {c.hidden_size}, vocab {c.vocab_size}")
    print(f"experts       {c.num_experts} (top-{c.num_experts_per_token}), latent width {c.moe_latent_size}")
    print(f"attn res      block size {c.attn_res_block_size or 'off'}")
    print(f"parameters    {c.num_parameters():,} total, {c.num_active_parameters():,} active per token")
    return 0


def cmd_smoke(args) -> int:
    c = _config(args)
    if c.num_parameters() > 5e9:
        raise SystemExit(f"refusing to build {c.num_parameters():.3g} parameters on this machine; use k3-tiny")
    torch.manual_seed(args.seed)
    model = K3ForCausalLM(c).eval()
    out = Path(args.out)
    model.save_pretrained(out)
    loaded = K3ForCausalLM.from_pretrained(out).eval()
    prompt = torch.randint(0, c.vocab_size, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    new_tokens, logps = greedy_generate(loaded, prompt, args.new_tokens)
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        full = loaded(torch.cat([prompt, new_tokens], dim=1)).logits.float().log_softmax(-1)
    n = new_tokens.shape[1]
    full_logps = full[:, args.prompt_len - 1 : args.prompt_len - 1 + n].gather(-1, new_tokens[..., None])[..., 0]
    diff = (full_logps - logps).abs().max().item()
    print(f"checkpoint    {out} ({sum(p.stat().st_size for p in out.iterdir()) / 1e6:.1f} MB)")
    print(f"generated     {args.batch} x {n} tokens in {elapsed:.2f} s ({args.batch * n / elapsed:.0f} tok/s, CPU)")
    print(f"decode vs full forward: max |log-prob diff| = {diff:.2e}")
    if diff > 1e-3:
        print("FAILED: incremental decode disagrees with the full forward", file=sys.stderr)
        return 1
    print("OK")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="miles-k3", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn in (("info", cmd_info), ("smoke", cmd_smoke)):
        p = sub.add_parser(name)
        p.set_defaults(fn=fn)
        p.add_argument("--preset", default="k3-tiny")
        p.add_argument("--config", type=Path, help="an HF config.json instead of a preset")
    plan = sub.add_parser(
        "plan", help="the RL loop's memory per GPU in both phases, over layouts and offloads (miles_k3.cli.plan)"
    )
    plan.set_defaults(fn=cmd_plan)
    add_plan_arguments(plan)
    generate = sub.add_parser(
        "generate",
        help="offline batch generation through the engine (miles_k3.cli.generate)",
        description=generate_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.set_defaults(fn=cmd_generate)
    add_generate_arguments(generate)
    export = sub.add_parser(
        "export-adapter",
        help="a LoRA adapter as PEFT for the base's family, or merged into it (miles_k3.cli.export_adapter)",
        description=export_adapter_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.set_defaults(fn=cmd_export_adapter)
    add_export_adapter_arguments(export)
    smoke = sub.choices["smoke"]
    smoke.add_argument("--out", default="outputs/k3-tiny-random")
    smoke.add_argument("--seed", type=int, default=0)
    smoke.add_argument("--batch", type=int, default=2)
    smoke.add_argument("--prompt-len", type=int, default=48)
    smoke.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    quiet_megatron()  # its import-time notes would bury the one line of an error
    # user mistakes (a flag, a file, a config, a checkpoint, an address) get one line and status 2
    return guarded(f"miles-k3 {args.cmd}", lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
