"""Image prompts through the GRPO loop, on a random k3-tiny-vl checkpoint (fp32, unquantized: text model, tower
and projector, preprocessor_config.json, a word-level HF tokenizer with the media tokens): each prompt's
features are computed once and shared by its samples in the engine and in the trainer's packed row, the
trainer's recomputed log-probs equal the engine's (the loop's train_rollout_logprob_abs_diff), another image
changes them, a text-only run builds and imports none of the image path, and bad image input fails before any
model is built in one line naming the record or field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_k3.data.media import IMAGE_PLACEHOLDER
from miles_k3.trainer.resolve import resolve
from tests.trainer.recipes import composed
from tests.vl_checkpoint import WORDS, write_png, write_vl_checkpoint

REPO = Path(__file__).resolve().parents[2]
WORDS_RL = (*WORDS, *(f"w{i}" for i in range(400)))  # a random policy's words, so responses vary
PROMPT = f"{IMAGE_PLACEHOLDER} how many red squares ?"


def reward(sample) -> float:
    """Some signal from a random policy: the parity of the response's word count."""
    return float(len(sample.response.split()) % 2)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vl")
    write_vl_checkpoint(root / "ckpt", WORDS_RL)
    for i in range(3):
        write_png(root / f"{i}.png", i)
    # two image prompts and a text one: a batch mixes them
    write_rows(
        root / "train.jsonl",
        [
            {"prompt": PROMPT, "images": ["0.png"], "label": 0},
            {"prompt": f"how many ? {IMAGE_PLACEHOLDER} red", "images": ["1.png"], "label": 1},
            {"prompt": "how many red squares ?", "label": 2},
        ],
    )
    return root


def overrides(root: Path, *extra: str) -> list[str]:
    return [
        "recipe=k3_grpo",
        f"model.path={root / 'ckpt'}",
        "model.tokenizer=hf",
        f"data.path={root / 'train.jsonl'}",
        "data.eval_path=null",
        "data.shuffle=false",
        f"reward.fn={__name__}:reward",
        "rollout.prompts_per_step=3",
        "rollout.samples_per_prompt=3",
        "rollout.max_new_tokens=4",
        "rollout.stop_at_eos=false",
        "algo.dynamic_sampling=false",
        "trainer.max_steps=2",
        "trainer.save_every=0",
        "trainer.eval_every=0",
        "trainer.eval_before=false",
        "logging.progress=false",
        "logging.wandb=disabled",
        *extra,
    ]


def build(rc, run_dir):
    from megatron_patches.parallel import ensure_parallel
    from miles_k3.trainer.backends import ColocatedEngines, ColocatedRank, ColocatedTrainers, LocalRanks
    from miles_k3.trainer.inputs import load_run_inputs
    from miles_k3.trainer.workers import build_rollout_worker, build_train_worker

    ensure_parallel()
    inputs = load_run_inputs(rc, run_dir, weights="keep")
    engine = build_rollout_worker(rc, inputs.config, inputs.base_state, "cpu")
    trainer = build_train_worker(rc, inputs.config, inputs.base_state, "cpu")
    ranks = LocalRanks(ColocatedRank(trainer, engine, 0, 1))
    return inputs, engine, trainer, (ColocatedEngines(ranks), ColocatedTrainers(ranks))


def test_image_rollouts_train_with_the_engines_logprobs_and_encode_each_prompt_once(vl, tmp_path):
    from miles_k3.trainer.loop import GRPODriver

    rc = resolve(composed(*overrides(vl)))
    inputs, engine, trainer, workers = build(rc, tmp_path)
    driver = GRPODriver(rc, tmp_path, *workers, inputs)
    rows = driver.run()
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["groups_kept"] == 3
        assert r["train_rollout_logprob_abs_diff"] < 1e-4  # fp32, unquantized: one model on both sides
        assert r["grad_norm"] > 0  # the rewards vary: a real update through the image rows
    # two image prompts a step, each through the tower once for its three samples; the engine encoded none
    assert inputs.media.encoded_prompts == 4
    assert engine.engine.media.encoded_images == 0


def _batch(driver, records, n=2):
    """Rollouts of `records` (n samples each) as a TrainBatch, through the driver's own encode and generate."""
    from miles_k3.trainer.batch import TrainBatch

    samples = driver.samples(records, n)
    return TrainBatch(driver._generate(records, samples, [driver._params(seed=i) for i in range(len(samples))]))


