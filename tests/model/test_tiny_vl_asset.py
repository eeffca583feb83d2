"""The shipped tiny vision-language K3 base (`miles_k3/assets/k3-tiny-vl-squares`, made by
`scripts/train_tiny_base.py --task squares`).

Catches a silently broken asset: a checkpoint whose text or vision half no longer loads, processor settings
that no longer give a 56x56 picture its 4 pads, prompt files the data loader rejects or that leak held-out
pictures into training, a config that stops naming its tokenizer, weights whose greedy accuracy moved
away from what the README records, and a base that no longer looks at its picture. Everything is read the
way `miles-train` reads it (the data loader's image refs, the checkpoint's own processor, the trainer's
tokenizer selection), then decoded greedily here with the features spliced in at the pads.
"""

import re
from pathlib import Path

import pytest
import torch

import miles_k3
from miles_k3.data import PromptDataConfig, load_prompts
from miles_k3.data.image_processor import ImageProcessor
from miles_k3.data.media import expand_media_prompt, media_pad_positions
from miles_k3.data.tokenizers import load_tokenizer
from miles_k3.model import K3ForCausalLM
from miles_k3.model.generate import greedy_generate
from miles_k3.model.modeling import MediaEmbeds
from miles_k3.model.vision import K3VisionModel
from miles_k3.tasks import SquaresProblem, SquaresTokenizer, check_count
from miles_k3.tasks.squares import split_of

ASSET = Path(miles_k3.__file__).parent / "assets" / "k3-tiny-vl-squares"
FIRST_N = 64
TOLERANCE = 0.15
MAX_NEW_TOKENS = 4  # the recipe's rollout.max_new_tokens


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return (
        K3ForCausalLM.from_pretrained(ASSET).eval(),
        K3VisionModel.from_pretrained(ASSET).eval(),
        ImageProcessor.from_pretrained(ASSET),
    )


def _records(name: str):
    return load_prompts(PromptDataConfig(path=str(ASSET / name), shuffle=False))


def _problem(record) -> SquaresProblem:
    meta = record.metadata["metadata"]
    return SquaresProblem(tuple(tuple(s) for s in meta["squares"]), meta["target"])


def _readme_value(key: str) -> float:
    m = re.search(rf"^{re.escape(key)}: ([0-9.]+)$", (ASSET / "README.md").read_text(), re.MULTILINE)
    assert m, f"{ASSET / 'README.md'} has no '{key}: <value>' line"
    return float(m.group(1))


def test_files_present_and_small():
    for name in (
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "train.jsonl",
        "heldout.jsonl",
        "README.md",
    ):
        assert (ASSET / name).is_file(), f"{name} missing from {ASSET}"
    total = sum(f.stat().st_size for f in ASSET.iterdir())
    assert total < 10e6, f"{ASSET} is {total / 1e6:.1f} MB: the asset ships in the package"
    assert not (ASSET / "images").exists()  # pictures are inline: the folder is self-contained


def test_checkpoint_is_a_k3_vision_language_model(base):
    text, vision, processor = base
    c = text.config
    assert c.vision_config is not None and vision.config == c.vision_config
    assert c.media_placeholder_token_id == SquaresTokenizer.media_pad_token_id
    assert {"kda", "mla"} <= set(c.layer_kinds) and c.moe_latent_size is not None and c.hidden_act == "situ"
    assert c.vocab_size >= SquaresTokenizer().vocab_size
    # the processor is the checkpoint's own: a 56x56 picture is 4 x 4 patches, 4 pads after the 2 x 2 merge
    assert processor.num_tokens(56, 56) == 4


def test_the_trainer_picks_the_squares_tokenizer_from_the_config():
    tok = load_tokenizer("arithmetic", str(ASSET))
    assert isinstance(tok.task_tokenizer, SquaresTokenizer)
    assert tok.encode_prompt("How many red squares?")[0] == SquaresTokenizer.bos_token_id


