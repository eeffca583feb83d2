"""The synthetic verifiable task behind the embedded tiny K3: integer arithmetic like ``12+345=`` -> ``357``.

Four parts, each usable alone: a character tokenizer with a frozen vocabulary, a deterministic problem
generator with a hash-based train / held-out split, a jsonl writer whose records `miles_k3.data` loads with
its default keys, and the answer checker the ``arithmetic`` reward plugin calls.
"""

from __future__ import annotations

import hashlib
import json
import operator
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

# Token ids are frozen: the shipped tiny checkpoint was trained on them. Only ever append.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the k3-tiny presets' ids, shared by every embedded character tokenizer
SYMBOLS = "0123456789+-*= "
OPS = ("+", "-", "*")
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_COMMUTATIVE = ("+", "*")

# One problem in HELDOUT_MODULUS is held out. A constant, not a parameter: a configurable ratio would let two
# runs disagree about which problems are held out, and train on each other's evaluation set.
HELDOUT_MODULUS = 10
SPLITS = ("train", "heldout")


def decodable_ids(ids: Iterable[Any], vocab_size: int, vocabulary: str, errors: str = "replace"):
    """The ids a character tokenizer's `decode` renders (`PAD_ID`, `BOS_ID`, `EOS_ID`): up to the
    first ``<eos>``, skipping ``<pad>`` and ``<bos>``, None for an id >= vocab_size (``errors="replace"``;
    ValueError naming it and the `vocabulary` with ``errors="strict"``). Negative or non-integer ids always
    raise ValueError."""
    if errors not in ("replace", "strict"):
        raise ValueError(f"errors: must be 'replace' or 'strict', got {errors!r}")
    for pos, x in enumerate(ids):
        try:
            i = operator.index(x)
        except TypeError:
            raise ValueError(f"token {x!r} at position {pos} is not an integer id") from None
        if i < 0:
            raise ValueError(f"token id {i} at position {pos} is negative")
        if i == EOS_ID:
            return
        if i in (PAD_ID, BOS_ID):
            continue
        if i >= vocab_size:
            if errors == "strict":
                raise ValueError(
                    f"token id {i} at position {pos} is outside the {vocabulary} vocabulary (size {vocab_size})"
                )
            yield None
        else:
            yield i


