"""The squares task: tokenizer ids, seeded generation, the disjoint split, the drawn count equal to the label,
jsonl round trip through the loader, processor, expansion and tokenizer, and the reward."""

import random

import numpy as np
import pytest

from miles_k3.data import PromptDataConfig, load_prompts
from miles_k3.data.image_processor import ImageProcessor, ImageProcessorConfig
from miles_k3.data.media import expand_media_prompt, media_pad_positions
from miles_k3.model import K3Config
from miles_k3.rewards import Sample
from miles_k3.tasks.squares import (
    BACKGROUND,
    CELL,
    COLORS,
    GAP,
    HELDOUT_MODULUS,
    MEDIA_PAD_ID,
    SquaresProblem,
    SquaresTokenizer,
    _draw,
    check_count,
    count_reward,
    make_square_problems,
    split_of,
    write_jsonl,
)

TOK = SquaresTokenizer()


# --- tokenizer ---


def test_ids_are_frozen_and_fit_the_tiny_model():
    assert TOK.vocab[:7] == (
        "<pad>",
        "<bos>",
        "<eos>",
        "<|media_pad|>",
        "<|media_begin|>",
        "<|media_content|>",
        "<|media_end|>",
    )
    assert (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id, TOK.media_pad_token_id) == (0, 1, 2, 3)
    assert MEDIA_PAD_ID == 3 and TOK.encode(" a") == [7, 8] and TOK.vocab_size == 81
    tiny = K3Config.from_preset("k3-tiny-vl")
    assert TOK.vocab_size <= tiny.vocab_size and (tiny.pad_token_id, tiny.bos_token_id, tiny.eos_token_id) == (0, 1, 2)
    assert tiny.media_placeholder_token_id == TOK.media_pad_token_id  # the features land on this tokenizer's pads


def test_an_expanded_prompt_round_trips_with_one_id_per_media_token():
    text = "<|media_begin|>image 56x56<|media_content|><|media_pad|><|media_pad|><|media_end|>How many red squares?"
    ids = TOK.encode_prompt(text)
    assert ids[:2] == [1, 4] and ids.count(3) == 2 and ids[len("image 56x56") + 2] == 5
    assert TOK.decode(ids, skip_special_tokens=False) == text
    assert TOK.decode(ids) == "image 56x56How many red squares?"
    assert TOK.decode(TOK.encode("3", add_eos=True) + TOK.encode("9")) == "3"
    assert TOK.decode([TOK.encode("1")[0], 300]) == "1\ufffd"
    with pytest.raises(ValueError, match="id 300 at position 0"):
        TOK.decode([300], errors="strict")


@pytest.mark.parametrize(
    "text, match",
    [
        ("hi<|kimi_image_placeholder|>", r"unexpanded image placeholder at position 2: expand the prompt"),
        ("a+b", r"character '\+' at position 1 is not in the squares vocabulary"),
        ("<|im_start|>", r"character '<' at position 0"),
    ],
)
def test_encode_errors_name_the_position(text, match):
    with pytest.raises(ValueError, match=match):
        TOK.encode(text)


# --- generator ---


def test_generation_is_seeded():
    a = make_square_problems(50, seed=3)
    assert a == make_square_problems(50, seed=3) and a != make_square_problems(50, seed=4)
    assert len({p.key for p in a}) == 50


def test_train_and_heldout_never_share_a_problem():
    train = make_square_problems(400, seed=0)
    held = make_square_problems(60, seed=0, split="heldout")
    assert all(p.split == "train" for p in train) and all(split_of(p) == "heldout" for p in held)
    assert not {p.key for p in train} & {p.key for p in held}
    # about one in HELDOUT_MODULUS of all pictures is held out
    rng = random.Random(0)
    draws = [_draw(rng, 56, 10, 6) for _ in range(3000)]
    share = sum(split_of(p) == "heldout" for p in draws) / len(draws)
    assert 0.5 / HELDOUT_MODULUS < share < 1.5 / HELDOUT_MODULUS
    # the split ignores drawing order: the same picture is the same problem
    p = held[0]
    assert split_of(SquaresProblem(tuple(reversed(p.squares)), p.target)) == "heldout"


def _components(mask):
    """4-connected components of a boolean mask (a flood fill written for the test)."""
    seen, count = np.zeros_like(mask), 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        count += 1
        stack = [(y0, x0)]
        while stack:
            y, x = stack.pop()
            if 0 <= y < mask.shape[0] and 0 <= x < mask.shape[1] and mask[y, x] and not seen[y, x]:
                seen[y, x] = True
                stack += [(y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)]
    return count


