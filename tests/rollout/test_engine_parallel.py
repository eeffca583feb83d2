"""The sharded engine (two processes, gloo, fp32) gives the single-process engine's greedy tokens and
log-probs, for TP=2, EP=2 (built by `build_sharded_engine` from a checkpoint directory) and TP=2 + DCP=2,
with prefix-cache hits, retraction and the overlap schedule on; rank 0 alone submits and aborts (a seeded
fuzz) and the other rank follows; an adapter update reaches every rank's slices in place; each rank reads
only its slices of the checkpoint; turning off the row-parallel all-reduce or the DCP merge breaks the
parity."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_patches.parallel import end_world, free_port
from miles_k3.model import K3Config
from miles_k3.model.lora_spec import LoraSpec
from miles_k3.model.modeling import reference_state
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.model_runner import build_engine_model
from rollout.request import SamplingParams

CONFIG = K3Config.from_preset("k3-tiny")
SPEC = LoraSpec(rank=4, alpha=8.0)
# small pages and chunks so prompts cross page and chunk boundaries; memory tight enough to retract
SETTINGS = dict(page_size=4, chunk_size=8, max_prefill_tokens=16, max_seq_len=128, overlap="on", max_running=6)
CASES = {"tp2": dict(ep=False, dcp=1), "ep2": dict(ep=True, dcp=1), "tp2-dcp2": dict(ep=False, dcp=2)}
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


def memory(dcp: int) -> dict:
    """About 24 KV pages and 8 KDA slots per rank at TP=1 (a TP rank's slots are half as big: 16): fewer
    pages than the workload's running requests want, so the scheduler retracts."""
    from rollout.memory import PoolSizes

    pages = 24 * PoolSizes.bytes_per_page(CONFIG, SETTINGS["page_size"], torch.float32, dcp)
    slots = 8 * PoolSizes.bytes_per_slot(CONFIG, torch.float32)
    total = int((pages + slots) * 1.02)
    return dict(memory_bytes=total, state_fraction=slots * 1.01 / total)


def adapter(seed: int) -> dict[str, torch.Tensor]:
    """Full (logical) adapter tensors for every module the spec adapts, as the trainer exports them."""
    _, pool = build_engine_model(
        CONFIG, reference_state(CONFIG), quantize="none", lora=SPEC, max_adapters=1, dtype=torch.float32
    )
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in pool.A:
        out[f"{name}.lora_A"] = torch.randn(pool.A[name].shape[1:], generator=g) * 0.3
        out[f"{name}.lora_B"] = torch.randn(pool.B[name].shape[1:], generator=g) * 0.3
    return out


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 512, (19,), generator=g).tolist()
    tails = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (2, 5, 9)]
    alone = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 13, 24)]
    return [shared + t for t in tails] + alone


def workload(engine: Engine, first: dict, second: dict) -> dict:
    """What rank 0 does (the other ranks follow): a batch with and without the adapter (shared prefixes),
    a fuzz of submits / aborts / steps, an in-place adapter update and the batch again."""
    ps = prompts()
    engine.add_adapter("policy", first)
    adapters = [None, "policy"] * 3
    out = {"batch": engine.generate(ps, GREEDY, adapter=adapters)}
    rng = random.Random(0)
    submitted, done, aborted = {}, {}, set()
    for i in range(40):
        roll = rng.random()
        if roll < 0.3 and len(submitted) < 10:
            p, seeded = ps[rng.randrange(len(ps))], rng.random() < 0.5
            params = SamplingParams(temperature=1.0, seed=i, max_new_tokens=6) if seeded else GREEDY
            rid = engine.submit(p, params, adapter=rng.choice([None, "policy"]))
            submitted[rid] = (p, params)
        elif roll < 0.4 and submitted:
            rid = rng.choice(sorted(submitted))
            if engine.abort(rid) is not None:
                aborted.add(rid)
        elif engine.has_work():
            done.update((c.request_id, c) for c in engine.step())
        engine.check_invariants()
    while engine.has_work():
        done.update((c.request_id, c) for c in engine.step())
    out["fuzz"] = [(submitted[r], done[r]) for r in sorted(submitted) if r not in aborted]
    pool = engine.adapters
    ptrs = {k: t.data_ptr() for k, t in pool.A.items()}
    engine.update_adapter("policy", second)
    out["in_place"] = all(pool.A[k].data_ptr() == p for k, p in ptrs.items())
    out["after_update"] = engine.generate(ps, GREEDY, adapter="policy")
    return out


