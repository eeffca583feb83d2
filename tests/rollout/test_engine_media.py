"""Images through the engine (rollout/media.py, the prefill splice in rollout/engine.py, the cache keys in
rollout/scheduler.py and rollout/cache_manager.py), with k3-tiny-vl's tower on random weights: greedy output
with images equals the reference model's fed the same features (`MediaEmbeds`), token for token and
log-probs within 1e-4 (fp32), whatever the chunking; prompts with the same text and other images share
nothing past the first pad, the same image shares the whole prompt, and a hit ending inside an image resumes
the splice there; features are encoded once for a GRPO group; pools drain to full after aborts and
retractions; adapters, speculation and a sharded engine take media requests; bad images fail at submit."""

import pytest
import torch

from miles_k3.data.image_processor import ProcessedImage
from miles_k3.model import K3Config, MediaEmbeds
from miles_k3.model.generate import greedy_generate
from miles_k3.model.vision import K3VisionModel
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.media import ImageFeatures, image_keys, key_base
from rollout.request import FinishReason, SamplingParams
from rollout.spec import Drafter, SpecConfig
from tests.rollout.common import MODEL, ROOMY, SMALL, TIGHT, assert_pools_drain_to_full, drain
from tests.rollout.test_adapters import engine_model, merged_reference, random_adapter

VL = K3Config.from_preset("k3-tiny-vl")  # k3-tiny's text model (MODEL's shape) with a tiny tower
PAD, BEGIN, END = VL.media_placeholder_token_id, 5, 6  # the media pad / begin / end tokens
D = MODEL.config.hidden_size
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


class CountingVision(K3VisionModel):
    """k3-tiny-vl's tower and projector (seeded random weights), counting its encode calls."""

    calls = 0

    def encode(self, pixel_values, grid_thw):
        self.calls += 1
        return super().encode(pixel_values, grid_thw)


torch.manual_seed(7)
VISION = CountingVision(VL.vision_config).eval()


def pixels(n: int, seed: int) -> ProcessedImage:
    """A processed image of n merged tokens: a 2 x 2n patch grid of seeded random pixels."""
    p = VL.vision_config.patch_size
    px = torch.randn(4 * n, 3, p, p, generator=torch.Generator().manual_seed(seed))
    return ProcessedImage(px, (1, 2, 2 * n), n, (2 * n * p, 2 * p), (2 * n * p, 2 * p), f"img-{seed}-{n}".encode())


def image(n: int, seed: int) -> ImageFeatures:
    """The same image as features: the tower's rows for `pixels(n, seed)`, under its content hash."""
    p = pixels(n, seed)
    with torch.no_grad():
        return ImageFeatures(K3VisionModel.encode(VISION, p.pixel_values, torch.tensor([p.grid_thw])), p.content_hash)


def text(n: int, seed: int) -> list[int]:
    return torch.randint(7, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def media_prompt(parts) -> list[int]:
    """parts: ints (that many text tokens, seeded by position) and images (begin, pads, end)."""
    out = []
    for part in parts:
        if isinstance(part, int):
            out += text(part, 1000 + len(out))
        else:
            out += [BEGIN] + [PAD] * part.features.shape[0] + [END]
    return out


def media_engine(memory: int = ROOMY, model=MODEL, adapters=None, **kw) -> Engine:
    return Engine(
        model, EngineConfig(memory_bytes=memory, **{**SMALL, **kw}), adapters, vision=VISION, media_token_id=PAD
    )


@torch.no_grad()
def reference(prompt: list[int], images: list[ImageFeatures], n: int = GREEDY.max_new_tokens, model=MODEL):
    """The reference model fed the images at the pads: one prefill with `MediaEmbeds`, then greedy decode."""
    ids = torch.tensor([prompt])
    pads = torch.tensor([p for p, t in enumerate(prompt) if t == PAD], dtype=torch.long)
    feats = torch.cat([im.features for im in images]) if images else torch.zeros(0, D)
    tokens, logps = greedy_generate(model, ids, n, media=MediaEmbeds(pads, feats))
    return tokens[0].tolist(), logps[0].tolist()


def assert_matches(out, want) -> None:
    assert out.output_ids == want[0]
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(want[1]), rtol=0, atol=1e-4)


