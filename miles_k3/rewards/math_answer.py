"""Final-answer extraction and comparison for math responses (the `math_final_answer` built-in).

Extraction (`extract_final_answer`): the content of the last balanced \\boxed{...} (or \\fbox{...}),
nested and escaped braces handled; when there is none, the last number in the text: integers,
decimals, thousands separators (1,234,567), a leading minus (also U+2212), fractions (3/4,
\\frac{3}{4}, \\dfrac, \\frac34) and a trailing percent sign (50%, 50\\%). A "-" glued to a word
("x-5", "step-2") is a hyphen, not a sign. An unclosed \\boxed{ (a truncated response) is not a
box; the numbers in it still count as text.

Comparison (`answers_match`): both sides are parsed as exact rationals when they can be. Two
integers must be equal exactly; otherwise values within a relative 1e-6 match (0.1+0.2 == 0.3,
1/3 == 0.3333333). A percent stands for both its number and a hundredth of it (50% matches 50
and 0.5). When either side is not a number, normalized strings are compared: LaTeX spacing,
$, \\left/\\right, \\text{} wrappers, degree signs, whitespace and a trailing period removed, a
leading "x=" dropped, \\dfrac/\\tfrac read as \\frac, case folded, "(B)" read as "B".
"""

from __future__ import annotations

import math
import re
import unicodedata
from fractions import Fraction
from typing import Any

from miles_k3.data.sample import Sample

REL_TOL = 1e-6

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC_OPERAND = r"\s*-?(?:\d+(?:\.\d+)?|\.\d+)\s*"
_LAST_NUMBER = re.compile(
    # \frac{a}{b} with numeric operands, optionally negated (tried first: its digits are not separate numbers)
    rf"-?\\[dt]?frac(?:\{{{_FRAC_OPERAND}\}}\{{{_FRAC_OPERAND}\}}|\d\d)"
    # a number not glued to a word or a decimal point: -1,234.5 / 12 / 3/4 / 50% / 50\%
    r"|(?<![\w.])-?(?:\d{1,3}(?:,\d{3}(?!\d))+|\d+)(?:\.\d+)?(?:/\d+)?(?:\s?\\?%)?"
    r"|(?<![\w.])-?\.\d+(?:\s?\\?%)?"
)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![a-zA-Z])")
_SPACING = re.compile(r"\\[!,;: ]|\\quad|\\qquad")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_VAR_PREFIX = re.compile(r"^[a-zA-Z]\w*=(?!=)")
_LATEX_FRAC = re.compile(r"(-?)\\[dt]?frac(?:\{([^{}]+)\}\{([^{}]+)\}|(\d)(\d))")
_SLASH_FRAC = re.compile(r"([^/]+)/([^/]+)")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# The exponent is capped: Fraction("1e999999999") would build a billion-digit integer.
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?")


def extract_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} / \\fbox{...}, stripped; None if there is none."""
    answer = None
    for match in _BOX_OPEN.finditer(text):
        content = _balanced(text, match.end())
        if content is not None:
            answer = content
    return None if answer is None else answer.strip()


def _balanced(text: str, start: int) -> str | None:
    """text[start:end] where text[end] closes the brace opened just before start."""
    depth, i = 1, start
    while i < len(text):
        char = text[i]
        if char == "\\":  # \{ and \} are literal braces; \\ is a line break. Skip the escaped char.
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def extract_final_answer(text: str) -> str | None:
    """The boxed answer, else the last number's text; None when the response has neither."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    last = None
    for last in _LAST_NUMBER.finditer(text.replace("\u2212", "-")):
        pass
    return None if last is None else last.group(0)


def _strip_noise(answer: str) -> str:
    s = unicodedata.normalize("NFKC", answer).replace("\u2212", "-")
    s = s.replace("{,}", ",").replace("\\$", "").replace("$", "")
    s = _LEFT_RIGHT.sub("", s)
    s = _SPACING.sub("", s)
    s = _DEGREES.sub("", s)
    return s


