"""Distilling a DSpark drafter (rollout/spec/distill.py) on a target's own samples: the packed teacher pass
equals each sequence's own forward, blocks line the context and targets up with the sequence, a few steps
lower the total variation on held-out sequences of the same batch, and an engine's drafter trained in
place (same tensors, no rebuild) keeps speculation lossless."""

import random
from pathlib import Path

import pytest
import torch

import miles_k3
from miles_k3.model import K3ForCausalLM
from miles_k3.tasks import ArithmeticTokenizer
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.forward import hooks
from rollout.request import SamplingParams
from rollout.spec import SpecConfig
from rollout.spec.distill import DistillConfig, Distiller, anchors, make_blocks, teacher, teacher_blocks
from rollout.spec.drafter import DSparkConfig, DSparkDrafter, _features

ASSET = Path(miles_k3.__file__).parent / "assets" / "k3-tiny-arith"
TARGET = K3ForCausalLM.from_pretrained(ASSET).eval()  # trained: its distributions are worth imitating
LAYERS = (1, 3, 5)
TOK = ArithmeticTokenizer()
PROMPTS = [TOK.encode(p, add_bos=True) for p in ["12+7=", "40-9=", "3+3=", "77-70=", "8-15=", "61+29="]]


def new_drafter(seed: int = 0) -> DSparkDrafter:
    torch.manual_seed(seed)
    c = TARGET.config
    d = DSparkDrafter(
        DSparkConfig(
            target_layers=LAYERS,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            block_size=3,
            num_layers=1,
            intermediate_size=64,
            context_window=16,
        )
    )
    d.share(TARGET)
    return d


def new_engine(drafter=None) -> Engine:
    spec = None if drafter is None else SpecConfig(drafter=drafter, gamma=3)
    return Engine(
        TARGET,
        EngineConfig(
            memory_bytes=8 << 20, page_size=4, chunk_size=8, max_prefill_tokens=16, overlap="off", speculation=spec
        ),
    )


def sampled(eng: Engine, repeats: int = 4, seed: int = 0) -> list[tuple[int, list[int]]]:
    prompts = [p for p in PROMPTS for _ in range(repeats)]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(2,), seed=seed + i)
        for i in range(len(prompts))
    ]
    return [(len(p), p + c.output_ids) for p, c in zip(prompts, eng.generate(prompts, params))]


SEQS = sampled(new_engine())


