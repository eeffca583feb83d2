"""Activation recompute (`build_policy(recompute=True)`, `parallel.recompute`): every LoRA gradient equals the
run without it (fp64, 1e-12) in one process and under TP=2 + SP, PP=2 (the packed AttnRes state through
megatron's 1F1B), CP=2 (the zigzag layout replayed in backward; MLA blockwise) and EP=2 on gloo, with LoRA
dropout on (the recomputed forward must draw the same masks); the bytes autograd saves drop (so recompute
cannot silently do nothing); names and the dropout generator's stream are unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import miles_k3.ops.mla as mla
from megatron_patches.lora import adapter_grads, adapter_state, load_adapter_state, lora_parameters
from megatron_patches.model import build_policy, reference_state
from megatron_patches.vocab_parallel import token_logprobs
from miles_k3.model import K3Config
from miles_k3.model.lora_spec import LoraSpec
from tests.megatron_patches.common import layout, spawn_world, spawned_rank

SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.25)
DTYPE = torch.float64
BOUNDS = [0, 7, 20, 32]  # one packed row: 3 sequences, 32 tokens
TINY = K3Config.from_preset("k3-tiny")
CONFIGS = {"k3-tiny": TINY, "kimi-linear-form": TINY.kimi_linear_form().replace(tie_word_embeddings=True)}


def _small_attention_blocks() -> None:
    # rows of 32 tokens run MLA's blockwise path (blocks of 8) instead of the dense one
    mla.BLOCK, mla.DENSE_MAX_KEYS = 8, 8


def _policy(config: K3Config, recompute: bool, seed: int = 0, **kw):
    policy = build_policy(
        config, reference_state(config, seed), SPEC, seed=seed, dtype=DTYPE, recompute=recompute, **kw
    )
    g = torch.Generator().manual_seed(seed + 2)
    load_adapter_state(
        policy, {k: torch.randn(v.shape, generator=g, dtype=DTYPE) * 0.3 for k, v in adapter_state(policy).items()}
    )
    return policy


def _row(config: K3Config, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = BOUNDS[-1]
    ids = torch.randint(3, config.vocab_size, (1, n), generator=g)
    targets = torch.randint(3, config.vocab_size, (n,), generator=g)
    weights = torch.randn(n, generator=g, dtype=DTYPE)
    return ids, torch.tensor(BOUNDS), targets, weights


def _saved_bytes_hooks(seen: dict, weights: set):
    """As scripts/bench_sequence_parallel.py counts them: each saved storage once, the model's tensors left out."""

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in weights:
            seen[key] = t.untyped_storage().nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _step(policy, config: K3Config) -> dict:
    """One packed row forward (counting saved bytes), a weighted log-prob loss, backward."""
    ids, cu, targets, weights = _row(config)
    seen: dict = {}
    tensors = {t.untyped_storage().data_ptr() for t in [*policy.parameters(), *policy.buffers()]}
    with _saved_bytes_hooks(seen, tensors):
        hidden = policy.model(ids, cu_seqlens=cu)
        logp, _ = token_logprobs(policy, hidden[0], targets, 0.7)
    loss = -(logp * weights).sum()
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": adapter_grads(policy),
        "saved": sum(seen.values()),
        "rng_after": policy.lora_generator.get_state(),
    }


