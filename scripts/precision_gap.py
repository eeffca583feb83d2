"""How far bf16 moves a preset's log-probs from fp32, in the reference model itself.

    python scripts/precision_gap.py --preset k3-small --json precision_gap.json

The GRPO loop reports `train_rollout_logprob_abs_diff`: the engine's sampled-token log-probs against the
trainer's recomputation. Two bf16 implementations of one model can differ by no less than bf16 moves the
model itself, so this script measures that floor: the reference `K3ForCausalLM` built from the same
weights (the preset as its checkpoint stores it, on the arithmetic task's vocabulary, like the
`k3_small_gpu` recipe) in fp32 and in bf16 (router and decay parameters kept fp32, as checkpoints keep
them), teacher-forced on the same random token ids; mean and max |log p_fp32 - log p_bf16| of each next
token. Rows: the K3 form, the Kimi-Linear form, and variants with one K3 feature swapped for
Kimi-Linear's, to show which one the gap comes from. CPU by default (fp32 and bf16 matmuls there are exact-rounding
references).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
from bench_forward import kimi_linear_form  # scripts/ is on the path when run as a script

from miles_k3.model.checkpoint import as_stored, stored_dtype
from miles_k3.model.config import K3Config
from miles_k3.model.modeling import K3ForCausalLM, reference_state
from miles_k3.tasks.arithmetic import ArithmeticTokenizer


def _swap(**change):
    return lambda config: config.replace(**change)


VARIANTS = {
    "k3 form": lambda config: config,
    "Kimi-Linear form (the TRL comparison's model)": kimi_linear_form,
    "LatentMoE off (experts at full width)": _swap(moe_latent_size=None, moe_latent_norm=False),
    "LatentMoE without its post-expert norm": _swap(moe_latent_norm=False),
    "AttnRes off": _swap(attn_res_block_size=0),
    "SiLU instead of SiTU": _swap(hidden_act="silu"),
    "softplus KDA gate": _swap(kda_gate_form="softplus"),
    "no MLA output gate": _swap(mla_output_gate=False),
}


def next_token_logprobs(
    config: K3Config, state: dict[str, torch.Tensor], dtype: torch.dtype, ids: torch.Tensor
) -> torch.Tensor:
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model.load_state_dict({k: v.to(stored_dtype(k, dtype)) for k, v in state.items()}, assign=True)
    with torch.no_grad():
        logprobs = torch.log_softmax(model.eval()(ids).logits.float(), dim=-1)
    return logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=24)
    ap.add_argument("--vocab-size", type=int, default=32, help="the k3_small_gpu recipe's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    tok = ArithmeticTokenizer
    base = K3Config.from_preset(
        args.preset,
        vocab_size=args.vocab_size,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    ids = torch.randint(
        3, args.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(args.seed)
    )
    rows = []
    for name, variant in VARIANTS.items():
        config = variant(base)
        state = as_stored(reference_state(config, args.seed), config)
        gap = (
            next_token_logprobs(config, state, torch.float32, ids)
            - next_token_logprobs(config, state, torch.bfloat16, ids)
        ).abs()
        rows.append({"variant": name, "mean_abs_dlogp": float(gap.mean()), "max_abs_dlogp": float(gap.max())})
        print(
            f"{name:40s} mean |d logp| {rows[-1]['mean_abs_dlogp']:.3f}  max {rows[-1]['max_abs_dlogp']:.3f}",
            flush=True,
        )
    result = {
        "preset": args.preset,
        "vocab_size": args.vocab_size,
        "batch": args.batch,
        "length": args.length,
        "seed": args.seed,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "scripts/precision_gap.py", *(argv if argv is not None else sys.argv[1:])]),
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
