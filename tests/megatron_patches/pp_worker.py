"""One rank of a pipeline-parallel run for the PP tests (spawned, gloo), and the single-process reference.

Every case builds the policy (this rank's stage), loads one seeded random adapter, and runs micro-batches of
packed sequences through `megatron_patches.schedule`: a training pass (loss per micro-batch normalized by the
whole batch's token count, LoRA gradients, their norm by `clip_lora_grad_norm_`) and a forward-only pass
(log-probs). `reference` computes the same
with the whole model in one process and a plain forward / backward per micro-batch.
"""

from __future__ import annotations

import zlib

import torch

from megatron_patches.lora import adapter_grads, adapter_state, clip_lora_grad_norm_, load_adapter_state, lora_modules
from megatron_patches.model import build_policy, reference_state
from megatron_patches.schedule import MicroBatch, forward_backward, forward_only
from megatron_patches.vocab_parallel import token_logprobs
from miles_k3.model import K3Config
from miles_k3.model.lora_spec import LoraSpec
from tests.megatron_patches.common import layout, spawned_rank

DTYPE = torch.float64  # exactness: PP vs one process differs in summation order only
# No LoRA dropout: a stage draws its masks from its own generator in (micro-batch, its layers) order, the
# whole model in (micro-batch, all layers) order, so the masks differ by design.
SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.0)
# Packed sequence lengths per micro-batch: 4 micro-batches (more than the 3 stages), all of other lengths.
MICRO_BATCHES = [(5, 7), (9,), (4, 3, 6), (11, 2)]


def configs() -> dict[str, K3Config]:
    tiny = K3Config.from_preset("k3-tiny")  # 6 layers, AttnRes blocks of 2: blocks start at layers 0, 2, 4
    return {"k3-tiny": tiny, "kimi-linear-form": tiny.kimi_linear_form().replace(tie_word_embeddings=True)}


def cases(pp: int, tp: int = 1) -> dict[str, tuple[K3Config, list[int] | None]]:
    """name -> (config, pp_layers). PP=2, even (3 + 3): the block boundaries at layers 2 and 4 fall inside
    the stages. PP=3, [1, 3, 2]: layer 2 starts a block inside the middle stage, layer 4 starts one exactly
    on a stage edge (the last stage receives a bank of 2 blocks). With TP > 1 each stage is also split over
    `tp` ranks (names "tp2_pp2/...")."""
    split = None if pp == 2 else [1, 3, 2]
    prefix = f"pp{pp}" if tp == 1 else f"tp{tp}_pp{pp}"
    return {f"{prefix}/{name}": (c, split if name == "k3-tiny" else None) for name, c in configs().items()}


def micro_batches(config: K3Config, seed: int = 0) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for lengths in MICRO_BATCHES:
        n = sum(lengths)
        ids = torch.randint(3, config.vocab_size, (1, n), generator=g)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        targets = torch.randint(3, config.vocab_size, (n,), generator=g)
        weights = torch.randn(n, generator=g, dtype=torch.float64)
        out.append(MicroBatch(ids, cu, payload=(targets, weights)))
    return out


def total_tokens() -> int:
    return sum(sum(lengths) for lengths in MICRO_BATCHES)


def loss_fn(policy, hidden: torch.Tensor, mb: MicroBatch):
    targets, weights = mb.payload
    logp, _ = token_logprobs(policy, hidden[0], targets, temperature=0.7)
    return -(logp.double() * weights).sum() / total_tokens(), {"logp": logp.detach()}


def logp_fn(policy, hidden: torch.Tensor, mb: MicroBatch):
    return {"logp": token_logprobs(policy, hidden[0], mb.payload[0], temperature=0.7)[0]}


