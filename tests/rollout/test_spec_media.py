"""A drafter's target states with images: the DSpark catch-up pass and the distillation teacher splice a
request's image features at its pads as the engine's prefill does, so the states they read equal the
reference model's fed the features (and differ from a pass without them); decoding stays lossless."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from miles_k3.model import MediaEmbeds
from rollout.forward import hooks
from rollout.spec import SpecConfig
from rollout.spec.distill import make_blocks, teacher, teacher_blocks
from rollout.spec.drafter import _features
from tests.rollout.common import MODEL, assert_pools_drain_to_full, drain
from tests.rollout.test_engine_media import GREEDY, PAD, assert_matches, image, media_engine, media_prompt, reference
from tests.rollout.test_spec_drafter import drafter as dspark


@torch.no_grad()
def reference_states(prompt: list[int], images, layers: tuple[int, ...], with_media: bool = True) -> torch.Tensor:
    """The tapped layers' states [T, F] of the reference model over `prompt`, fed the images at its pads."""
    pads = torch.tensor([p for p, t in enumerate(prompt) if t == PAD], dtype=torch.long)
    media = MediaEmbeds(pads, torch.cat([im.features for im in images])) if with_media else None
    by_index = {layer.layer_idx: layer for layer in MODEL.model.layers}
    store: dict = {}
    with hooks({f"layer{i}": by_index[i] for i in layers}, store):
        MODEL.model.hidden(torch.tensor([prompt]), None, torch.tensor([0, len(prompt)]), media=media)
    return _features(store, layers)[0].float()


def test_catch_up_states_at_the_pads_equal_the_reference_fed_the_features():
    d = dspark(0)
    eng = media_engine(speculation=SpecConfig(drafter=d, gamma=3))
    a = image(5, 21)
    prompt = media_prompt([3, a, 4])  # 14 tokens: all inside the drafter's 16-position window
    row = SimpleNamespace(
        req=SimpleNamespace(request_id=-1, adapter=None, media=eng.media.place(prompt, [a])),
        pos=len(prompt),
        tokens=prompt,
    )
    d._catch_up([row])
    got = d.contexts.get(-1)  # the draft layers' keys and values of the states
    want = reference_states(prompt, [a], d.config.target_layers)
    with torch.no_grad():
        torch.testing.assert_close(got, d.context(want), atol=1e-5, rtol=0)
    blind = reference_states(prompt, [a], d.config.target_layers, with_media=False)
    pads = [p for p, t in enumerate(prompt) if t == PAD]
    assert (blind[pads] - want[pads]).abs().max() > 1e-3  # the features change the states: the test can fail


def test_speculation_over_media_requests_with_a_dspark_drafter_is_lossless():
    eng = media_engine(speculation=SpecConfig(drafter=dspark(1), gamma=3))
    a, b = image(6, 31), image(6, 32)
    want = {}
    for p, im in ((media_prompt([2, a, 5]), a), (media_prompt([2, b, 5]), b)):
        want[eng.submit(p, GREEDY, images=[im])] = reference(p, [im])
    done = drain(eng)
    for rid, w in want.items():
        assert_matches(done[rid], w)
    assert_pools_drain_to_full(eng)


def test_the_distillation_teacher_splices_the_features():
    d = dspark(2)
    eng = media_engine()
    a, b = image(4, 41), image(4, 42)
    prompts = [media_prompt([2, a, 3]), media_prompt([1, b, 4]), [9, 10, 11, 12, 13, 14]]
    media = [eng.media.place(prompts[0], [a]), eng.media.place(prompts[1], [b]), None]
    seqs = [(len(p) - 3, p) for p in prompts]  # the last 3 tokens stand for the response
    layers = d.config.target_layers
    got = teacher(MODEL, seqs, layers, media=media)
    for (feats, _), p, ims in zip(got, prompts, ([a], [b], [])):
        torch.testing.assert_close(feats, reference_states(p, ims, layers, with_media=bool(ims)), atol=1e-5, rtol=0)
    examples = [(0, len(prompts[0]) - 3), (1, len(prompts[1]) - 2), (2, 3)]
    blocks = teacher_blocks(MODEL, seqs, examples, d.config, media=media)
    want = make_blocks(seqs, got, examples, d.config)
    for x, y in zip(blocks, want):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
