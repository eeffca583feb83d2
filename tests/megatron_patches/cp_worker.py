"""One rank of the CP=2 world for the context-parallel tests (spawned; gloo). `run_case` also runs in the
pytest process without CP: the single-process reference.

A case builds the policy (fp64, a seeded random adapter, no LoRA dropout: its masks are drawn over the
local shape, which CP changes), runs one packed row, takes the log-probs of random targets on the real
tokens, and backpropagates their sum. Under CP each rank runs its zigzag share, the loss is the sum over
ranks, and the LoRA gradients (replicated over CP) are all-reduced over the CP group here, explicitly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from megatron_patches.context_parallel import MegatronCP
from megatron_patches.lora import adapter_grads, adapter_state, load_adapter_state, lora_parameters
from megatron_patches.model import build_policy, reference_state
from miles_k3.model import K3Config
from miles_k3.model.context import ContextParallel
from miles_k3.model.lora_spec import LoraSpec
from tests.megatron_patches.common import layout, spawned_rank

SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.0)
DTYPE = torch.float64

# Packed rows (N, cu_seqlens). CP=2 cuts the padded row into 4 chunks of 8 (rank 0: chunks 0 and 3, rank 1:
# chunks 1 and 2) and KDA into segments [0, 16) and [16, 32).
ROWS = {
    # 30 tokens padded to 32: [0, 11) crosses chunks 0-1; [11, 13) fits inside chunk 1; [13, 27) crosses
    # chunks 1-2-3 and the KDA segment boundary; [27, 30) inside chunk 3, then the padding
    "padded": (30, [0, 11, 13, 27, 30]),
    # 32 tokens, no padding: [0, 5) inside chunk 0; [5, 21) crosses chunks 0-1-2 and the segments; [21, 32)
    "exact": (32, [0, 5, 21, 32]),
}


def configs() -> dict[str, K3Config]:
    tiny = K3Config.from_preset("k3-tiny")
    return {"k3-tiny": tiny, "kimi-linear-form": tiny.kimi_linear_form().replace(tie_word_embeddings=True)}


def cases() -> dict[str, tuple[K3Config, str]]:
    return {f"{c}/{row}": (config, row) for c, config in configs().items() for row in ROWS}


class NoRelayoutCP(MegatronCP):
    """The mutation the tests must catch: KDA run on the zigzag tokens as if they were a contiguous
    segment (hybrid CP without the relayout)."""

    def to_segment(self, x):
        return x

    def to_zigzag(self, x):
        return x


def _row(config: K3Config, row: str, seed: int):
    n, bounds = ROWS[row]
    ids = torch.randint(3, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    targets = torch.randint(3, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed + 1))
    return ids, targets, torch.tensor(bounds)


def _token_logprobs(policy, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(policy.logits(hidden), dim=-1).gather(-1, targets[..., None])[..., 0]


def run_case(config: K3Config, row: str, seed: int = 0, cp_class: type[ContextParallel] | None = None) -> dict:
    """Single process when CP is 1; else this rank's share, with results summed / gathered over CP.
    cp_class: swap the policy's CP share for another `MegatronCP` subclass (the mutation)."""
    ids, targets, cu = _row(config, row, seed)
    policy = build_policy(config, reference_state(config, seed), SPEC, seed=seed, dtype=DTYPE)
    g = torch.Generator().manual_seed(seed + 2)
    load_adapter_state(
        policy, {k: torch.randn(v.shape, generator=g, dtype=DTYPE) * 0.3 for k, v in adapter_state(policy).items()}
    )
    if ps.get_context_parallel_world_size() == 1:
        logp = _token_logprobs(policy, policy.model(ids, cu_seqlens=cu), targets)[0]
        loss = logp.sum()
        loss.backward()
        return {"logp": logp.detach(), "loss": loss.detach(), "grads": adapter_grads(policy)}
    cp = policy.model.cp
    if cp_class is not None:
        cp = cp_class()
        for m in policy.modules():
            if hasattr(m, "cp"):
                m.cp = cp
    layout = cp.split(ids.shape[1], cu)
    with cp.sharded(layout):
        hidden = policy.model(layout.shard(ids))
    logp = _token_logprobs(policy, hidden, layout.shard(targets))[0]
    local = (logp * layout.real).sum()
    local.backward()
    for p in lora_parameters(policy):  # replicated over CP: the full gradient is the sum of the ranks' parts
        if p.grad is not None:
            dist.all_reduce(p.grad, group=ps.get_context_parallel_group())
    return {
        "logp": cp.gather_tokens(logp, layout, dim=0),
        "loss": cp.sum(local),
        "grads": adapter_grads(policy),
        "local_len": hidden.shape[1],
    }


def relayout_round_trip() -> dict:
    """The relayout on a row whose values are their global positions (and the gradient's way back)."""
    cp = MegatronCP()
    layout = cp.split(30, torch.tensor(ROWS["padded"][1]))
    x = layout.positions.to(DTYPE)[None, :, None].expand(1, -1, 3).clone().requires_grad_()
    with cp.sharded(layout):
        seg = cp.to_segment(x)
        back = cp.to_zigzag(seg)
    probe = torch.randn(seg.shape, generator=torch.Generator().manual_seed(5 + cp.rank), dtype=DTYPE)
    (grad,) = torch.autograd.grad((seg * probe).sum(), x)
    return {
        "positions": layout.positions,
        "segment": seg.detach(),
        "back": back.detach(),
        "x": x.detach(),
        "probe": probe,
        "grad": grad,
    }


def worker(rank: int, world: int, port: int, out: str, watchdog_s: float = 400.0) -> None:
    """One rank of a CP=`world` world (gloo). A rank stuck in a collective past `watchdog_s` prints every
    thread's stack and exits, so a hang fails the test instead of stalling CI."""
    with spawned_rank(rank, world, port, watchdog_s), layout(cp=world):
        results = {name: run_case(config, row) for name, (config, row) in cases().items()}
        results["no-relayout"] = run_case(configs()["k3-tiny"], "padded", cp_class=NoRelayoutCP)
        results["round-trip"] = relayout_round_trip()
    torch.save(results, f"{out}/rank{rank}.pt")