def test_the_trainer_reads_the_images_features(vl, tmp_path):
    """The trainer's log-probs of image rollouts equal the engine's; the same tokens after another image, or
    with the features left out, get other log-probs: the features reach the trainer's row."""
    import dataclasses

    from miles_k3.trainer.batch import SequenceMedia, TrainBatch
    from miles_k3.trainer.loop import GRPODriver

    rc = resolve(composed(*overrides(vl)))
    inputs, engine, trainer, workers = build(rc, tmp_path)
    workers[0].sync_adapter(workers[1])
    driver = GRPODriver(rc, tmp_path, *workers, inputs)
    batch = _batch(driver, inputs.train[:2])
    assert all(m is not None and len(m.positions) == m.features.shape[0] > 0 for m in batch.media)
    assert batch.media[0] is batch.media[1]  # a prompt's samples share one features tensor
    got = trainer.logprobs(batch)
    for mine, theirs in zip(got, batch.rollout_logprobs):
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), atol=1e-4, rtol=0)

    # the second prompt's image on the first prompt's pads (both images are 56 x 42: the same pad count)
    other = driver.samples([dataclasses.replace(inputs.train[0], images=inputs.train[1].images)], 1)[0].media
    assert other.positions == batch.media[0].positions

    def with_media(media):  # the batch's samples, their images replaced
        return TrainBatch([dataclasses.replace(s, media=m) for s, m in zip(batch.samples, media)])

    moved = trainer.logprobs(with_media([SequenceMedia(other.positions, other.images)] * 2 + batch.media[2:]))
    assert max(abs(a - b) for a, b in zip(moved[0], got[0])) > 1e-3
    # the other prompt's rows are untouched (up to the packed row's float summation order)
    torch.testing.assert_close(torch.tensor(moved[2:]), torch.tensor(got[2:]), atol=1e-5, rtol=0)
    blank = trainer.logprobs(with_media([None] * len(batch)))  # the pads' own (text) embeddings
    assert max(abs(a - b) for a, b in zip(blank[0], got[0])) > 1e-3


def test_mixed_text_and_image_pieces_pack_their_media_at_packed_positions(vl, tmp_path):
    from miles_k3.trainer.batch import SequenceMedia, TrainBatch, pack
    from rollout.media import ImageFeatures

    feats = torch.arange(6.0).reshape(3, 2)
    m = SequenceMedia((1, 2), (ImageFeatures(feats[:1], 1), ImageFeatures(feats[1:2], 2)))
    b = TrainBatch.of(
        [[5, 3, 3, 6], [7, 8], [5, 3, 6]],
        [[9], [10, 11], [12]],
        [[0.0], [0.0, 0.0], [0.0]],
        [0.0] * 3,
        [0, 1, 2],
        media=[m, None, SequenceMedia((1,), (ImageFeatures(feats[2:], 3),))],
    )
    p = pack(b, "cpu")
    assert p.media.positions.tolist() == [1, 2, 10]  # sequence 2 starts after 4 + 1 and 2 + 2 tokens: at 9
    assert torch.equal(p.media.features, feats)
    assert pack(b.select([1]), "cpu").media is None
    assert b.select([2, 0]).media == [b.media[2], m]
    with pytest.raises(ValueError, match="media"):
        TrainBatch.of([[5, 3]], [[9]], [[0.0]], [0.0], [0], media=[m])


def test_a_text_only_run_builds_and_imports_none_of_the_image_path(tmp_path):
    code = (
        "import sys\n"
        "from miles_k3.trainer.inputs import load_run_inputs\n"
        "from miles_k3.trainer.loop import GRPODriver\n"
        "from miles_k3.trainer.resolve import resolve\n"
        "from tests.trainer.recipes import composed\n"
        "rc = resolve(composed('recipe=k3_grpo'))\n"
        f"inputs = load_run_inputs(rc, {str(tmp_path)!r}, weights='skip')\n"
        f"driver = GRPODriver(rc, {str(tmp_path)!r}, None, None, inputs)\n"
        "assert inputs.media is None and driver.media is None\n"
        "driver.samples(inputs.train[:4], 2)\n"
        "bad = [m for m in ('miles_k3.data.image_processor', 'miles_k3.model.vision', 'PIL') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize(
    "rows, extra, needle",
    [
        ([{"prompt": PROMPT, "images": ["missing.png"], "label": 0}], (), "image file 'missing.png' not found"),
        (
            [{"prompt": f"{PROMPT} {IMAGE_PLACEHOLDER}", "images": ["0.png"], "label": 0}],
            (),
            "has 2 image placeholder(s)",
        ),
        ([{"prompt": PROMPT, "images": ["notpng.png"], "label": 0}], (), "not a readable image"),
        (
            [{"prompt": PROMPT, "images": ["0.png"], "label": 0}],
            ("rollout.fn=tests.trainer.test_multi_turn:x",),
            "image prompts through rollout.fn",
        ),
    ],
)
def test_bad_image_input_fails_before_any_model_naming_the_record(vl, tmp_path, rows, extra, needle):
    from miles_k3.trainer.inputs import load_run_inputs

    (tmp_path / "notpng.png").write_text("not an image")
    write_png(tmp_path / "0.png", 0)
    data = write_rows(tmp_path / "data.jsonl", rows)
    rc = resolve(composed(*overrides(vl), f"data.path={data}", *extra))
    with pytest.raises(ValueError) as e:
        load_run_inputs(rc, tmp_path, weights="skip")
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and msg.startswith("data.path"), msg
    assert "line 1" in msg or "record 0" in msg, msg  # the record is named


