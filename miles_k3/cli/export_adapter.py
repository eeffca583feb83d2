"""`miles-k3 export-adapter`: a trained LoRA adapter as the users of its base model hold it.

    miles-k3 export-adapter --adapter run/checkpoints/step_40/adapter --model /ckpt --out exported
    miles-k3 export-adapter --adapter DIR --model /ckpt --out merged --format merged [--dtype bfloat16]
    miles-k3 export-adapter --adapter DIR --model /ckpt --out for_sglang --format sglang [--drop-unsupported]

--adapter reads any PEFT format `miles_k3.model.peft.load_peft` reads (ours, transformers-native
Kimi-Linear, K3's published names, stacked / shared-outer experts); every module must fit --model's config.

--format peft (default): a PEFT adapter directory in the naming of --model's family
  (`miles_k3.model.lora_spec.adapter_family`): K3's published names for a K3 checkpoint (per-expert modules,
  `language_model.` under the VL wrapper), transformers' KimiLinearForCausalLM names and stacked-expert
  `target_parameters` for a Kimi-Linear checkpoint, so `PeftModel.from_pretrained` applies all of it.
--format merged: a full HF checkpoint of --model with the adapter folded into its weights
  (W += alpha / r * B A per module and per routed expert, in fp32, then cast to --dtype), loadable by our
  loader and, in the Kimi-Linear form, by transformers' KimiLinearForCausalLM. MXFP4 routed experts are
  written dense (the adapter's delta is not on the MXFP4 grid); a tied lm_head cannot take an adapter. The
  base directory's other files (tokenizer, generation_config.json, ...) are copied.
--format sglang: a PEFT adapter directory SGLang's LoRA loader (`--lora-paths`, `/load_lora_adapter`) applies
  whole to K3 / Kimi-Linear (`miles_k3.model.peft`'s docstring): K3 names, per-expert routed-expert keys,
  `target_modules` as leaf names, gate/up, expert and MLA q_a/kv_a partners completed with zeros. Modules
  SGLang cannot apply (KDA q/k/v/g/b/f_a/f_b, MLA q_proj/g_proj, the LatentMoE projections) fail the export
  in one line naming them, unless --drop-unsupported, which leaves them out and lists them on stderr.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import torch

from miles_k3.model.assets import builtin_path

FORMATS = ("peft", "merged", "sglang")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>w[123])$")
_WEIGHT_FILES = re.compile(r"^(model.*\.safetensors|model\.safetensors\.index\.json|config\.json)$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter", type=Path, required=True, help="a PEFT LoRA adapter directory")
    p.add_argument("--model", required=True, help="the base checkpoint directory (or builtin:<name>)")
    p.add_argument("--out", type=Path, required=True, help="the directory to write (replaced atomically)")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="peft",
        help="peft: an adapter; merged: a full checkpoint; sglang: an adapter SGLang's LoRA loader applies",
    )
    p.add_argument(
        "--drop-unsupported",
        action="store_true",
        help="--format sglang: leave out the modules SGLang cannot apply (listed on stderr) instead of failing",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="--format merged: the weights' dtype")


def merge_adapter(
    state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], alpha: float, rank: int
) -> dict[str, torch.Tensor]:
    """`state` (logical HF names, no wrapper prefix) with each adapted module's delta alpha / rank * B A
    added in fp32 (stacked expert adapters per expert, `<prefix>.experts.<e>.<w>.weight`); the other tensors
    are the same objects. ValueError naming a module whose weight `state` lacks or whose shape differs."""
    out = dict(state)
    scale = alpha / rank
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors})
    for m in modules:
        a, b = tensors[f"{m}.lora_A"].double(), tensors[f"{m}.lora_B"].double()
        stacked = _STACKED.match(m)
        pairs = (
            [(f"{stacked['prefix']}.{e}.{stacked['proj']}.weight", a[e], b[e]) for e in range(a.shape[0])]
            if stacked
            else [(f"{m}.weight", a, b)]
        )
        for key, ae, be in pairs:
            if key not in out:
                raise ValueError(f"--adapter module {m!r}: the base has no {key!r}")
            w = out[key]
            if tuple(w.shape) != (be.shape[0], ae.shape[1]):
                raise ValueError(
                    f"--adapter module {m!r}: delta [{be.shape[0]}, {ae.shape[1]}] vs {key} {list(w.shape)}"
                )
            out[key] = (w.double() + scale * (be @ ae)).to(w.dtype)
    return out


def _merged(args, config, tensors, spec) -> None:
    from miles_k3.model import K3ForCausalLM
    from miles_k3.model.base import load_base
    from miles_k3.model.checkpoint import keeps_fp32

    if config.tie_word_embeddings and any(k.startswith("lm_head.") for k in tensors):
        raise ValueError("--format merged: the base ties lm_head to the embedding; an lm_head adapter cannot merge")
    _, state = load_base(builtin_path(args.model))
    state = merge_adapter(state, tensors, spec.alpha, spec.rank)
    config = config.replace(experts_mxfp4=False)  # the merged experts are off the MXFP4 grid
    dtype = DTYPES[args.dtype]
    # the router, its bias, A_log and dt_bias stay fp32, as every build and checkpoint keeps them
    state = {k: t if keeps_fp32(k) else t.to(dtype) for k, t in state.items()}
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model.load_state_dict(state, assign=True, strict=True)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise RuntimeError("export-adapter: the merged model has tensors the base state dict did not fill")
    model.save_pretrained(args.out)
    base = Path(builtin_path(args.model))
    for f in base.iterdir():
        if f.is_file() and not _WEIGHT_FILES.match(f.name) and not (args.out / f.name).exists():
            shutil.copy2(f, args.out / f.name)


def cmd_export_adapter(args) -> int:
    from miles_k3.model.base import load_base_config
    from miles_k3.model.layout import hf_prefix
    from miles_k3.model.lora_spec import adapter_family
    from miles_k3.model.peft import FAMILY_SGLANG, load_peft, save_peft, sglang_tensors

    if args.drop_unsupported and args.format != "sglang":
        raise ValueError("--drop-unsupported applies to --format sglang only")
    if not args.adapter.is_dir():
        raise ValueError(f"--adapter {args.adapter}: no such directory")
    model = builtin_path(args.model)
    if not Path(model).is_dir():
        raise ValueError(f"--model {args.model}: no such directory")
    if args.out.resolve() in (args.adapter.resolve(), Path(model).resolve()):
        raise ValueError(f"--out {args.out}: would overwrite an input")
    config = load_base_config(model)
    try:  # under K3's VL wrapper: the prefixed names PEFT wants, or the trainer's unprefixed ones
        tensors, spec = load_peft(args.adapter, module_prefix=hf_prefix(config), config=config)
    except ValueError as e:
        if not hf_prefix(config) or "unexpected tensor" not in str(e):
            raise ValueError(f"--adapter {args.adapter}: {e}") from None
        try:
            tensors, spec = load_peft(args.adapter, config=config)
        except ValueError as e2:
            raise ValueError(f"--adapter {args.adapter}: {e2}") from None
    if args.format == "merged":
        _merged(args, config, tensors, spec)
    else:
        written, family, extra = tensors, adapter_family(config), {}
        if args.format == "sglang":
            try:
                written, partners, dropped = sglang_tensors(tensors, config, drop_unsupported=args.drop_unsupported)
            except ValueError as e:
                raise ValueError(f"--format sglang: {e}") from None
            if dropped:
                print(f"export-adapter: dropped {len(dropped)} modules SGLang cannot apply:", file=sys.stderr)
                for m in dropped:
                    print(f"  {m}", file=sys.stderr)
            family, extra = FAMILY_SGLANG, {"zero_partners": partners}
            tensors = {k: t for k, t in tensors.items() if k.rsplit(".", 1)[0] not in set(dropped)}
        save_peft(
            args.out,
            written,
            spec,
            module_prefix=hf_prefix(config),
            base_model_name_or_path=str(model),
            family=family,
            **extra,
        )
    naming = "sglang" if args.format == "sglang" else adapter_family(config)
    print(f"wrote {args.out} ({args.format}, {len(tensors) // 2} modules, {naming} naming)")
    return 0