def test_greedy_with_images_equals_the_reference_across_chunk_splits():
    a, b = image(13, 1), image(6, 2)
    p = media_prompt([3, a, 5, b, 4])  # 34 tokens: image a's pads [4, 17) cross the chunk boundaries 8, 16
    want = reference(p, [a, b])
    assert want != reference(media_prompt([3, a, 5, image(6, 3), 4]), [a, image(6, 3)])  # images matter
    for budget in (8, 16, 64):
        eng = media_engine(max_prefill_tokens=budget)
        assert_matches(eng.generate([p], GREEDY, images=[[a, b]])[0], want)
        assert_pools_drain_to_full(eng)


def test_processed_images_are_encoded_once_for_a_group_and_match_features():
    eng = media_engine()
    img = pixels(9, 4)
    p = media_prompt([2, image(9, 4), 3])
    calls = VISION.calls
    outs = eng.generate([p] * 4, GREEDY, images=[[img]] * 4)
    assert VISION.calls == calls + 1 and eng.media.encoded_images == 1
    want = reference(p, [image(9, 4)])
    for out in outs:
        assert_matches(out, want)
    c = SMALL["chunk_size"]  # the followers waited for the leader's prefill and restored all they can
    assert [o.cached_tokens for o in outs] == [0] + [(len(p) - 1) // c * c] * 3
    assert_pools_drain_to_full(eng)
    assert eng.media.held_images == 0  # finished requests hold no features
    streamed = list(eng.stream(p, GREEDY, images=[img]))
    assert VISION.calls == calls + 2  # nothing held it: encoded again
    assert [t for t, _ in streamed] == want[0]


def test_same_text_other_image_shares_nothing_past_the_first_pad_and_the_same_image_shares_all():
    a, b = image(12, 5), image(12, 6)
    pa, pb = media_prompt([9, a, 6]), media_prompt([9, b, 6])
    assert pa == pb  # the same ids: only the features differ
    eng = media_engine()
    out_a = eng.generate([pa], GREEDY, images=[[a]])[0]
    assert_matches(out_a, reference(pa, [a]))
    first_pad = pa.index(PAD)
    # the tree's view of b's prompt: its KV match stops at the page holding the first pad
    req_b = eng.media.place(pb, [b])
    m = eng.memory.match(None, req_b.keys(pb))
    assert m.kv_match_len == first_pad // SMALL["page_size"] * SMALL["page_size"]
    out_b = eng.generate([pb], GREEDY, images=[[b]])[0]
    assert out_b.cached_tokens <= first_pad
    assert_matches(out_b, reference(pb, [b]))
    again = eng.generate([pa], GREEDY, images=[[a]])[0]  # the same image: the whole prompt hits
    c = SMALL["chunk_size"]
    assert again.cached_tokens == (len(pa) - 1) // c * c
    assert_matches(again, reference(pa, [a]))
    assert_pools_drain_to_full(eng)


def test_a_hit_ending_inside_an_image_resumes_the_splice_there():
    img = image(20, 8)
    first = media_prompt([5, img, 10])  # pads [6, 26)
    second = first[:27] + text(8, 99)  # the same text and image, another ending
    eng = media_engine()
    assert_matches(eng.generate([first], GREEDY, images=[[img]])[0], reference(first, [img]))
    out = eng.generate([second], GREEDY, images=[[img]])[0]
    assert 6 < out.cached_tokens < 26  # a checkpoint inside the image (16 or 24)
    assert_matches(out, reference(second, [img]))
    assert_pools_drain_to_full(eng)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_decode_graph_shapes_and_overlap_are_unchanged_by_media(overlap):
    """Decode never sees an image: padded graph shapes (run eagerly on the CPU) and the overlap schedule
    give the reference's tokens for a batch mixing media and text requests."""
    from rollout.forward import DecodeGraphs

    eng = media_engine(overlap=overlap, max_running=4)
    eng.graphs = DecodeGraphs(eng.model, eng.kv, eng.states, max_batch=4, max_seq_len=256, capture=False)
    a, b = image(7, 16), image(5, 17)
    prompts = [media_prompt([3, a, 4]), media_prompt([6, b, 2]), text(9, 3)]
    outs = eng.generate(prompts, GREEDY, images=[[a], [b], None])
    for out, p, ims in zip(outs, prompts, [[a], [b], []]):
        assert_matches(out, reference(p, ims))
    assert eng.counters()["graph_replays"] > 0
    assert_pools_drain_to_full(eng)


def test_the_same_image_at_another_place_or_a_repeat_in_one_prompt():
    img = image(7, 9)
    p = media_prompt([3, img, 2, img, 3])
    eng = media_engine()
    assert_matches(eng.generate([p], GREEDY, images=[[img, img]])[0], reference(p, [img, img]))
    shifted = media_prompt([4, img, 5])
    assert_matches(eng.generate([shifted], GREEDY, images=[[img]])[0], reference(shifted, [img]))
    assert_pools_drain_to_full(eng)


def test_outputs_that_are_the_pad_id_stay_text_after_a_retraction():
    """The keys replace the prompt's pads only: an output token equal to the pad id is a text token (the
    re-prefill after a retraction feeds its embedding, not a feature row)."""
    img = image(5, 10)
    p = media_prompt([3, img, 3])
    eng = media_engine()
    r = eng.media.place(p, [img])
    tokens = p + [PAD, 9]
    assert r.keys(tokens)[len(p) :] == [PAD, 9]
    assert r.rows(len(p), len(tokens)) == ([], None)


@pytest.mark.parametrize("unified", [False, True])
def test_pools_drain_to_full_after_an_abort_mid_prefill_and_retractions(unified):
    eng = media_engine(
        TIGHT["memory"], state_fraction=TIGHT["state_fraction"], max_prefill_tokens=8, unified_memory=unified
    )
    imgs = [image(10, 20 + i) for i in range(4)]
    prompts = [media_prompt([2 + i, im, 3]) for i, im in enumerate(imgs)]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    ids = [eng.submit(p, params, images=[im]) for p, im in zip(prompts, imgs)]
    eng.step()
    eng.check_invariants()
    aborted = eng.abort(ids[0])  # mid-prefill: 8 of its 17 tokens computed
    assert aborted.finish_reason == FinishReason.ABORT and aborted.output_ids == []
    done = {}
    while eng.has_work():
        done.update((c.request_id, c) for c in eng.step())
        eng.check_invariants()
    # unified memory admits a request only when it can prefill: its requests wait instead of retracting
    assert (eng.counters()["retractions"] > 0) != unified
    for rid, p, im in zip(ids[1:], prompts[1:], imgs[1:]):
        assert_matches(done[rid], reference(p, [im], 12))
    assert_pools_drain_to_full(eng)


def test_media_requests_with_an_adapter_equal_the_merged_reference():
    model, pool = engine_model("none")
    eng = media_engine(model=model, adapters=pool)
    tensors = random_adapter(pool, 3)
    eng.add_adapter("policy", tensors)
    img = image(9, 11)
    p = media_prompt([4, img, 3])
    got, base = eng.generate([p, p], GREEDY, adapter=["policy", None], images=[[img], [img]])
    assert_matches(got, reference(p, [img], model=merged_reference(tensors, pool.spec.scale)))
    assert_matches(base, reference(p, [img]))
    eng.check_invariants()


class ReferenceDrafter(Drafter):
    """Drafts the reference continuation of each request (by id), every third draft wrong; q one-hot."""

    def __init__(self):
        self.script: dict[int, list[int]] = {}

    def propose(self, batch, anchors, gamma, params):
        v = MODEL.config.vocab_size
        rows = []
        for r in batch:
            ref, k = self.script[r.req.request_id], len(r.req.output_ids)
            rows.append([(ref[k + j] + (j == 2)) % v if k + j < len(ref) else 7 for j in range(gamma)])
        drafts = torch.tensor(rows, device=anchors.device)
        return drafts, torch.nn.functional.one_hot(drafts, v).float()


@pytest.mark.parametrize("kind", ["scripted", "dspark"])
def test_speculative_decoding_of_media_requests_equals_the_reference(kind):
    """Lossless whatever the drafts: a drafter that knows the answer, and a random DSpark drafter (its catch-up
    pass reads the prompt's hidden states without the image features: acceptance, not correctness)."""
    from tests.rollout.test_spec_drafter import drafter as dspark

    drafter = ReferenceDrafter() if kind == "scripted" else dspark(0)
    eng = media_engine(speculation=SpecConfig(drafter=drafter, gamma=3))
    a, b = image(11, 12), image(11, 13)
    pa, pb = media_prompt([3, a, 4]), media_prompt([3, b, 4])
    want = {}
    for p, im in ((pa, a), (pb, b)):
        rid = eng.submit(p, GREEDY, images=[im])
        want[rid] = reference(p, [im])
        if kind == "scripted":
            drafter.script[rid] = want[rid][0]
    done = drain(eng)
    for rid, w in want.items():
        assert_matches(done[rid], w)
    assert_pools_drain_to_full(eng)


def test_bad_images_fail_at_submit_and_queue_nothing():
    eng = media_engine()
    img = image(6, 14)
    p = media_prompt([3, img, 3])
    calls = VISION.calls
    bad = [
        ([image(5, 14)], "media pad tokens"),  # 6 pads, 5 rows
        ([], "media pad tokens"),  # pads without images
        ([img, img], "media pad tokens"),
        ([ImageFeatures(torch.zeros(6, D + 1), "w")], "hidden_size"),
        ([ImageFeatures(torch.zeros(6), "w")], "hidden_size"),
        (["not an image"], "ImageFeatures or a ProcessedImage"),
    ]
    for images, match in bad:
        with pytest.raises(ValueError, match=match) as e:
            eng.submit(p, GREEDY, images=images)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="ends on a media pad"):
        eng.submit(media_prompt([3, img])[:-1], GREEDY, images=[img])  # no end token after the pads
    with pytest.raises(ValueError, match="one entry per prompt"):
        eng.generate([p, p], GREEDY, images=[[img]])
    no_vision = Engine(MODEL, EngineConfig(memory_bytes=ROOMY, **SMALL), media_token_id=PAD)
    with pytest.raises(ValueError, match="no vision model"):
        no_vision.submit(p, GREEDY, images=[pixels(6, 14)])
    no_pad = Engine(MODEL, EngineConfig(memory_bytes=ROOMY, **SMALL))
    with pytest.raises(ValueError, match="media_token_id"):
        no_pad.submit(p, GREEDY, images=[img])
    assert not eng.has_work() and not no_vision.has_work() and not no_pad.has_work()
    assert VISION.calls == calls  # nothing above reached the vision model


