"""The embedded visual task: how many squares of one colour does a small generated image hold?

``<|kimi_image_placeholder|>How many red squares?`` over a 56x56 picture of 1-6 red, green or blue squares
on a black background -> ``2``. Two choices make it learnable by a tiny base in minutes on a CPU (the first
version, 8-pixel squares anywhere in 4 muted colours on white, left it at the majority count):

- the picture is a 4 x 4 grid of 14-pixel cells, the tiny tower's patches, and each square sits inside one
  cell (at a random offset), never across two: a patch sees a whole square or none;
- pure red, green and blue on black light one channel each, so after normalization (black -> 0) two colours
  are orthogonal patch vectors and a square's colour is not confused with its offset. A least-squares
  probe reads each merged token's per-colour square counts from the random-init tower's features with
  R^2 0.95 here, against 0.41-0.65 for the muted colours on white (where the shared "not white" component
  dominates and a 2-pixel shift moves a patch as far as a change of colour).

The parts, each usable alone (as in `miles_k3.tasks.arithmetic`):

- a seeded generator (`make_square_problems`) with a hash split: a problem is held out by a pure function of
  its picture and question (`split_of`), so train and held-out sets never share one, whatever the seed;
- the picture itself (`SquaresProblem.image`, `png`), drawn from the problem's fields alone;
- a character tokenizer (`SquaresTokenizer`) for the prompts, answers and the XTML media blocks, within the
  tiny model's 512 ids, with ``<|media_pad|>`` = 3;
- a jsonl writer whose rows `miles_k3.data.load_prompts` reads with its default keys (images as PNG files
  beside the jsonl, or inline data URLs);
- the reward: exact count, the response's last integer (`count_reward`, `check_count`).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from miles_k3.data.media import IMAGE_PLACEHOLDER, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, encode_data_url
from miles_k3.tasks.arithmetic import BOS_ID, EOS_ID, PAD_ID, check_answer, decodable_ids

# Token ids are frozen once a tiny base is trained on them: only ever append.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", MEDIA_PAD, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END)
SYMBOLS = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;?!'-()\n"
MEDIA_PAD_ID = 3  # the k3-tiny-vl preset's media_placeholder_token_id

# Named colours the questions use; a picture uses 2 or 3 of them. Each lights one channel of the black
# background, so the colours are orthogonal in pixel space (see the module docstring).
COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}
BACKGROUND = (0, 0, 0)
IMAGE_SIZE = 56  # pixels on a side: 4 x 4 patches of 14
CELL = 14  # the grid a square is placed in: the tiny tower's patch size, so no square straddles two patches
SQUARE_SIDE = 10  # pixels on a square's side: a 1..3 pixel offset in its cell, the rest of the cell background
GAP = 2  # the least background between two squares (so none touch and each counts once)
MAX_SQUARES = 6
# One problem in HELDOUT_MODULUS is held out; a constant for the reason arithmetic.HELDOUT_MODULUS is.
HELDOUT_MODULUS = 10
SPLITS = ("train", "heldout")


class SquaresTokenizer:
    """Character tokenizer: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2 (the tiny presets' ids), the media tokens
    ``<|media_pad|>`` 3, ``<|media_begin|>`` 4, ``<|media_content|>`` 5, ``<|media_end|>`` 6, then one id per
    character of `SYMBOLS` (7..80). It implements the trainer's Tokenizer protocol (`encode_prompt`,
    `encode`, `decode`, `eos_token_id`).

    The media tokens encode from their text (an expanded prompt, `miles_k3.data.media.expand_media_prompt`);
    an unexpanded ``<|kimi_image_placeholder|>`` is an error (it is a placeholder for a whole block, not a
    token). Ids at or above `vocab_size` (valid model outputs, never in data) decode to U+FFFD.
    """

    pad_token_id = PAD_ID
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    media_pad_token_id = MEDIA_PAD_ID

    def __init__(self) -> None:
        self.vocab: tuple[str, ...] = SPECIAL_TOKENS + tuple(SYMBOLS)
        self._chars = {ch: i for i, ch in enumerate(self.vocab) if i >= len(SPECIAL_TOKENS)}
        self._media = {tok: self.vocab.index(tok) for tok in SPECIAL_TOKENS[3:]}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of ``text``: a media token's text is one id, every other character one id. ValueError naming
        the position of an unexpanded image placeholder or of a character outside the vocabulary."""
        ids, pos = [], 0
        while pos < len(text):
            if text.startswith("<|", pos):
                if text.startswith(IMAGE_PLACEHOLDER, pos):
                    raise ValueError(
                        f"unexpanded image placeholder at position {pos}: expand the prompt with "
                        "miles_k3.data.media.expand_media_prompt before tokenizing"
                    )
                tok = next((t for t in self._media if text.startswith(t, pos)), None)
                if tok is not None:
                    ids.append(self._media[tok])
                    pos += len(tok)
                    continue
            ch = text[pos]
            if ch not in self._chars:
                raise ValueError(f"character {ch!r} at position {pos} is not in the squares vocabulary")
            ids.append(self._chars[ch])
            pos += 1
        return ([self.bos_token_id] if add_bos else []) + ids + ([self.eos_token_id] if add_eos else [])

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt: ``<bos>`` then `encode`."""
        return self.encode(text, add_bos=True)

    def decode(self, ids: Iterable[Any], skip_special_tokens: bool = True, *, errors: str = "replace") -> str:
        """Text up to the first ``<eos>``, without ``<pad>`` / ``<bos>``; media tokens are dropped
        (``skip_special_tokens``) or written as their text. Ids >= vocab_size: U+FFFD, or ValueError with
        ``errors="strict"``; negative or non-integer ids always raise."""
        out = []
        for i in decodable_ids(ids, self.vocab_size, "squares", errors):
            if i is None:
                out.append("\ufffd")
            elif i >= len(SPECIAL_TOKENS) or not skip_special_tokens:
                out.append(self.vocab[i])
        return "".join(out)


@dataclass(frozen=True)
class SquaresProblem:
    """A picture and its question. ``squares``: (x, y, colour) of each square's top-left corner, in drawing
    order; ``target``: the colour asked about; ``size`` / ``side``: the picture's and a square's side in
    pixels. Everything the picture shows follows from these fields."""

    squares: tuple[tuple[int, int, str], ...]
    target: str
    size: int = IMAGE_SIZE
    side: int = SQUARE_SIDE

    @property
    def prompt(self) -> str:
        """The question with its image placeholder (one image: `image`)."""
        return f"{IMAGE_PLACEHOLDER}How many {self.target} squares?"

    @property
    def answer(self) -> int:
        return sum(1 for _, _, c in self.squares if c == self.target)

    @property
    def key(self) -> str:
        """A canonical text of the problem (drawing order does not change the picture)."""
        cells = ";".join(f"{x},{y},{c}" for x, y, c in sorted(self.squares))
        return f"{self.size}/{self.side}/{cells}/{self.target}"

    @property
    def split(self) -> str:
        return split_of(self)

    def image(self):
        """The picture: an RGB PIL image, ``size`` x ``size``, black with the squares filled in."""
        from PIL import Image

        img = Image.new("RGB", (self.size, self.size), BACKGROUND)
        for x, y, c in self.squares:
            img.paste(COLORS[c], (x, y, x + self.side, y + self.side))
        return img

    def png(self) -> bytes:
        """The picture as PNG bytes (lossless: the processor sees exactly the drawn pixels)."""
        buf = io.BytesIO()
        self.image().save(buf, format="PNG")
        return buf.getvalue()


def split_of(problem: SquaresProblem) -> str:
    """``"heldout"`` for one problem in `HELDOUT_MODULUS`, else ``"train"``: sha256 of `SquaresProblem.key`,
    so the same picture with the same question always falls on the same side."""
    digest = hashlib.sha256(problem.key.encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0 else "train"


def make_square_problems(
    n: int,
    seed: int,
    *,
    split: str = "train",
    size: int = IMAGE_SIZE,
    side: int = SQUARE_SIDE,
    max_squares: int = MAX_SQUARES,
) -> list[SquaresProblem]:
    """``n`` distinct problems of ``split``, a deterministic function of the arguments.

    Each draws 2 or 3 colours of `COLORS` and 1..max_squares squares, each of one of those colours, in
    distinct cells of the picture's `CELL`-pixel grid, at a uniform offset inside its cell that keeps `GAP`
    pixels of background to any neighbour; it asks about one of the drawn colours (so the answer is
    0..max_squares). Draws outside ``split`` are rejected (`split_of`). ValueError for bad arguments.
    """
    for name, v, lo in (("n", n, 0), ("size", size, 1), ("side", side, 1), ("max_squares", max_squares, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}: must be an int >= {lo}, got {v!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: must be an int, got {seed!r}")
    if split not in SPLITS:
        raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
    if size % CELL:
        raise ValueError(f"size: must be a multiple of the {CELL} px cell, got {size}")
    if side + GAP > CELL:
        raise ValueError(f"side: a {side} px square and {GAP} px of gap do not fit a {CELL} px cell")
    if (size // CELL) ** 2 < max_squares:
        raise ValueError(
            f"max_squares: {max_squares} squares cannot fit the {(size // CELL) ** 2} cells of a {size} px picture"
        )
    digest = hashlib.sha256(f"miles_k3.squares:{seed}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "little"))
    seen: set[str] = set()
    out: list[SquaresProblem] = []
    for _ in range(200 * n + 10_000):
        if len(out) == n:
            break
        p = _draw(rng, size, side, max_squares)
        if p.key in seen or split_of(p) != split:
            continue
        seen.add(p.key)
        out.append(p)
    if len(out) < n:
        raise ValueError(f"n: could draw only {len(out)} distinct {split} problems; lower n")
    return out


def _draw(rng: random.Random, size: int, side: int, max_squares: int) -> SquaresProblem:
    colors = rng.sample(sorted(COLORS), rng.choice((2, 3)))
    per_row = size // CELL
    # Half the gap on each side of a square inside its cell: neighbours in adjacent cells keep GAP between them.
    lo, hi = GAP // 2, CELL - side - (GAP - GAP // 2)
    squares = []
    for cell in rng.sample(range(per_row * per_row), rng.randint(1, max_squares)):
        x = cell % per_row * CELL + rng.randint(lo, hi)
        y = cell // per_row * CELL + rng.randint(lo, hi)
        squares.append((x, y, rng.choice(colors)))
    return SquaresProblem(tuple(squares), rng.choice(colors), size, side)


def write_jsonl(problems: Iterable[SquaresProblem], path: str | Path, *, inline: bool = False) -> int:
    """One ``{"prompt", "label", "images", "metadata": {"target", "squares"}}`` row per problem (the keys
    `miles_k3.data.PromptDataConfig` reads by default). Images are PNG files in ``<path's dir>/images/``
    named by the problem's hash (``images`` lists the relative path), or inline data URLs (``inline``).
    Creates directories; returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            png = p.png()
            if inline:
                image = encode_data_url(png, "image/png")
            else:
                image = f"images/{hashlib.sha256(p.key.encode()).hexdigest()[:16]}.png"
                (path.parent / "images").mkdir(exist_ok=True)
                (path.parent / image).write_bytes(png)
            row = {
                "prompt": p.prompt,
                "label": p.answer,
                "images": [image],
                "metadata": {"target": p.target, "squares": [list(s) for s in p.squares]},
            }
            f.write(json.dumps(row) + "\n")
            count += 1
    return count


def check_count(response: str, label: Any) -> bool:
    """True iff the response's last integer is the count ``label`` (the arithmetic task's rule:
    `miles_k3.tasks.arithmetic.check_answer`; a malformed label raises)."""
    return check_answer(response, label)


def count_reward(sample: Any) -> float:
    """The task's reward: 1.0 for the exact count, else 0.0 (``reward.fn:
    miles_k3.tasks.squares:count_reward``)."""
    return 1.0 if check_count(sample.response, sample.label) else 0.0
