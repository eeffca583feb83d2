"""Pipeline parallelism: PP=2, PP=3 and TP=2 x PP=2 (spawned gloo worlds) through megatron's 1F1B compute what the whole
model computes in one process (loss, log-probs, every LoRA gradient, the gradient norm, the gathered
adapter); PP=1 through the same schedule equals a plain forward / backward; the AttnRes state packed for a
stage edge round-trips, a wrong width is an error, and a broken packing breaks the equality."""

import pytest
import torch

from megatron_patches.lora import adapter_grads
from megatron_patches.pipeline import stage_layers
from megatron_patches.schedule import forward_backward, forward_only
from miles_k3.model import K3Config, K3ForCausalLM, modeling
from miles_k3.model.modeling import bank_rows, pack_residual, unpack_residual
from tests.megatron_patches import pp_worker
from tests.megatron_patches.common import spawn_world


def _spawn(tmp_path_factory, world: int, tp: int = 1) -> list[dict]:
    return spawn_world(pp_worker.worker, world, tmp_path_factory.mktemp(f"tp{tp}_world{world}"), tp)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return _spawn(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def pp3(tmp_path_factory):
    return _spawn(tmp_path_factory, 3)


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory):
    return _spawn(tmp_path_factory, 4, tp=2)


@pytest.fixture(scope="module")
def reference():
    return {name: pp_worker.reference(c) for name, c in pp_worker.configs().items()}


def _close(a, b, tol=1e-10):
    return float((a - b).norm()) <= tol * max(float(b.norm()), 1e-12)


def _check_world(ranks: list[dict], reference: dict, pp: int) -> None:
    for case, (config, split) in pp_worker.cases(pp).items():
        want = reference[case.split("/", 1)[1]]
        got = [r[case] for r in ranks]
        assert [g["layers"] for g in got] == [list(r) for r in stage_layers(config.num_hidden_layers, pp, split)]
        # the stages' state dicts partition the whole model's (global layer names), sharing only a tied embedding
        names = [set(g["names"]) - {n for n in g["names"] if ".lora." in n} for g in got]
        assert set().union(*names) == {n for n in want["names"] if ".lora." not in n}
        shared = set.intersection(names[0], names[-1])
        assert shared == ({"model.embed_tokens.weight"} if config.tie_word_embeddings else set()), case
        # local gradients: disjoint over the stages, together every adapter's
        local = [g["local_grads"] for g in got]
        assert sum(len(x) for x in local) == len(want["grads"]) == len({k for x in local for k in x})
        for rank, g in enumerate(got):
            # results of the last stage, on every rank (micro-batches of other lengths: variable shapes)
            for a, b in zip(g["losses"], want["losses"]):
                assert _close(a, b), (case, rank)
            for name in ("train_logp", "logp"):
                assert all(_close(a, b) for a, b in zip(g[name], want["logp"])), (case, rank, name)
            assert _close(g["norm"], want["norm"]), (case, rank)
            for key, grad in local[rank].items():
                assert _close(grad, want["grads"][key]), (case, rank, key)
            # adapter_state / adapter_grads gather over the stages: every rank has the whole model's
            assert list(g["adapter"]) == list(want["adapter"])
            assert all(torch.equal(g["adapter"][k], want["adapter"][k]) for k in want["adapter"])
            assert all(_close(g["grads"][k], want["grads"][k]) for k in want["grads"])


def test_pp2_equals_one_process(pp2, reference):
    """Even split 3 + 3: the AttnRes blocks starting at layers 2 and 4 start inside a stage."""
    _check_world(pp2, reference, 2)


def test_pp3_equals_one_process(pp3, reference):
    """Split [1, 3, 2]: a block starts inside the middle stage (layer 2) and exactly on the last stage's
    edge (layer 4: it receives two finished blocks); Kimi-Linear form (no AttnRes, tied) split evenly."""
    assert bank_rows(pp_worker.configs()["k3-tiny"], 4) == 2
    _check_world(pp3, reference, 3)


def test_pp1_schedule_equals_plain_forward_backward(reference):
    """PP=1 runs megatron's no-pipelining schedule: same losses, log-probs and gradients as the plain loop
    (so the schedule divides the returned losses by nothing)."""
    for name, config in pp_worker.configs().items():
        policy = pp_worker._policy(config, None)
        mbs = pp_worker.micro_batches(config)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the reference
        try:
            results = forward_backward(policy, mbs, pp_worker.loss_fn)
            logp = forward_only(policy, mbs, pp_worker.logp_fn)
        finally:
            torch.set_num_threads(threads)
        want = reference[name]
        assert all(_close(r["loss"], w) for r, w in zip(results, want["losses"]))
        assert all(_close(r["logp"], w) and not r["logp"].requires_grad for r, w in zip(logp, want["logp"]))
        got = adapter_grads(policy)
        assert all(_close(got[k], want["grads"][k]) for k in want["grads"])


# ------------------------------------------------------------------------------------ packing, in-process
CONFIG = K3Config.from_preset("k3-tiny")


def test_packing_round_trip_is_identity():
    torch.manual_seed(0)
    for layer in range(CONFIG.num_hidden_layers + 1):
        n = bank_rows(CONFIG, layer)
        h, blocks = torch.randn(1, 5, CONFIG.hidden_size), [torch.randn(1, 5, CONFIG.hidden_size) for _ in range(n)]
        packed = pack_residual(h, blocks)
        assert packed.shape == (1, 5, (1 + n) * CONFIG.hidden_size)
        h2, blocks2 = unpack_residual(packed, CONFIG, layer)
        assert torch.equal(h2, h) and len(blocks2) == n and all(map(torch.equal, blocks2, blocks))
    assert [bank_rows(CONFIG, i) for i in range(7)] == [0, 1, 1, 2, 2, 3, 3]
    kimi = CONFIG.kimi_linear_form()
    assert bank_rows(kimi, 4) == 0 and pack_residual(h, []) is h  # no AttnRes: the plain residual


