"""Shared fixtures: a seeded k3-tiny reference, random adapters, the merged-weights oracle."""

from __future__ import annotations

import torch

from miles_k3.model import K3Config, K3ForCausalLM

CONFIG = K3Config.from_preset("k3-tiny")


def reference(config: K3Config = CONFIG, seed: int = 0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(config).eval()


def token_ids(batch: int = 2, length: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, CONFIG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def random_like(tensors: dict[str, torch.Tensor], seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g) * scale).to(v.dtype) for k, v in tensors.items()}


def merged_state(base: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], scale: float
                 ) -> dict[str, torch.Tensor]:
    """The base HF state with each adapter folded in: W + scale * B @ A (per expert for stacked experts)."""
    state = {k: v.clone() for k, v in base.items()}
    for key, a in tensors.items():
        if not key.endswith(".lora_A"):
            continue
        module = key[: -len(".lora_A")]
        b = tensors[f"{module}.lora_B"]
        if a.dim() == 3:
            prefix, proj = module.rsplit(".", 1)
            for e in range(a.shape[0]):
                state[f"{prefix}.{e}.{proj}.weight"] += scale * b[e] @ a[e]
        else:
            state[f"{module}.weight"] += scale * b @ a
    return state


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())