def build(tp=None, dcp: int = 1) -> Engine:
    """The engine of one rank (`tp`: its EngineTP) or of one process (None)."""
    model, pool = build_engine_model(
        CONFIG,
        reference_state(CONFIG),
        quantize="none",
        lora=SPEC,
        max_adapters=2,
        dtype=torch.float32,
        **({} if tp is None else {"tp": tp}),
    )
    return Engine(model, EngineConfig(**memory(dcp), dcp_size=dcp, **SETTINGS), pool)


def _completions(cs) -> list[tuple[list[int], list[float]]]:
    return [(c.output_ids, c.logprobs) for c in cs]


def _summary(out: dict, engine: Engine) -> dict:
    return {
        "batch": _completions(out["batch"]),
        "after_update": _completions(out["after_update"]),
        "fuzz": [(p, params, c.output_ids, c.logprobs) for (p, params), c in out["fuzz"]],
        "cached": [c.cached_tokens for c in out["batch"]],
        "in_place": out["in_place"],
        "counters": engine.counters(),
    }


def _rank_state(engine: Engine) -> dict:
    """What every rank must agree on after the run: the accounting and what the pools hold locally."""
    engine.check_invariants()
    pool = engine.adapters
    return {
        "counters": engine.counters(),
        "free_pages": engine.kv.allocator.num_free,
        "free_slots": engine.states.allocator.num_free,
        "rows_per_page": engine.kv.rows_per_page,
        "state_heads": next(iter(engine.states.recurrent.values())).shape[1],
        "slices": {k: pool.A[k][pool.slot_of("policy")].clone() for k in pool.A}
        | {k + ".B": pool.B[k][pool.slot_of("policy")].clone() for k in pool.B},
    }


class CountingSource:
    """A TensorSource that counts the elements it hands out (what a rank read of the checkpoint)."""

    def __init__(self, source):
        self.source, self.shapes, self.elements = source, source.shapes, 0

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        self.elements += t.numel()
        return t

    def read(self, name):
        return self._count(self.source.read(name))

    def narrow(self, name, dim, start, length):
        return self._count(self.source.narrow(name, dim, start, length))

    def a_log_heads(self, name, start, length):
        return self._count(self.source.a_log_heads(name, start, length))

    def order(self, names):
        return self.source.order(names)

    def release(self):
        self.source.release()


def _reads(path: str) -> dict:
    """Elements of the checkpoint each layout's rank reads, through `CheckpointSource`."""
    from miles_k3.model.checkpoint import CheckpointSource
    from rollout.parallel import EngineTP

    out = {}
    for name, ep in (("tp2", False), ("ep2", True)):
        source = CountingSource(CheckpointSource(path, CONFIG))
        build_engine_model(CONFIG, source, quantize="none", dtype=torch.float32, tp=EngineTP(ep_size=2 if ep else 1))
        out[name] = source.elements
    return out


