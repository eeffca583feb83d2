"""Rollout routing replay (algo.routing_replay=rollout, rollout.record_routing): the engine's recorded experts
ride in each sample to the trainer, whose routers then send every token to them, weighted by the trainer's own
scores; the agreement metric measures how often the trainer's routers would have chosen alike."""

import pytest
import torch

from megatron_patches.parallel import ensure_parallel
from miles_k3.data.sample import Sample
from miles_k3.model.moe import RoutedExperts
from miles_k3.trainer.base import build_tokenizer, load_base
from miles_k3.trainer.batch import TrainBatch
from miles_k3.trainer.resolve import resolve
from miles_k3.trainer.workers import build_rollout_worker, build_train_worker
from rollout.request import SamplingParams
from tests.trainer.recipes import composed, fresh

RECORD = ("rollout.record_routing=true", "algo.routing_replay=off")  # k3_grpo's own default replays
REPLAY = ("rollout.record_routing=true", "algo.routing_replay=rollout")


@pytest.fixture(scope="module")
def rollout():
    """One step's rollouts with their recorded routing (8 samples of 4 prompts)."""
    ensure_parallel()
    rc = resolve(composed(*RECORD))
    config, state = load_base(rc.model, 0)
    tok = build_tokenizer(rc.model, config)
    engine = build_rollout_worker(rc, config, state, "cpu")
    engine.sync_adapter(build_train_worker(rc, config, state, "cpu").adapter_state())
    prompts = [tok.encode_prompt(p) for p in ["12+7=", "40-9=", "3+3=", "77-70="] for _ in range(2)]
    params = [SamplingParams(max_new_tokens=5, seed=i) for i in range(len(prompts))]
    samples = engine.generate(fresh(prompts), params)
    for i, s in enumerate(samples):
        s.group_index, s.advantage = i // 2, (-1.0) ** i
    return config, state, TrainBatch(samples)


def trainer_for(rollout, *overrides, perturb: float = 0.0):
    config, state, _ = rollout
    trainer = build_train_worker(resolve(composed(*overrides)), config, state, "cpu")
    if perturb:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in trainer.policy.named_parameters():
                if name.endswith("block_sparse_moe.gate.weight"):
                    p.add_(torch.randn(p.shape, generator=g) * perturb * p.std())
    return trainer


def experts_used(trainer, batch) -> dict[int, torch.Tensor]:
    """The experts each MoE layer's routed experts were handed in a forward of `batch`, by routing column."""
    seen: dict[int, torch.Tensor] = {}
    handles = []
    modules = dict(trainer.policy.named_modules())
    for name, m in modules.items():
        if isinstance(m, RoutedExperts):  # its router is the MoE block's `gate`
            column = modules[name.rsplit(".experts", 1)[0] + ".gate"].routing_column
            handles.append(m.register_forward_pre_hook(lambda mod, args, c=column: seen.__setitem__(c, args[1])))
    try:
        trainer.logprobs(batch)
    finally:
        for h in handles:
            h.remove()
    return seen


def recorded(batch) -> torch.Tensor:
    """The batch's recorded routing as the packed row lays it out."""
    from miles_k3.trainer.batch import pack

    return pack(batch, "cpu").routing.long()


def test_samples_carry_the_engines_routing_for_every_fed_token(rollout):
    _, _, batch = rollout
    for s in batch.samples:
        assert s.routed_experts.shape[0] == len(s.prompt_ids) + len(s.output_ids)
        assert (s.routed_experts[:-1] >= 0).all() and (s.routed_experts[-1] == -1).all()


def test_with_a_perturbed_router_replay_still_routes_every_token_to_the_engines_experts(rollout):
    _, _, batch = rollout
    table = recorded(batch)
    fed = table[:, 0, 0] >= 0
    own = experts_used(trainer_for(rollout, *RECORD, perturb=0.5), batch)
    replayed = experts_used(trainer_for(rollout, *REPLAY, perturb=0.5), batch)
    differs = False
    for column, indices in replayed.items():
        want = table[:, column][fed].sort(-1).values
        assert torch.equal(indices[fed].sort(-1).values, want)
        differs |= not torch.equal(own[column][fed].sort(-1).values, want)
    assert differs  # the perturbed router alone would have chosen otherwise


def test_agreement_is_one_for_the_same_router_and_drops_when_it_is_perturbed(rollout):
    _, _, batch = rollout
    same = trainer_for(rollout, *RECORD).train(batch)
    assert same["routing_agreement"] == 1.0 and same["routing_agreement_min_layer"] == 1.0
    moved = trainer_for(rollout, *RECORD, perturb=0.5).train(batch)
    assert moved["routing_agreement"] < 0.95 and moved["routing_agreement_min_layer"] <= moved["routing_agreement"]


def test_replay_with_the_engines_own_router_changes_nothing(rollout):
    """Where the two routers agree, replay picks the same experts with the same weights: the same update."""
    _, _, batch = rollout
    plain, replay = trainer_for(rollout, *RECORD), trainer_for(rollout, *REPLAY)
    assert plain.logprobs(batch) == replay.logprobs(batch)
    a, b = plain.train(batch), replay.train(batch)
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]


def test_a_sample_without_routing_routes_for_itself(rollout):
    _, _, batch = rollout
    bare = TrainBatch([Sample(**{**vars(s), "routed_experts": None}) for s in batch.samples[:2]] + batch.samples[2:])
    table = recorded(bare)
    assert (table[: len(bare.samples[0].prompt_ids) + len(bare.samples[0].output_ids)] == -1).all()
    trainer_for(rollout, *REPLAY).train(bare)  # no error: the unrecorded rows take the trainer's own choice


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ("algo.routing_replay=rollout", "rollout.record_routing=false"),
            "algo.routing_replay 'rollout' replays the experts the engine records",
        ),
        (("algo.routing_replay=always",), r"algo.routing_replay must be one of \('off', 'rollout'\)"),
    ],
)
def test_bad_routing_settings_fail_by_field_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve(composed(*overrides))


def test_replay_under_every_trainer_layout_is_the_single_ranks(tmp_path):
    """A random routing (no router's choice) replayed by TP + SP, PP, CP and EP worlds of the real trainer gives
    the one-rank update: each layout hands every MoE layer its tokens' rows (CP: the zigzag shard of the table,
    PP: a stage's own columns, SP: the gathered row, EP: dispatch by the replayed ids)."""
    from tests.megatron_patches.common import spawn_world
    from tests.trainer import dp_worker

    common = (*REPLAY, "trainer.deterministic=true")
    (one,) = spawn_world(dp_worker.worker, 1, _dir(tmp_path / "one"), common, True)
    assert one["routing_agreement"] < 0.5  # the random routing is not what the router would choose
    for layout in ("tp2 parallel.sp=true", "pp2", "cp2", "ep2"):
        group, *extra = layout.split()
        ranks = spawn_world(dp_worker.worker, 2, _dir(tmp_path / group), (*common, f"parallel={group}", *extra), True)
        for got in ranks:
            for name in ("loss", "grad_norm", "pg_loss", "routing_agreement"):
                assert abs(got[name] - one[name]) <= 1e-5 * max(1.0, abs(one[name])), (layout, name, got, one)


def _dir(path):
    path.mkdir()
    return path
