"""One rank of the vocab-parallel tests (spawned, gloo), also run in-process at TP=1.

`run_cases` builds a small head in each form (an untied `ColumnLinear` with a LoRA adapter,
a tied `VocabParallelEmbedding`) from the same full fp64 tensors on every TP size, runs `token_logprobs`
chunked, backpropagates a weighted sum of the log-probs and returns what the test compares with the full
single-process computation: log-probs, entropies, the hidden states' and the adapter's gradients (this
rank's slice of B), the embedding lookup, and the widest logits block any chunk produced.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from megatron_patches.linears import ColumnLinear
from megatron_patches.parallel import MegatronTP
from megatron_patches.vocab_parallel import VocabParallelEmbedding, token_logprobs
from miles_k3.model.linear import LinearSpec
from miles_k3.model.lora_spec import LoraSpec
from tests.megatron_patches.common import layout, spawned_rank

V, D, M = 48, 12, 13  # vocabulary, width, tokens (chunks of 5 / 4 leave a ragged last chunk)
DTYPE = torch.float64
LORA = LoraSpec(rank=3, alpha=6.0, dropout=0.0, targets=(r"lm_head$",))
CASES = {"untied-lora": dict(tied=False, temperature=0.7, chunk=5), "tied": dict(tied=True, temperature=1.3, chunk=4)}


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The full tensors every TP size starts from (targets hit every rank's slice of the vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "W": torch.randn(V, D, generator=g, dtype=DTYPE),
        "A": torch.randn(LORA.rank, D, generator=g, dtype=DTYPE),
        "B": torch.randn(V, LORA.rank, generator=g, dtype=DTYPE) * 0.5,
        "hidden": torch.randn(M, D, generator=g, dtype=DTYPE),
        "targets": torch.randint(0, V, (M,), generator=g),
        "weights": torch.randn(M, generator=g, dtype=DTYPE),
        "ids": torch.randint(0, V, (2, 7), generator=g),
    }


def _policy(tied: bool, t: dict[str, torch.Tensor]) -> nn.Module:
    tp = MegatronTP()
    rows = slice(tp.rank * V // tp.size, (tp.rank + 1) * V // tp.size)
    mp = ModelParallelConfig(
        tensor_model_parallel_size=tp.size,
        params_dtype=DTYPE,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    policy = nn.Module()
    policy.config = SimpleNamespace(tie_word_embeddings=tied, vocab_size=V)
    policy.model = nn.Module()
    policy.model.embed_tokens = VocabParallelEmbedding(V, D, mp)
    policy.model.embed_tokens.weight.data.copy_(t["W"][rows])
    if not tied:
        head = policy.lm_head = ColumnLinear(LinearSpec("lm_head", D, V, "column"), mp, tp, LORA)
        head.weight.data.copy_(t["W"][rows])
        head.lora.reset(0, DTYPE, "cpu")
        head.lora.A.data.copy_(t["A"])
        head.lora.B.data.copy_(t["B"][rows])
    return policy


def run_cases() -> dict:
    t = tensors()
    out = {}
    for name, case in CASES.items():
        policy = _policy(case["tied"], t)
        widths = []
        logits_module = policy.model.embed_tokens if case["tied"] else policy.lm_head
        if not case["tied"]:
            policy.lm_head.register_forward_hook(lambda m, a, y: widths.append(tuple(y.shape)))
        hidden = t["hidden"].clone().requires_grad_(True)
        logp, entropy = token_logprobs(
            policy, hidden, t["targets"], case["temperature"], with_entropy=True, chunk_size=case["chunk"]
        )
        (logp * t["weights"]).sum().backward()
        with torch.no_grad():
            logp_nograd, none = token_logprobs(
                policy, t["hidden"], t["targets"], case["temperature"], chunk_size=case["chunk"]
            )
        res = {
            "logp": logp.detach(),
            "entropy": entropy,
            "grad_hidden": hidden.grad,
            "logp_nograd": logp_nograd,
            "no_entropy": none is None,
            "widths": widths,
            "embed": logits_module(t["ids"]) if case["tied"] else None,
        }
        if not case["tied"]:
            res |= {"grad_A": policy.lm_head.lora.A.grad, "grad_B": policy.lm_head.lora.B.grad}
        out[name] = res
    return out


def worker(rank: int, world: int, port: int, out: str, watchdog_s: float = 240.0) -> None:
    """A rank stuck in a collective past `watchdog_s` prints every thread's stack and exits (the test fails)."""
    with spawned_rank(rank, world, port, watchdog_s), layout(tp=world):
        results = run_cases()
    torch.save(results, f"{out}/rank{rank}.pt")