def test_the_drawn_count_is_the_label():
    problems = make_square_problems(40, seed=1)
    for p in problems:
        px = np.asarray(p.image())
        assert px.shape == (56, 56, 3)
        for name, rgb in COLORS.items():
            mask = (px == rgb).all(-1)
            n = sum(1 for *_, c in p.squares if c == name)
            assert _components(mask) == n and mask.sum() == n * p.side**2
        assert p.answer == _components((px == COLORS[p.target]).all(-1))
        assert 1 <= len(p.squares) <= 6
        assert p.target in {c for *_, c in p.squares} or p.answer == 0
    assert {p.answer for p in make_square_problems(300, seed=2)} >= {0, 1, 2, 3}


def test_squares_keep_their_gap():
    for p in make_square_problems(60, seed=5):
        for i, (x, y, _) in enumerate(p.squares):
            for a, b, _ in p.squares[:i]:
                assert abs(x - a) >= p.side + GAP or abs(y - b) >= p.side + GAP


def test_each_square_lies_inside_one_cell_at_a_varying_offset():
    # the tower's 14-pixel patches each see a whole square or none
    offsets = set()
    for p in make_square_problems(200, seed=6):
        cells = [(x // CELL, y // CELL) for x, y, _ in p.squares]
        assert len(set(cells)) == len(cells)  # one square a cell
        for x, y, _ in p.squares:
            assert (x + p.side - 1) // CELL == x // CELL and (y + p.side - 1) // CELL == y // CELL
            offsets.add((x % CELL, y % CELL))
    assert len(offsets) > 4  # the position inside the cell is drawn, not fixed


def test_colours_light_one_channel_each_of_a_black_background():
    # orthogonal after normalization with mean 0: a square's colour is not confused with its offset
    assert BACKGROUND == (0, 0, 0)
    for rgb in COLORS.values():
        assert sorted(rgb) == [0, 0, 255]
    assert len({rgb.index(255) for rgb in COLORS.values()}) == len(COLORS)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n=-1), r"n: must be an int >= 0"),
        (dict(split="test"), r"split: must be one of"),
        (dict(seed="1"), r"seed: must be an int"),
        (dict(max_squares=50), r"max_squares: 50 squares"),
        (dict(size=50), r"size: must be a multiple of the 14 px cell"),
        (dict(side=13), r"side: a 13 px square"),
    ],
)
def test_bad_generator_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        make_square_problems(**{"n": 1, "seed": 0, **kw})


# --- through the data path ---


@pytest.mark.parametrize("inline", [False, True])
def test_rows_load_process_expand_and_tokenize(tmp_path, inline):
    problems = make_square_problems(4, seed=7)
    assert write_jsonl(problems, tmp_path / "train.jsonl", inline=inline) == 4
    records = load_prompts(PromptDataConfig(path=str(tmp_path / "train.jsonl")))
    # 56x56 at patch 14, merge 2: 4 x 4 patches, 4 tokens
    proc = ImageProcessor(
        ImageProcessorConfig(
            patch_size=14,
            merge_kernel_size=2,
            in_patch_limit=64,
            patch_limit_on_one_side=8,
            image_mean=(0.5,) * 3,
            image_std=(0.5,) * 3,
        )
    )
    for p, r in zip(problems, records):
        assert r.prompt == p.prompt and r.label == p.answer and len(r.images) == 1
        image = proc.process(r.images[0].load(), name=r.images[0].name)
        assert image.num_tokens == 4 and image.size == (56, 56)
        ids = TOK.encode_prompt(expand_media_prompt(r.prompt, [image]))
        (run,) = media_pad_positions(ids, [image], TOK.media_pad_token_id)
        # <bos> <|media_begin|> "image 56x56" (11 ids) <|media_content|>: the 4 pads sit at 14..17
        assert run == range(14, 18)
        assert image.content_hash == proc.process(p.png()).content_hash


def test_the_reward_is_the_exact_count():
    assert count_reward(Sample(prompt="q", response="3", label=3)) == 1.0
    assert count_reward(Sample(prompt="q", response="there are 3", label=3)) == 1.0
    assert count_reward(Sample(prompt="q", response="4", label=3)) == 0.0
    assert count_reward(Sample(prompt="q", response="three", label=3)) == 0.0
    assert check_count(" 0 ", 0)
    with pytest.raises(ValueError, match="label"):
        check_count("3", "many")