def _assert_same_grads(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for key, g in want.items():
        assert g is not None and got[key] is not None, (what, key)
        assert g.norm() > 0, (what, key)
        torch.testing.assert_close(got[key], g, rtol=0, atol=1e-12, msg=f"{what}: {key}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_recompute_gives_the_same_gradients_and_saves_less(name, monkeypatch):
    monkeypatch.setattr(mla, "BLOCK", 8)
    monkeypatch.setattr(mla, "DENSE_MAX_KEYS", 8)
    config = CONFIGS[name]
    want = _step(_policy(config, recompute=False), config)
    got = _step(_policy(config, recompute=True), config)
    torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=1e-12)
    _assert_same_grads(got["grads"], want["grads"], name)
    # the recompute replayed the dropout draws and put the generator back: the next step draws as without it
    assert torch.equal(got["rng_after"], want["rng_after"])
    # a recompute that did nothing would save as much as the plain run
    assert got["saved"] < 0.25 * want["saved"], (got["saved"], want["saved"])


def test_recompute_without_the_dropout_replay_changes_the_gradients(monkeypatch):
    """The mutation the replay guards against: a recomputed forward that draws fresh dropout masks."""
    import megatron_patches.model as model

    monkeypatch.setattr(
        model, "_replay_contexts", lambda generator, cp, routing=None: (torch.enable_grad(), torch.enable_grad())
    )
    want = _step(_policy(TINY, recompute=False), TINY)
    try:
        got = _step(_policy(TINY, recompute=True), TINY)
    except torch.utils.checkpoint.CheckpointError:
        return  # fresh masks route other tokens to the experts: torch's shape check catches it
    diffs = [float((got["grads"][k] - g).abs().max()) for k, g in want["grads"].items()]
    assert max(diffs) > 1e-6


def test_recompute_keeps_names_and_the_layers_contract():
    plain, wrapped = _policy(TINY, recompute=False), _policy(TINY, recompute=True)
    assert sorted(wrapped.state_dict()) == sorted(plain.state_dict())
    assert sorted(adapter_state(wrapped)) == sorted(adapter_state(plain))  # the engine's names
    assert [n.replace("_checkpoint_wrapped_module.", "") for n, _ in wrapped.named_parameters()] == [
        n for n, _ in plain.named_parameters()
    ]
    assert len(lora_parameters(wrapped)) == len(lora_parameters(plain))
    assert wrapped.model.layers[0].layer_idx == 0  # the wrapper forwards attributes to its layer
    meta = build_policy(TINY, None, SPEC, device="meta", recompute=True)
    assert type(meta.model.layers[0]).__name__ == "CheckpointWrapper"


# --------------------------------------------------------------------------- multi-process layouts
def _run_layout(name: str, recompute: bool) -> dict:
    """This rank's result of layout `name` (k3-tiny) with / without recompute."""
    from megatron.core import parallel_state as ps

    config = TINY
    if name == "tp2_sp":
        return _step(_policy(config, recompute, sequence_parallel=True), config)
    if name == "ep2":  # each data-parallel rank its own row (seeded by rank); experts split over EP
        policy = _policy(config, recompute)
        ids, cu, targets, weights = _row(config, seed=dist.get_rank())
        logp, _ = token_logprobs(policy, policy.model(ids, cu_seqlens=cu)[0], targets, 0.7)
        (-(logp * weights).sum()).backward()
        return {"grads": adapter_grads(policy)}
    if name == "cp2":
        policy = _policy(config, recompute)
        ids, cu, targets, weights = _row(config)
        cp = policy.model.cp
        lay = cp.split(ids.shape[1], cu)
        with cp.sharded(lay):
            hidden = policy.model(lay.shard(ids))
        logp, _ = token_logprobs(policy, hidden[0], lay.shard(targets, dim=0), 0.7)
        (-(logp * lay.shard(weights, dim=0) * lay.real).sum()).backward()
        for p in lora_parameters(policy):
            if p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_context_parallel_group())
        return {"grads": adapter_grads(policy)}
    assert name == "pp2"
    from megatron_patches.schedule import MicroBatch, forward_backward

    policy = _policy(config, recompute)
    mbs = []
    for seed in range(3):  # more micro-batches than stages
        ids, cu, targets, weights = _row(config, seed)
        mbs.append(MicroBatch(ids, cu.to(torch.int32), payload=(targets, weights)))

    def loss_fn(policy, hidden, mb):
        logp, _ = token_logprobs(policy, hidden[0], mb.payload[0], 0.7)
        return -(logp * mb.payload[1]).sum(), {"logp": logp.detach()}

    losses = [r["loss"] for r in forward_backward(policy, mbs, loss_fn)]
    return {"grads": adapter_grads(policy), "losses": losses}


LAYOUTS = {"tp2_sp": dict(tp=2), "pp2": dict(pp=2), "cp2": dict(cp=2), "ep2": dict(ep=2)}


def worker(rank: int, world: int, port: int, out: str) -> None:
    _small_attention_blocks()
    results = {}
    with spawned_rank(rank, world, port, watchdog_s=400.0):
        for name, sizes in LAYOUTS.items():
            with layout(**sizes):
                results[name] = {r: _run_layout(name, r) for r in (False, True)}
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn_world(worker, 2, tmp_path_factory.mktemp("recompute"))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_recompute_gives_the_same_gradients_under_parallel_layouts(two_ranks, name):
    for rank, results in enumerate(two_ranks):
        want, got = results[name][False], results[name][True]
        _assert_same_grads(got["grads"], want["grads"], f"{name} rank {rank}")
        if "losses" in want:
            torch.testing.assert_close(got["losses"], want["losses"], rtol=0, atol=1e-12)
