"""One rank of a multi-process run for the TP tests (spawned; gloo on CPU). Also run in-process for TP=1.

`run_case` builds the policy for a config, loads a seeded random adapter, runs a training forward with
LoRA dropout on, a cross-entropy backward, clips the adapter gradient norm, and returns what the test
compares: logits, base logits (adapters disabled), full adapter gradients, the gradient norm and the
exported adapter.
"""

from __future__ import annotations

import torch

from megatron_patches.lora import (
    adapter_grads,
    adapter_state,
    adapters_disabled,
    clip_lora_grad_norm_,
    load_adapter_state,
)
from megatron_patches.model import build_policy, reference_state
from miles_k3.model import K3Config
from miles_k3.model.lora_spec import LoraSpec
from tests.megatron_patches.common import layout, spawned_rank

SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.25)
# fp64, so that TP=2 vs TP=1 differences are summation order only (~1e-12). In fp32 the gradients of
# k3-tiny's first layer carry ~3e-4 relative error against fp64 at TP=1 already (measured), which would
# hide a real mismatch of that size.
DTYPE = torch.float64


def configs() -> dict[str, K3Config]:
    tiny = K3Config.from_preset("k3-tiny")
    # Kimi-Linear form: softplus gate, low-rank output gate, [1,1,H,1] A_log, plain q_proj, no AttnRes /
    # LatentMoE; with tied embeddings.
    kimi = tiny.kimi_linear_form().replace(tie_word_embeddings=True)
    return {"k3-tiny": tiny, "kimi-linear-form": kimi}


NO_DROPOUT = LoraSpec(rank=SPEC.rank, alpha=SPEC.alpha, dropout=0.0)


def reference_cases() -> dict[str, tuple[K3Config, bool, LoraSpec]]:
    """The TP=1 cases that the sequence-parallel cases compare with -> (config, packed, adapters)."""
    tiny, kimi = configs()["k3-tiny"], configs()["kimi-linear-form"]
    return {
        "packed/k3-tiny": (tiny, True, SPEC),
        "packed/kimi-linear-form": (kimi, True, SPEC),
        "no-dropout/k3-tiny": (tiny, False, NO_DROPOUT),
    }


def sequence_parallel_cases() -> dict[str, tuple[K3Config, bool, LoraSpec]]:
    """Cases run at TP=2 with sequence parallelism, named "sp/" + the TP=1 case they must equal. Packed:
    18 tokens split evenly, so even the LoRA dropout masks are those of TP=1. Rows of 9 tokens: the model
    pads to 10, which changes the shape the dropout masks are drawn over, so that case has no dropout."""
    return {f"sp/{name}": case for name, case in reference_cases().items()}


def run_case(
    config: K3Config,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    sequence_parallel: bool = False,
    packed: bool = False,
    lora: LoraSpec = SPEC,
) -> dict:
    """packed: one row of two sequences (8 + 10 tokens, `cu_seqlens`) instead of two rows of 9."""
    shape, cu_seqlens = ((1, 18), torch.tensor([0, 8, 18], device=device)) if packed else ((2, 9), None)
    ids = torch.randint(3, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed)).to(device)
    target = torch.randint(3, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed + 1))
    policy = build_policy(
        config,
        reference_state(config, seed),
        lora,
        seed=seed,
        dtype=dtype,
        device=device,
        sequence_parallel=sequence_parallel,
    )
    g = torch.Generator().manual_seed(seed + 2)
    adapter = {
        k: (torch.randn(v.shape, generator=g) * 0.3).to(device=device, dtype=dtype)
        for k, v in adapter_state(policy).items()
    }
    load_adapter_state(policy, adapter)
    residual = []  # the sequence length of the residual stream (this rank's slice under sequence parallelism)
    policy.model.layers[0].input_layernorm.register_forward_hook(lambda m, a, out: residual.append(out.shape[1]))
    logits = policy.tp.gather_last_dim(policy(ids, cu_seqlens=cu_seqlens).logits)  # vocab slices -> all
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1).to(device)
    )
    loss.backward()
    grads = adapter_grads(policy)
    norm = clip_lora_grad_norm_(policy, max_norm=1e-3)
    clipped = adapter_grads(policy)
    with torch.no_grad(), adapters_disabled(policy):
        base = policy.tp.gather_last_dim(policy.eval()(ids, cu_seqlens=cu_seqlens).logits)
    out = {
        "logits": logits.detach(),
        "base": base,
        "grads": grads,
        "norm": norm,
        "clipped": clipped,
        "adapter": adapter_state(policy),
        "residual_len": residual[0],
    }
    return _to_cpu(out)


def _to_cpu(x):
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x.cpu() if isinstance(x, torch.Tensor) else x


def worker(
    rank: int,
    world: int,
    port: int,
    tp: int,
    out: str,
    device: str = "cpu",
    dtype: torch.dtype = DTYPE,
    watchdog_s: float = 300.0,
) -> None:
    """One rank: gloo on CPU, nccl with one GPU per rank on `device="cuda"`. A rank stuck in a collective
    past `watchdog_s` prints every thread's stack and exits, so a hang fails the test instead of CI."""
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    with spawned_rank(rank, world, port, watchdog_s, "nccl" if device.startswith("cuda") else "gloo"), layout(tp=tp):
        results = {name: run_case(c, dtype=dtype, device=device) for name, c in configs().items()}
        if tp > 1:
            results |= {
                name: run_case(c, dtype=dtype, device=device, sequence_parallel=True, packed=packed, lora=lora)
                for name, (c, packed, lora) in sequence_parallel_cases().items()
            }
    torch.save(results, f"{out}/rank{rank}.pt")