def worker(rank: int, world: int, port: int, out: str, checkpoint: str) -> None:
    import faulthandler
    import os

    from rollout.build import build_sharded_engine
    from rollout.parallel import EngineTP

    faulthandler.dump_traceback_later(240, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        first, second = adapter(1), adapter(2)
        results = {}
        for name, case in CASES.items():
            if name == "ep2":  # from the checkpoint directory, each rank reading its slices
                engine = build_sharded_engine(
                    checkpoint,
                    EngineConfig(**memory(1), **SETTINGS),
                    ep=True,
                    lora=SPEC,
                    max_adapters=2,
                    quantize="none",
                    dtype=torch.float32,
                )
            else:
                engine = build(EngineTP(dcp_size=case["dcp"]), case["dcp"])
            buffers = [*engine.adapters.A.values(), *engine.adapters.B.values()]
            ptrs = [t.data_ptr() for t in buffers]
            if engine.is_leader:
                summary = _summary(workload(engine, first, second), engine)
                engine.stop_followers()
            else:
                summary = {}
                engine.follow()  # the adapter's add and update arrive here too
            same_storage = [t.data_ptr() for t in buffers] == ptrs
            results[name] = summary | {"rank": _rank_state(engine) | {"same_storage": same_storage}}
        # negative controls: without the row-parallel all-reduce, or without the DCP merge, the logits differ
        results["controls"] = _controls(rank)
        results["reads"] = _reads(checkpoint)
    finally:
        end_world()
    torch.save(results, f"{out}/rank{rank}.pt")


def _controls(rank: int) -> dict:
    """Log-probs of one greedy request: TP=2, TP=2 + DCP=2, and each with a collective taken out."""
    from rollout import dcp as dcp_module
    from rollout.parallel import EngineTP

    def run(tp: EngineTP, dcp: int = 1):
        engine = build(tp, dcp)
        if not engine.is_leader:
            return engine.follow()
        out = engine.generate([prompts()[0]], GREEDY)[0].logprobs
        engine.stop_followers()
        return out

    out = {"tp2": run(EngineTP()), "tp2-dcp2": run(EngineTP(dcp_size=2), 2)}
    tp = EngineTP()
    tp.all_reduce = lambda x: x  # the row-parallel outputs left partial
    out["no_all_reduce"] = run(tp)
    merge = dcp_module.merge_partials
    dcp_module.merge_partials = lambda o, lse: o[rank]  # each rank keeps only its own positions' part
    try:
        out["no_merge"] = run(EngineTP(dcp_size=2), 2)
    finally:
        dcp_module.merge_partials = merge
    return out


@pytest.fixture(scope="module")
def single():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (and 2 shared cores run best)
    try:
        engine = build()
        return _summary(workload(engine, adapter(1), adapter(2)), engine)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    from miles_k3.model.modeling import K3ForCausalLM

    out = tmp_path_factory.mktemp("engine_tp")
    reference = K3ForCausalLM(CONFIG)
    reference.load_state_dict(reference_state(CONFIG))
    reference.save_pretrained(out / "checkpoint")
    mp.spawn(worker, args=(2, free_port(), str(out), str(out / "checkpoint")), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _same(got, want, atol=1e-4):
    assert len(got) == len(want)
    for (ids, lps), (want_ids, want_lps) in zip(got, want):
        assert ids == want_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), rtol=0, atol=atol)


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_engine_equals_single_process(single, sharded, case):
    got = sharded[0][case]
    _same(got["batch"], single["batch"])
    _same(got["after_update"], single["after_update"])
    assert got["in_place"] and single["in_place"]
    assert max(got["cached"]) > 0  # the shared prefix came from the cache
    assert got["counters"]["retractions"] > 0
    # the fuzz: the same submissions (by rank 0 only) give the same outputs; seeded sampling included
    assert [f[:2] for f in got["fuzz"]] == [f[:2] for f in single["fuzz"]]
    _same([f[2:] for f in got["fuzz"]], [f[2:] for f in single["fuzz"]])


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_agree_and_hold_only_their_shares(sharded, case):
    lead, follow = sharded[0][case]["rank"], sharded[1][case]["rank"]
    for key in ("counters", "free_pages", "free_slots", "rows_per_page", "state_heads"):
        assert lead[key] == follow[key], key
    assert lead["same_storage"] and follow["same_storage"]  # add / update copied in place on every rank
    assert lead["state_heads"] == CONFIG.kda_num_heads // 2  # KDA state pool: this rank's heads
    assert lead["rows_per_page"] == SETTINGS["page_size"] // CASES[case]["dcp"]  # DCP: its positions' rows
    # the adapter update reached each rank's slices of the trainer's full tensors
    full = adapter(2)
    row, column, expert = (
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.block_sparse_moe.experts.w2",
    )
    for rank, state in enumerate((lead, follow)):
        a, b = full[f"{row}.lora_A"], full[f"{column}.lora_B"]
        assert torch.equal(state["slices"][row], a.chunk(2, dim=1)[rank])  # row split: A's columns
        assert torch.equal(state["slices"][column + ".B"], b.chunk(2, dim=0)[rank])  # column split: B's rows
        w2 = full[f"{expert}.lora_A"]  # EP: its experts whole; else w2 (row) its intermediate columns
        want = w2.chunk(2, dim=0)[rank] if CASES[case]["ep"] else w2.chunk(2, dim=2)[rank]
        assert torch.equal(state["slices"][expert], want)


def test_removing_the_all_reduce_or_the_dcp_merge_breaks_parity(sharded):
    c = sharded[0]["controls"]
    want = torch.tensor(c["tp2"])
    torch.testing.assert_close(torch.tensor(c["tp2-dcp2"]), want, rtol=0, atol=1e-4)
    assert (torch.tensor(c["no_all_reduce"]) - want).abs().max() > 1e-2
    assert (torch.tensor(c["no_merge"]) - want).abs().max() > 1e-2


def test_each_rank_reads_only_its_slices(sharded):
    """A rank of TP=2 reads about half the checkpoint (replicated tensors whole: the embedding, norms, router
    and latent projections); under EP=2 its experts only, with attention split as under TP."""
    from miles_k3.model.layout import is_routed_expert_tensor, tensor_shapes

    shapes = tensor_shapes(CONFIG)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    routed = sum(torch.Size(s).numel() for n, s in shapes.items() if is_routed_expert_tensor(n))
    for rank in range(2):
        reads = sharded[rank]["reads"]
        assert reads["tp2"] < 0.75 * total
        assert reads["ep2"] == reads["tp2"]  # the same bytes: whole experts of half of them, or half of each
        assert reads["tp2"] > routed / 2