class ArithmeticTokenizer:
    """Character-level tokenizer: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2 (the k3-tiny preset's ids), then one
    id per character of ``"0123456789+-*= "`` (ids 3..17).

    The vocabulary (18) is smaller than the model's (k3-tiny: 512): ids at or above ``vocab_size`` are valid
    model outputs that never occur in training data. ``decode`` renders them as U+FFFD by default so an
    untrained sample scores as wrong instead of crashing the rollout; ``errors="strict"`` raises instead.
    """

    pad_token_id = PAD_ID
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID

    def __init__(self) -> None:
        self.vocab: tuple[str, ...] = SPECIAL_TOKENS + tuple(SYMBOLS)
        self._ids = {ch: i for i, ch in enumerate(self.vocab) if i >= len(SPECIAL_TOKENS)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """One id per character. ValueError naming the first character outside the vocabulary."""
        ids = []
        for pos, ch in enumerate(text):
            if ch not in self._ids:
                raise ValueError(
                    f"character {ch!r} at position {pos} of {text!r} is not in the arithmetic vocabulary {SYMBOLS!r}"
                )
            ids.append(self._ids[ch])
        return ([self.bos_token_id] if add_bos else []) + ids + ([self.eos_token_id] if add_eos else [])

    def decode(self, ids: Iterable[Any], *, errors: str = "replace") -> str:
        """Text up to the first ``<eos>``, skipping ``<pad>`` and ``<bos>``. Accepts ints or an integer tensor.
        Ids >= vocab_size become U+FFFD (``errors="replace"``) or raise ValueError (``errors="strict"``);
        negative or non-integer ids always raise ValueError."""
        return "".join(
            "\ufffd" if i is None else self.vocab[i] for i in decodable_ids(ids, self.vocab_size, "arithmetic", errors)
        )


@dataclass(frozen=True)
class ArithmeticProblem:
    """``a op b``; ``prompt`` is what the model sees (``"12+345="``), ``answer`` the integer label."""

    a: int
    b: int
    op: str

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> int:
        return _APPLY[self.op](self.a, self.b)

    @property
    def split(self) -> str:
        return split_of(self.a, self.op, self.b)


def split_of(a: int, op: str, b: int) -> str:
    """``"heldout"`` for one problem in `HELDOUT_MODULUS`, else ``"train"``; a pure function of the problem.

    The key is sha256 of the problem text (stable across runs, machines and Python versions, unlike the
    salted built-in ``hash``), with commutative operands sorted so ``3+12`` and ``12+3`` fall on the same
    side: otherwise the model could see a held-out sum in training with its operands swapped.
    """
    if op in _COMMUTATIVE and a > b:
        a, b = b, a
    digest = hashlib.sha256(f"{a}{op}{b}".encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0 else "train"


def make_problems(
    n: int, seed: int, *, digits: tuple[int, int] = (1, 3), ops: Iterable[str] = ("+", "-"), split: str = "train"
) -> list[ArithmeticProblem]:
    """``n`` distinct problems of ``split``, a deterministic function of the arguments.

    Each operand gets a digit count uniform in ``digits`` (inclusive), then a value uniform among numbers of
    that many digits (1 digit: 0..9), so short and long problems are equally common; the operator is uniform
    in ``ops``. Draws outside ``split`` are rejected, so train and held-out sets never share a problem
    (`split_of`), whatever the seed, n, digits or ops. ValueError for bad arguments, or when the split has
    too few distinct problems to yield ``n``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n: must be a non-negative int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: must be an int, got {seed!r}")
    if split not in SPLITS:
        raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
    lo, hi = _check_digits(digits)
    ops = tuple(ops)
    if not ops or any(o not in OPS for o in ops) or len(set(ops)) != len(ops):
        raise ValueError(f"ops: must be distinct operators from {OPS}, got {ops!r}")

    digest = hashlib.sha256(f"miles_k3.arithmetic:{seed}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "little"))
    seen: set[tuple[int, str, int]] = set()
    problems: list[ArithmeticProblem] = []
    # Expected draws per kept problem are ~HELDOUT_MODULUS for heldout plus duplicates; the cap only stops
    # requests the split cannot satisfy (or could only after a very long coupon-collector tail).
    budget = 200 * n + 100_000
    for _ in range(budget):
        if len(problems) == n:
            break
        a, b, op = _operand(rng, lo, hi), _operand(rng, lo, hi), rng.choice(ops)
        if (a, op, b) in seen or split_of(a, op, b) != split:
            continue
        seen.add((a, op, b))
        problems.append(ArithmeticProblem(a, b, op))
    if len(problems) < n:
        raise ValueError(
            f"n: could draw only {len(problems)} distinct {split} problems with digits={digits} "
            f"and ops={ops} ({_space_size(lo, hi, ops)} problems in all, about 1 in "
            f"{HELDOUT_MODULUS} held out); lower n or widen digits / ops"
        )
    return problems


def _check_digits(digits: Any) -> tuple[int, int]:
    try:
        lo, hi = digits
    except (TypeError, ValueError):
        raise ValueError(f"digits: must be a (min, max) pair, got {digits!r}") from None
    if any(isinstance(d, bool) or not isinstance(d, int) for d in (lo, hi)) or not 1 <= lo <= hi:
        raise ValueError(f"digits: need ints with 1 <= min <= max, got {digits!r}")
    return lo, hi


def _operand(rng: random.Random, lo: int, hi: int) -> int:
    d = rng.randint(lo, hi)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)


def _space_size(lo: int, hi: int, ops: tuple[str, ...]) -> int:
    operands = 10**hi - (0 if lo == 1 else 10 ** (lo - 1))
    return operands * operands * len(ops)


def write_jsonl(problems: Iterable[ArithmeticProblem], path: str | Path) -> int:
    """Write one ``{"prompt", "label", "metadata": {"a", "b", "op"}}`` object a line (the keys
    `miles_k3.data.PromptDataConfig` reads by default); creates parent directories. Returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            record = {"prompt": p.prompt, "label": p.answer, "metadata": {"a": p.a, "b": p.b, "op": p.op}}
            f.write(json.dumps(record) + "\n")
            count += 1
    return count


# An integer not glued to a decimal point or another digit: in "12-5" the '-' is an operator (the final
# integer is 5), in "= -5" a sign; "357.0" holds no integer at all, "357." ends with 357.
_INT_RE = re.compile(r"(?<![\d.])-?\d+(?!\d|\.\d)")
_LABEL_RE = re.compile(r"\s*[-+]?\d+\s*")


class _TooLong(int):
    """An integer too long to parse; compares unequal to every label."""

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = int.__hash__


_TOO_LONG = _TooLong(-1)


def final_integer(response: str) -> int | None:
    """The last integer in ``response`` (see `check_answer`), or None when there is none."""
    if not isinstance(response, str):
        raise TypeError(f"response: must be a str, got {type(response).__name__}")
    matches = _INT_RE.findall(response)
    if not matches:
        return None
    # Python refuses int() of strings past 4300 digits; no label is that long, so such a response is
    # simply a wrong answer (a sentinel that equals no label), not a crashed reward.
    last = matches[-1]
    digits = last.lstrip("-").lstrip("0") or "0"
    if len(digits) > 4000:
        return _TOO_LONG
    return -int(digits) if last.startswith("-") else int(digits)


def check_answer(response: str, label: Any) -> bool:
    """True iff the last integer in the model's ``response`` equals ``label``.

    Trailing text, spaces and a final period are tolerated (``" 357 "``, ``"357 is it."``); a response
    without an integer, or ending in a decimal (``"357.0"``), is wrong. ``label`` is an int, an integral
    float, or an integer string (labels read back from jsonl or parquet); any other label is a data bug and
    raises ValueError rather than scoring zero.
    """
    want = _label_int(label)  # first, so a bad label raises even when the response holds no integer
    got = final_integer(response)
    return got is not None and got == want


def _label_int(label: Any) -> int:
    if isinstance(label, bool):
        raise ValueError(f"label: must be an integer, got {label!r}")
    if isinstance(label, int):
        return label
    if isinstance(label, float) and label.is_integer():
        return int(label)
    if isinstance(label, str) and _LABEL_RE.fullmatch(label):
        return int(label)
    raise ValueError(f"label: must be an integer, an integral float or an integer string, got {label!r}")