def random_adapter(shapes: dict[str, torch.Size], seed: int = 3) -> dict[str, torch.Tensor]:
    """A random adapter drawn per tensor name, so every stage draws its share of the same full adapter."""
    return {
        k: torch.randn(s, generator=torch.Generator().manual_seed(seed * 7919 + zlib.crc32(k.encode())), dtype=DTYPE)
        * 0.3
        for k, s in shapes.items()
    }


def local_adapter_names(policy) -> dict[str, torch.Size]:
    """This stage's adapter tensors (engine naming) and their full shapes."""
    return {name: torch.Size(full) for m in lora_modules(policy) for name, (_, _, full) in m.exports().items()}


def base_state(config: K3Config) -> dict[str, torch.Tensor]:
    """The reference init with random AttnRes queries: the init's are zero, which mixes the bank uniformly,
    so a bank sent in the wrong order would still give the right answer."""
    state = reference_state(config)
    g = torch.Generator().manual_seed(11)
    for name in sorted(state):
        if "_res_proj" in name:
            state[name] = torch.randn(state[name].shape, generator=g) * 0.5
    return state


def _policy(config: K3Config, pp_layers: list[int] | None):
    policy = build_policy(config, base_state(config), SPEC, dtype=DTYPE, pp_layers=pp_layers)
    load_adapter_state(policy, random_adapter(local_adapter_names(policy)))
    return policy


def run_case(config: K3Config, pp_layers: list[int] | None) -> dict:
    """On this rank's stage: schedule results (on every rank), local adapter grads, the PP-global gradient
    norm, the gathered adapter."""
    policy = _policy(config, pp_layers)
    mbs = micro_batches(config)
    trained = forward_backward(policy, mbs, loss_fn)
    local = {name: m.A if name.endswith("lora_A") else m.B for m in lora_modules(policy) for name in m.exports()}
    local_grads = {k: p.grad.clone() for k, p in local.items()}
    grads = adapter_grads(policy)
    norm = clip_lora_grad_norm_(policy, max_norm=1e9)  # global over the stages (no clipping at this bound)
    logp = forward_only(policy, mbs, logp_fn)
    return {
        "losses": [r["loss"] for r in trained],
        "train_logp": [r["logp"] for r in trained],
        "logp": [r["logp"] for r in logp],
        "local_grads": local_grads,
        "grads": grads,
        "norm": norm,
        "layers": list(policy.model.layer_range),
        "names": sorted(policy.state_dict()),
        "adapter": adapter_state(policy),
    }


def reference(config: K3Config) -> dict:
    """The whole model in one process (a megatron world of one), plain forward / backward per micro-batch.
    On one thread like the spawned ranks: the model's fp32 parts (router, gates, the log-softmax) sum in an
    order that follows the thread count (1e-7 relative between 1 and 2 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(config)
    finally:
        torch.set_num_threads(threads)


def _reference(config: K3Config) -> dict:
    policy = _policy(config, None)
    losses, logps = [], []
    for mb in micro_batches(config):
        loss, out = loss_fn(policy, policy.model(mb.input_ids, cu_seqlens=mb.cu_seqlens), mb)
        loss.backward()
        losses.append(loss.detach())
        logps.append(out["logp"])
    grads = adapter_grads(policy)
    return {
        "losses": losses,
        "logp": logps,
        "grads": grads,
        "norm": torch.sqrt(sum(g.pow(2).sum() for g in grads.values())),
        "names": sorted(policy.state_dict()),
        "adapter": adapter_state(policy),
    }


def worker(rank: int, world: int, port: int, out: str, tp: int = 1, watchdog_s: float = 300.0) -> None:
    """PP = world / tp stages of `tp` tensor-parallel ranks each. A rank stuck past `watchdog_s` prints every
    thread's stack and exits."""
    pp = world // tp
    with spawned_rank(rank, world, port, watchdog_s), layout(tp=tp, pp=pp):
        results = {name: run_case(c, split) for name, (c, split) in cases(pp, tp).items()}
    torch.save(results, f"{out}/rank{rank}.pt")