def test_a_vl_checkpoints_engine_takes_the_pad_id_from_its_config():
    from miles_k3.model import K3ForCausalLM

    vl = K3ForCausalLM(VL).eval()
    vl.load_state_dict(MODEL.state_dict())
    eng = Engine(vl, EngineConfig(memory_bytes=ROOMY, **SMALL), vision=VISION)
    img = pixels(6, 15)
    p = media_prompt([3, image(6, 15), 3])
    assert_matches(eng.generate([p], GREEDY, images=[[img]])[0], reference(p, [image(6, 15)]))


def test_image_keys_are_negative_distinct_per_offset_and_content():
    a, b = key_base("a", 8), key_base("b", 8)
    ka, kb = image_keys(a, 8), image_keys(b, 8)
    assert all(k < 0 for k in ka + kb) and len(set(ka)) == 8 and not set(ka) & set(kb)
    assert image_keys(key_base("a", 8), 8) == ka and key_base("a", 9) != a


def _sharded_worker(rank: int, port: int, out: str) -> None:
    """One rank of a TP=2 engine (gloo, fp32): rank 0 submits media prompts, rank 1 follows with its
    features from rank 0's broadcast."""
    import os

    import torch.distributed as dist

    from megatron_patches.parallel import end_world
    from miles_k3.model.modeling import reference_state
    from rollout.model_runner import build_engine_model
    from rollout.parallel import EngineTP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model, _ = build_engine_model(
            MODEL.config, reference_state(MODEL.config), quantize="none", dtype=torch.float32, tp=EngineTP()
        )
        eng = media_engine(model=model)
        if eng.is_leader:
            a, b = image(9, 30), image(9, 31)
            pa, pb = media_prompt([3, a, 4]), media_prompt([3, b, 4])
            outs = eng.generate([pa, pb, pa], GREEDY, images=[[a], [b], [a]])
            eng.stop_followers()
            torch.save([(o.output_ids, o.logprobs) for o in outs], f"{out}/outs.pt")
        else:
            eng.follow()
        eng.check_invariants()
    finally:
        end_world()


def test_a_sharded_engine_takes_rank_0s_features(tmp_path):
    import torch.multiprocessing as mp

    from megatron_patches.parallel import free_port
    from miles_k3.model.modeling import reference_state

    mp.spawn(_sharded_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ref = type(MODEL)(MODEL.config).eval()
    ref.load_state_dict(reference_state(MODEL.config))
    a, b = image(9, 30), image(9, 31)
    pa, pb = media_prompt([3, a, 4]), media_prompt([3, b, 4])
    got = torch.load(tmp_path / "outs.pt", weights_only=False)
    for (ids, lps), p, im in zip(got, [pa, pb, pa], [a, b, a]):
        want = reference(p, [im], model=ref)
        assert ids == want[0]
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want[1]), rtol=0, atol=1e-4)