def test_images_on_a_text_only_checkpoint_or_a_preset_fail_naming_the_record(vl, tmp_path):
    from miles_k3.trainer.inputs import load_run_inputs

    write_png(tmp_path / "0.png", 0)
    data = write_rows(
        tmp_path / "data.jsonl", [{"prompt": f"{IMAGE_PLACEHOLDER}12+3=", "images": ["0.png"], "label": 15}]
    )
    rc = resolve(composed("recipe=k3_grpo", f"data.path={data}", "data.eval_path=null"))
    with pytest.raises(
        ValueError,
        match=r"^data\.path: .*record 0 .*has 1 image\(s\), but model\.path .* is a "
        r"text-only checkpoint",
    ):
        load_run_inputs(rc, tmp_path, weights="skip")
    rc = resolve(
        composed(
            *overrides(vl),
            f"data.path={data}",
            "model.path=null",
            "model.preset=k3-tiny-vl",
            "model.tokenizer=arithmetic",
        )
    )
    with pytest.raises(ValueError, match=r"images need model\.path .*not model\.preset"):
        load_run_inputs(rc, tmp_path, weights="skip")


def test_data_images_key_is_reachable_from_hydra_and_lora_projector_is_refused(vl, tmp_path):
    data = write_rows(tmp_path / "data.jsonl", [{"prompt": PROMPT, "pictures": ["0.png"], "label": 0}])
    write_png(tmp_path / "0.png", 0)
    rc = resolve(composed(*overrides(vl), f"data.path={data}", "data.images_key=pictures"))
    assert rc.data.images_key == "pictures"
    from miles_k3.trainer.inputs import load_run_inputs

    inputs = load_run_inputs(rc, tmp_path, weights="skip")
    assert len(inputs.train[0].images) == 1 and inputs.media is not None
    assert resolve(composed(*overrides(vl))).raw["lora"]["projector"] is False
    with pytest.raises(ValueError, match=r"^lora\.projector: LoRA on the vision projector is not built yet") as e:
        resolve(composed(*overrides(vl), "lora.projector=true"))
    assert "\n" not in str(e.value)


def test_image_runs_through_miles_train_agree_over_tp2_sp_and_pp2(vl, tmp_path):
    """The real CLI on the image dataset, one rank, TP=2 with SP (the splice before the scatter) and PP=2 with
    several micro-batches (the first stage splices): the same first step, and the engine's log-probs are the
    trainer's at every step."""
    import os

    flags = [*overrides(vl), "trainer.deterministic=true", "cluster.threads_per_worker=1"]
    runs = {}
    for name, layout in (
        ("one", []),
        ("sp", ["parallel=tp2", "parallel.sp=true", "cluster.num_workers=2"]),
        ("pp2", ["parallel=pp2", "parallel.micro_batch_tokens=64", "cluster.num_workers=2"]),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "miles_k3.cli.train", *flags, *layout, f"hydra.run.dir={tmp_path / name}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "WANDB_SILENT": "true"},
        )
        assert out.returncode == 0, (name, out.stderr[-3000:])
        runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    one = runs["one"]
    assert one[0]["grad_norm"] > 0
    for name, got in runs.items():
        assert [r["step"] for r in got] == [1, 2], name
        assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in got), name
        assert got[0]["reward_mean"] == one[0]["reward_mean"], name
        assert got[0]["loss"] == pytest.approx(one[0]["loss"], abs=1e-5), name
        assert got[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-4), name