def parse_number(answer: str) -> tuple[Fraction, ...]:
    """The values a written answer may stand for: () when it is not a number, (v,) usually,
    (v, v/100) for a percent."""
    s = _TEXT_WRAPPER.sub("", _strip_noise(answer))  # \text{...} after a number is a unit
    s = "".join(s.split()).rstrip(".")
    s = _VAR_PREFIX.sub("", s)
    percent = s.endswith("%")
    if percent:
        s = s.removesuffix("\\%") if s.endswith("\\%") else s[:-1]
    value = _to_fraction(s)
    if value is None:
        return ()
    return (value, value / 100) if percent else (value,)


def _to_fraction(s: str) -> Fraction | None:
    match = _LATEX_FRAC.fullmatch(s)
    if match:
        sign, num, den = match.group(1), match.group(2) or match.group(4), match.group(3) or match.group(5)
        value = _ratio(_plain(num), _plain(den))
        return None if value is None else (-value if sign else value)
    match = _SLASH_FRAC.fullmatch(s)
    if match:
        return _ratio(_plain(match.group(1)), _plain(match.group(2)))
    return _plain(s)


def _ratio(num: Fraction | None, den: Fraction | None) -> Fraction | None:
    return None if num is None or den is None or den == 0 else num / den


def _plain(s: str) -> Fraction | None:
    s = s.strip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if not _DECIMAL.fullmatch(s):
        return None
    try:
        return Fraction(s)
    except ValueError:  # e.g. more digits than int() accepts
        return None


def normalize_answer(answer: str) -> str:
    """The string form used when an answer is not a number."""
    s = _strip_noise(answer)
    while True:  # unwrap nested wrappers from the inside out
        unwrapped = _TEXT_WRAPPER.sub(r"\1", s)
        if unwrapped == s:
            break
        s = unwrapped
    s = "".join(s.split()).rstrip(".")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _VAR_PREFIX.sub("", s).casefold()
    letter = re.fullmatch(r"\(([a-z])\)", s)
    return letter.group(1) if letter else s


def _close(a: Fraction, b: Fraction) -> bool:
    if a == b:
        return True
    if a.denominator == 1 and b.denominator == 1:
        return False  # integers are exact: 123456789 is not 123456790
    try:
        return math.isclose(float(a), float(b), rel_tol=REL_TOL)
    except OverflowError:
        return False


def answers_match(predicted: str, reference: str) -> bool:
    """Whether two written answers agree (numerically when both are numbers, else as strings)."""
    pred_values, ref_values = parse_number(predicted), parse_number(reference)
    if pred_values and ref_values:
        return any(_close(p, r) for p in pred_values for r in ref_values)
    return normalize_answer(predicted) == normalize_answer(reference)


def _reference_answers(label: Any) -> list[str]:
    """The label as written answers. A list means any of its items is accepted."""
    if label is None:
        raise ValueError("math_final_answer needs a label (the reference answer); this sample has none")
    if isinstance(label, (list, tuple)):
        if not label:
            raise ValueError("math_final_answer: the label is an empty list of answers")
        return [answer for item in label for answer in _reference_answers(item)]
    if isinstance(label, bool):
        raise ValueError(f"math_final_answer: a bool label ({label}) is not an answer")
    if isinstance(label, int):
        return [str(label)]
    if isinstance(label, float):
        if not math.isfinite(label):
            raise ValueError(f"math_final_answer: the label is {label}")
        return [repr(label)]
    if isinstance(label, str):
        # A reference written as a solution keeps only its boxed part; a bare "1/2" is taken whole
        # (not its last number).
        boxed = extract_boxed(label)
        return [boxed if boxed is not None else label]
    raise ValueError(f"math_final_answer: unsupported label type {type(label).__name__}")


def math_final_answer(sample: Sample) -> float:
    """1.0 when the response's final answer matches the label (or any item of a list label),
    else 0.0 (also when the response has no answer at all). A missing label raises."""
    references = _reference_answers(sample.label)
    predicted = extract_final_answer(sample.response)
    if predicted is None:
        return 0.0
    return 1.0 if any(answers_match(predicted, ref) for ref in references) else 0.0