def test_packing_of_a_wrong_width_is_an_error_naming_both_widths():
    d = CONFIG.hidden_size
    with pytest.raises(ValueError, match=f"width {2 * d}, expected {3 * d}"):
        unpack_residual(torch.zeros(1, 4, 2 * d), CONFIG, 4)  # layer 4 expects 2 finished blocks


def _stages(config: K3Config, split: list[int]) -> tuple[K3ForCausalLM, list[K3ForCausalLM]]:
    whole = K3ForCausalLM(config).double().eval()
    whole.load_state_dict(pp_worker.base_state(config))  # random AttnRes queries: the bank's order matters
    stages = []
    for layers in stage_layers(config.num_hidden_layers, len(split), split):
        with torch.device("meta"):
            stage = K3ForCausalLM(config, layers=layers)
        state = whole.state_dict()
        stage.load_state_dict({k: state[k] for k in stage.state_dict()}, assign=True)
        stages.append(stage.eval())
    return whole, stages


@torch.no_grad()
def _chained_logits(stages: list[K3ForCausalLM], ids: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    x = None
    for stage in stages:
        x = stage.model(ids, cu_seqlens=cu, inputs=x)
    return stages[-1].logits(x)


def test_stages_chained_in_process_equal_the_whole_model_and_a_broken_packing_does_not(monkeypatch):
    """The same stage code without p2p: stage outputs fed on by hand equal the whole model; a packing that
    zeroes the bank, drops a row (keeping the width) or swaps the prefix sum with a bank row changes the
    logits; one that drops a row outright is the width error."""
    ids = torch.randint(3, CONFIG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    whole, stages = _stages(CONFIG, [1, 3, 2])
    with torch.no_grad():
        want = whole(ids, cu_seqlens=cu).logits
    assert _close(_chained_logits(stages, ids, cu), want, 1e-12)

    real = modeling.pack_residual
    # (the AttnRes mix is a softmax over the set of sources: their order alone changes nothing)
    broken = {
        "zeroed bank": lambda h, blocks: real(h, [torch.zeros_like(b) for b in blocks]),
        # at layer 4's edge (2 blocks): the last row dropped, the first sent twice to keep the width
        "bank row dropped": lambda h, blocks: real(h, blocks[:-1] + blocks[:1]),
        "prefix sum and a bank row swapped": lambda h, blocks: real(blocks[0], [h, *blocks[1:]]),
    }
    for what, pack in broken.items():
        monkeypatch.setattr(modeling, "pack_residual", pack)
        assert not _close(_chained_logits(stages, ids, cu), want, 1e-3), what
    monkeypatch.setattr(modeling, "pack_residual", lambda h, blocks: real(h, blocks[:-1]))
    with pytest.raises(ValueError, match="width"):
        _chained_logits(stages, ids, cu)


def test_a_stage_holds_only_its_layers_under_global_names():
    with torch.device("meta"):
        middle = K3ForCausalLM(CONFIG, layers=range(2, 4))
        last = K3ForCausalLM(CONFIG.replace(tie_word_embeddings=True), layers=range(4, 6))
    names = set(middle.state_dict())
    assert {n.split(".")[2] for n in names} == {"2", "3"} and all(n.startswith("model.layers.") for n in names)
    assert [layer.layer_idx for layer in middle.model.layers] == [2, 3] and middle.model.layers[0].layer_idx == 2
    assert "model.embed_tokens.weight" in last.state_dict() and "model.norm.weight" in last.state_dict()
    with pytest.raises(ValueError, match="no whole-model forward"):
        middle(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="inputs"):
        middle.model(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="layers must be"):
        K3ForCausalLM(CONFIG, layers=range(4, 9))


@pytest.mark.parametrize(
    "split, match",
    [
        ([3, 3, 1], "sum to 7, but the model has 6"),
        ([5, 1, 0], "every stage needs >= 1 layer"),
        ([3, 3], "2 stage counts"),
        ([2.5, 3.5, 0], "list of integers"),
    ],
)
def test_bad_layer_split_is_an_error_naming_the_field(split, match):
    with pytest.raises(ValueError, match=match) as e:
        stage_layers(6, 3, split)
    assert str(e.value).startswith("pp_layers")


def test_layer_splits():
    assert [len(r) for r in stage_layers(93, 8)] == [12] * 5 + [11] * 3
    assert stage_layers(6, 3, [1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]
    with pytest.raises(ValueError, match="pp_layers: 2 layers cannot fill 3"):
        stage_layers(2, 3)


def test_tp2_times_pp2_equals_one_process(tp2_pp2, reference):
    """Four ranks: two stages of two tensor-parallel ranks (vocab-parallel head and embedding included). Every
    rank ends with the whole model's losses, log-probs, gradient norm, gradients and adapter."""
    for case in pp_worker.cases(2, tp=2):
        want = reference[case.split("/", 1)[1]]
        for rank, ranks in enumerate(tp2_pp2):
            got = ranks[case]
            assert all(_close(a, b) for a, b in zip(got["losses"], want["losses"])), (case, rank)
            for name in ("train_logp", "logp"):
                assert all(_close(a, b) for a, b in zip(got[name], want["logp"])), (case, rank, name)
            assert _close(got["norm"], want["norm"]), (case, rank)
            assert list(got["adapter"]) == list(want["adapter"])
            assert all(torch.equal(got["adapter"][k], want["adapter"][k]) for k in want["adapter"])
            assert all(_close(got["grads"][k], want["grads"][k]) for k in want["grads"]), (case, rank)
