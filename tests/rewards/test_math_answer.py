"""math_final_answer: extraction, parsing and comparison on tricky inputs, plus properties."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_k3.rewards import Sample, answers_match, extract_final_answer, math_final_answer
from miles_k3.rewards.math_answer import extract_boxed, normalize_answer, parse_number


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),  # nested braces
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the box
        (r"first \boxed{1} then \boxed{2}", "2"),  # the last box
        (r"\boxed{ 7 } and then 8", "7"),  # a box beats a later number
        (r"\boxed {x}", "x"),
        (r"\fbox{3}", "3"),
        (r"\boxed{\boxed{5}}", "5"),
        (r"answer \boxed{12", "12"),  # unclosed box: its number still counts as text
        (r"\boxed{1} then \boxed{2", "1"),  # the closed one wins over an unclosed later one
        ("The total is 1,234,567 dollars.", "1,234,567"),
        ("1,2,3", "3"),  # a list, not thousands
        ("1,2345", "2345"),
        ("it is -3/4 now", "-3/4"),
        (r"then $-\frac{3}{4}$", r"-\frac{3}{4}"),
        (r"then \dfrac{5}{8}", r"\dfrac{5}{8}"),
        (r"then \frac34", r"\frac34"),
        ("about 50% of them", "50%"),
        (r"about 50\% of them", r"50\%"),
        ("x-5", "5"),
        ("step-2 gives \u22127", "-7"),
        ("value .5", ".5"),
        ("pi is 3.14.", "3.14"),
        ("version 1.2.3", "1.2"),
        ("abc123", None),
        ("no numbers", None),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_extract_boxed_none_without_a_box():
    assert extract_boxed("42") is None and extract_boxed(r"\boxed{") is None


@pytest.mark.parametrize(
    "answer, values",
    [
        ("42", [42]),
        ("-42", [-42]),
        ("+42", [42]),
        ("1,234", [1234]),
        ("1,234.5", [Fraction(24690, 20)]),
        ("1{,}234", [1234]),
        ("3/4", [Fraction(3, 4)]),
        ("-3/4", [Fraction(-3, 4)]),
        (r"\frac{3}{4}", [Fraction(3, 4)]),
        (r"-\dfrac{3}{4}", [Fraction(-3, 4)]),
        (r"\frac{-3}{4}", [Fraction(-3, 4)]),
        (r"\tfrac12", [Fraction(1, 2)]),
        ("0.75", [Fraction(3, 4)]),
        (".5", [Fraction(1, 2)]),
        ("5.", [5]),
        ("1.5e3", [1500]),
        ("50%", [50, Fraction(1, 2)]),
        (r"50\%", [50, Fraction(1, 2)]),
        ("$12", [12]),
        (r"\$12.50", [Fraction(25, 2)]),
        (r"x = 5", [5]),
        (r"90^\circ", [90]),
        (r"90^{\circ}", [90]),
        ("90°", [90]),
        (r"5\text{ cm}", [5]),
        (r"\left( 3 \right)", []),
        ("\u22127", [-7]),
        ("1/0", []),
        ("1e99999", []),  # exponent capped: not a number (no billion-digit integer)
        ("1,5", []),
        ("x", []),
        ("", []),
        ("2\\sqrt{2}", []),
    ],
)
def test_parse_number(answer, values):
    assert list(parse_number(answer)) == [Fraction(v) for v in values]


@pytest.mark.parametrize(
    "pred, ref, expected",
    [
        ("0.5", "1/2", True),
        (r"\frac{1}{2}", "0.5", True),
        (r"\dfrac{3}{4}", r"\frac{3}{4}", True),
        ("50%", "0.5", True),
        ("50", "50%", True),
        ("0.5", "50%", True),
        ("1,000", "1000", True),
        ("0.30000000000000004", "0.3", True),
        ("0.3333333", "1/3", True),
        ("0.33", "1/3", False),
        ("123456789", "123456790", False),  # integers compare exactly
        ("-5", "5", False),
        (r"x = 5", "5", True),
        (r"\text{(B)}", "B", True),
        ("(b)", "B", True),
        (r"\sqrt{2}", r"\sqrt {2}", True),
        (r"2\sqrt{2}", "2", False),
        (r"\left(1,2\right)", "(1, 2)", True),
        ("Yes.", "yes", True),
        (r"\text{\textbf{north}}", "North", True),
    ],
)
def test_answers_match(pred, ref, expected):
    assert answers_match(pred, ref) is expected


@pytest.mark.parametrize(
    "response, label, expected",
    [
        (r"... so \boxed{\frac{3}{4}}", "0.75", 1.0),
        (r"... so \boxed{0.75}", r"The answer is $\boxed{\frac34}$", 1.0),  # boxed reference solution
        ("the result is 1,234,567", 1234567, 1.0),
        ("the result is -12", -12, 1.0),
        ("the result is 12", -12, 0.0),
        ("we get 3/4", "3/4", 1.0),
        ("we get 0.75", 0.75, 1.0),
        ("a 25% rise", "0.25", 1.0),
        ("I am not sure", "7", 0.0),  # no answer: wrong, not an error
        (r"\boxed{B}", ["A", "B"], 1.0),
        (r"\boxed{C}", ["A", "B"], 0.0),
        ("1/2", "1/2", 1.0),  # the label is a whole answer, not its last number
        ("2", "1/2", 0.0),
    ],
)
def test_math_final_answer(response, label, expected):
    assert math_final_answer(Sample(prompt="q", response=response, label=label)) == expected


@pytest.mark.parametrize("label", [None, [], True, float("nan"), {"a": 1}])
def test_math_final_answer_bad_label_raises(label):
    with pytest.raises(ValueError, match="math_final_answer"):
        math_final_answer(Sample(prompt="q", response="1", label=label))


def test_normalize_answer_is_idempotent_on_examples():
    for text in [r"\text{(B)}", r"\left( 1, 2 \right)", r"x=\dfrac{1}{2}.", "  Yes "]:
        once = normalize_answer(text)
        assert normalize_answer(once) == once


FORMATS = [
    lambda n: f"The answer is {n}.",
    lambda n: f"\\boxed{{{n}}}",
    lambda n: f"so $\\boxed{{{n:,}}}$",
    lambda n: f"we get {n:,} in total",
    lambda n: f"x = {n}",
]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(-(10**12), 10**12), fmt=st.sampled_from(FORMATS), other=st.integers(-(10**12), 10**12))
def test_integers_roundtrip_in_any_format(n, fmt, other):
    sample = Sample(prompt="q", response=fmt(n), label=n)
    assert math_final_answer(sample) == 1.0
    wrong = Sample(prompt="q", response=fmt(n), label=other)
    assert math_final_answer(wrong) == float(n == other)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(num=st.integers(-999, 999), den=st.integers(1, 999))
def test_fractions_match_their_decimal_and_latex_forms(num, den):
    value = Fraction(num, den)
    sign = "-" if value < 0 else ""
    latex = f"\\boxed{{{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}}}"
    assert math_final_answer(Sample(prompt="q", response=latex, label=f"{num}/{den}")) == 1.0
    decimal = f"{float(value):.10f}"
    assert math_final_answer(Sample(prompt="q", response=f"\\boxed{{{decimal}}}", label=f"{num}/{den}")) == 1.0