@pytest.mark.parametrize("name, split", [("train.jsonl", "train"), ("heldout.jsonl", "heldout")])
def test_prompt_files_load_with_inline_pictures(name, split):
    records = _records(name)
    assert len(records) >= (1000 if split == "train" else FIRST_N)
    for r in records[:50]:
        (image,) = r.images
        assert image.is_data_url
        p = _problem(r)
        assert r.prompt == p.prompt and r.label == p.answer and split_of(p) == split
        assert image.load() == p.png()  # the inline picture is the one the metadata describes


def test_train_and_heldout_are_disjoint():
    train = {_problem(r).key for r in _records("train.jsonl")}
    heldout = [_problem(r).key for r in _records("heldout.jsonl")]
    assert len(set(heldout)) == len(heldout) and not train & set(heldout)


@torch.no_grad()
def _greedy(text, vision, prompt_ids: torch.Tensor, images) -> list[list[int]]:
    """Equal-length prompts [B, T], one image each: prefill with the features at the pads, then greedy."""
    features = vision.encode(
        torch.cat([im.pixel_values for im in images]), torch.tensor([im.grid_thw for im in images])
    )
    t = prompt_ids.shape[1]
    pad_id = text.config.media_placeholder_token_id
    positions = torch.tensor(
        [
            b * t + i
            for b, row in enumerate(prompt_ids.tolist())
            for run in media_pad_positions(row, images[b : b + 1], pad_id)
            for i in run
        ]
    )
    return greedy_generate(text, prompt_ids, MAX_NEW_TOKENS, media=MediaEmbeds(positions, features))[0].tolist()


def _greedy_accuracy(base, records, pictures) -> float:
    """Greedy exact-count accuracy on ``records``, row i shown ``pictures[i]`` (processed by the asset's own
    processor), prompts batched by length."""
    text, vision, processor = base
    tok = load_tokenizer("arithmetic", str(ASSET))
    by_len: dict[int, list] = {}
    for r, picture in zip(records, pictures):
        image = processor.process(picture)
        ids = tok.encode_prompt(expand_media_prompt(r.prompt, [image]))
        by_len.setdefault(len(ids), []).append((r, ids, image))
    correct = []
    for rows in by_len.values():
        new = _greedy(text, vision, torch.tensor([ids for _, ids, _ in rows]), [im for _, _, im in rows])
        correct += [check_count(tok.decode(n), r.label) for (r, _, _), n in zip(rows, new)]
    return sum(correct) / len(correct)


@pytest.fixture(scope="module")
def first_heldout():
    return _records("heldout.jsonl")[:FIRST_N]


@pytest.fixture(scope="module")
def heldout_accuracy(base, first_heldout):
    return _greedy_accuracy(base, first_heldout, [r.images[0].load() for r in first_heldout])


def test_heldout_accuracy_matches_the_readme(heldout_accuracy):
    expected = _readme_value(f"heldout_accuracy_first{FIRST_N}")
    assert abs(heldout_accuracy - expected) <= TOLERANCE, (
        f"greedy accuracy {heldout_accuracy:.3f} on the first {FIRST_N}, README {expected}"
    )


def test_the_base_sees_the_picture(base, first_heldout, heldout_accuracy):
    # Above always answering the most common training count, by a clear margin, on the same held-out rows...
    labels = [r.label for r in _records("train.jsonl")]
    majority = max(set(labels), key=labels.count)
    chance = sum(r.label == majority for r in first_heldout) / len(first_heldout)
    assert heldout_accuracy >= chance + 0.15, f"greedy {heldout_accuracy:.3f}, majority count {chance:.3f}"
    # ... and because of the picture: the same questions, row i shown row i+1's picture, score far lower. A
    # base that ignores its picture scores the same either way.
    order = list(range(1, len(first_heldout))) + [0]
    shuffled = _greedy_accuracy(base, first_heldout, [first_heldout[i].images[0].load() for i in order])
    assert heldout_accuracy >= shuffled + 0.15, f"greedy {heldout_accuracy:.3f}, other pictures {shuffled:.3f}"
    # the README's own record of the whole held-out file agrees
    assert _readme_value("heldout_accuracy") >= _readme_value("heldout_majority_count_accuracy") + 0.15