def test_the_packed_teacher_pass_equals_each_sequences_own_forward():
    """Sequences packed into one forward (and split over forwards by max_tokens) see only themselves."""
    seqs = SEQS[:5]
    teach = teacher(TARGET, seqs, LAYERS, max_tokens=40)
    taps = {f"layer{i}": TARGET.model.layers[i] for i in LAYERS}
    for (_, t), (feats, probs) in zip(seqs, teach):
        store: dict = {}
        with hooks(taps, store), torch.no_grad():
            logits = TARGET(torch.tensor(t)[None]).logits[0]
        torch.testing.assert_close(feats, _features(store, LAYERS)[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(probs, logits.softmax(-1), atol=1e-5, rtol=1e-4)


def test_blocks_line_context_tokens_and_targets_up_with_the_sequence():
    """A block at anchor p: the context is the states before p, the tokens those after p, each target the
    teacher's distribution of that token; positions past the sequence's end are not valid."""
    seqs = SEQS[:3]
    teach = teacher(TARGET, seqs, LAYERS)
    d = new_drafter()
    examples = anchors(seqs)
    assert all(seqs[s][0] <= p < len(seqs[s][1]) - 1 for s, p in examples)  # generated anchors only
    s, p = max(examples, key=lambda e: e[1])  # the last anchor: one token after it
    b = make_blocks(seqs, teach, [(s, p), examples[0]], d.config)
    seq, (feats, probs) = seqs[s][1], teach[s]
    assert b.anchors[0] == seq[p] and b.valid[0].tolist() == [True, False, False]
    assert b.tokens[0, 0] == seq[p + 1]
    torch.testing.assert_close(b.probs[0, 0], probs[p])
    c = feats[max(0, p - 16) : p]
    torch.testing.assert_close(b.ctx[0, : len(c)], c)
    assert b.mask[0].sum() == len(c)
    s0, p0 = examples[0]
    n = min(3, len(seqs[s0][1]) - 1 - p0)
    assert b.tokens[1, :n].tolist() == seqs[s0][1][p0 + 1 : p0 + 1 + n]


def test_blocks_from_a_target_pass_over_their_sequences_only_equal_the_kept_teachers():
    """teacher_blocks (the online path: only the examples' sequences, only the block positions' lm_head)
    builds the blocks make_blocks builds from the whole teacher, across forwards split by max_tokens."""
    d = new_drafter()
    examples = random.Random(0).sample(anchors(SEQS), 40)
    want = make_blocks(SEQS, teacher(TARGET, SEQS, LAYERS), examples, d.config)
    got = teacher_blocks(TARGET, SEQS, examples, d.config, max_tokens=60)
    for name, a, b in zip(want._fields, want, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=name)


def test_distillation_lowers_the_heldout_total_variation_on_the_batchs_own_sequences():
    d = new_drafter()
    distiller = Distiller(d, DistillConfig(steps=15, lr=3e-3, blocks=64, heldout_every=4))
    out = distiller.distil(SEQS, lambda ex: teacher_blocks(TARGET, SEQS, ex, d.config), random.Random(0))
    train = [s for i, s in enumerate(SEQS) if i % 4 != 3]  # every 4th sequence is held out
    assert out["blocks"] == 15 * min(64, len(anchors(train)))
    assert out["tv_after"] < out["tv_before"] - 0.05, out


def test_the_engines_drafter_trains_in_place_and_speculation_stays_lossless():
    """The engine keeps the drafter it was built with; a distillation moves its tensors' values, not their
    storage, and greedy speculation still equals plain greedy, token for token and log-prob within 1e-4."""
    d = new_drafter(1)
    eng, plain = new_engine(d), new_engine()
    greedy = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(2,))
    want = plain.generate(PROMPTS[:3], greedy)

    def check_lossless():
        got = eng.generate(PROMPTS[:3], greedy)
        for a, b in zip(want, got):
            assert a.output_ids == b.output_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4

    check_lossless()
    ptrs = {n: p.data_ptr() for n, p in d.named_parameters()}
    before = {n: p.detach().clone() for n, p in d.named_parameters()}
    seqs = SEQS[:8]
    Distiller(d, DistillConfig(steps=3, lr=1e-2, blocks=32)).distil(
        seqs, lambda ex: teacher_blocks(TARGET, seqs, ex, d.config), random.Random(1)
    )
    assert eng.decoder.strategy.drafter is d
    assert {n: p.data_ptr() for n, p in d.named_parameters()} == ptrs
    moved = [n for n, p in d.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert "fc.weight" in moved and "layers.0.q.weight" in moved
    assert all(p.grad is None for p in d.parameters())  # no gradient buffers kept
    check_lossless()


def test_a_distillation_drops_the_windows_of_requests_in_flight():
    """The windows hold the draft layers' keys and values under the old weights: a request decoding across a
    distillation catches up under the new ones, and stays lossless."""
    d = new_drafter(2)
    eng = new_engine(d)
    greedy = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(2,))
    want = new_engine().generate(PROMPTS[:1], greedy)
    rid = eng.submit(PROMPTS[0], greedy)
    while rid not in d.contexts:
        eng.step()
    seqs = SEQS[:8]
    Distiller(d, DistillConfig(steps=1, lr=1e-2, blocks=16)).distil(
        seqs, lambda ex: teacher_blocks(TARGET, seqs, ex, d.config), random.Random(2)
    )
    assert not d.contexts.ids()
    done = {}
    while eng.has_work():
        done.update((c.request_id, c) for c in eng.step())
    assert done[rid].output_ids == want[0].output_ids


@pytest.mark.parametrize(
    "field, value",
    [
        ("steps", 0),
        ("blocks", 0),
        ("lr", 0.0),
        ("decay", 1.5),
        ("heldout_every", 1),
        ("grad_clip", -1.0),
        ("weight_decay", "x"),
    ],
)
def test_bad_distill_settings_fail_by_field_name(field, value):
    with pytest.raises(ValueError, match=rf"^DistillConfig\.{field} "):
        DistillConfig(**{field: value})
