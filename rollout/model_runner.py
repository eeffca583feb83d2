"""Build the engine's K3 model from an HF checkpoint: shared definition, engine linears, adapter pool."""

from __future__ import annotations

from pathlib import Path

import torch

from miles_k3.model.checkpoint import keeps_fp32, load_state_dict
from miles_k3.model.config import K3Config
from miles_k3.model.modeling import K3ForCausalLM
from rollout.linears import EngineExperts, EngineLinear
from rollout.lora import AdapterPool, LoraConfig

QUANTIZE_MODES = ("none", "experts", "all")


def build_engine_model(config: K3Config, state: dict[str, torch.Tensor], *, quantize: str = "experts",
                       lora: LoraConfig | None = None, dtype: torch.dtype = torch.bfloat16,
                       device: str | torch.device = "cpu") -> tuple[K3ForCausalLM, AdapterPool]:
    """`state`: logical HF tensors (as `load_state_dict` returns). quantize: "none" keeps a BF16 (or `dtype`)
    base for parity runs; "experts" packs routed experts as MXFP4; "all" also packs every projection
    whose input width is a multiple of 32 (lm_head stays unquantized: it sets the log-probs).

    The model runs in `dtype` whatever dtype `state` arrives in (the trainer hands over its fp32 base):
    packed weights are quantized from the tensors as given, every other floating tensor is cast to `dtype`
    except the router/decay parameters the checkpoint keeps in fp32."""
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    pool = AdapterPool(lora or LoraConfig(targets=()), dtype=dtype, device=device)

    def linear(spec):
        return EngineLinear(spec, pool, quantize=quantize == "all" and spec.name != "lm_head")

    def experts(spec):
        return EngineExperts(spec, pool, quantize=quantize != "none")

    with torch.device("meta"):
        model = K3ForCausalLM(config, linear=linear, experts=experts)
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True, assign=True)
    _cast_floating(model, dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), pool


def _cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> None:
    # after loading, so MXFP4 packing above saw the source precision; packed buffers are uint8 and stay
    for prefix, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is not None and t.is_floating_point() and t.dtype != dtype \
                        and not keeps_fp32(f"{prefix}.{name}"):
                    cast = t.detach().to(dtype)
                    store[name] = torch.nn.Parameter(cast, requires_grad=False) if store is module._parameters \
                        else cast


def load_engine_model(path: str | Path, **kwargs) -> tuple[K3ForCausalLM, AdapterPool]:
    config = K3Config.from_json_file(Path(path) / "config.json")
    dtype = kwargs.get("dtype", torch.bfloat16)
    return build_engine_model(config, load_state_dict(path, config, dtype), **kwargs)
