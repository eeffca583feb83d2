"""exact_match and arithmetic on tricky inputs; a missing or malformed label is a failure, not a zero."""

import pytest

from miles_k3.rewards import RewardConfig, Sample, arithmetic, exact_match, score
from miles_k3.tasks.arithmetic import check_answer


def s(response, label):
    return Sample(prompt="q", response=response, label=label)


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("Paris", "Paris", 1.0),
        ("  paris\n", "PARIS", 1.0),
        ("Paris.", "Paris", 1.0),
        ("New   York", "new york", 1.0),
        ("ＡＢＣ", "abc", 1.0),  # NFKC folds full-width letters
        ("Straße", "STRASSE", 1.0),  # casefold, not lower
        ("42", 42, 1.0),
        ("4.5", 4.5, 1.0),
        ("Paris is the capital", "Paris", 0.0),
        ("Paris..", "Paris", 0.0),  # one trailing period only
        ("", "Paris", 0.0),
        ("Lyon", ["Paris", "Lyon"], 1.0),
        ("Nice", ["Paris", "Lyon"], 0.0),
    ],
)
def test_exact_match(response, label, expected):
    assert exact_match(s(response, label)) == expected


@pytest.mark.parametrize("label", [None, [], {"a": 1}, True, [None]])
def test_exact_match_bad_label_raises(label):
    with pytest.raises(ValueError, match="exact_match"):
        exact_match(s("x", label))


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("42", 42, 1.0),
        ("The answer is 42", "42", 1.0),
        ("12 + 30 = 42", 42, 1.0),
        ("= 42.", 42, 1.0),  # a final period is not a decimal point
        ("42\n", " 42 ", 1.0),
        ("0042", 42, 1.0),
        ("42", 42.0, 1.0),  # an integral float label, as read back from parquet
        ("7 - 24 = -17", -17, 1.0),
        ("12-5", 5, 1.0),  # an operator, not a sign
        ("41 or 42", 41, 0.0),  # the last integer counts
        ("42 apples, 3 pears", 42, 0.0),
        ("3.5", 3, 0.0),  # a decimal is not an integer
        ("42.0", 42, 0.0),
        ("no digits here", 0, 0.0),
        ("", 0, 0.0),
        ("+42", 42, 1.0),
    ],
)
def test_arithmetic_is_the_tasks_checker(response, label, expected):
    assert arithmetic(s(response, label)) == expected == float(check_answer(response, label))


@pytest.mark.parametrize("label", [None, True, 4.5, "4.0", "four", "", [4]])
def test_arithmetic_bad_label_raises(label):
    with pytest.raises(ValueError, match="label: must be an integer"):
        arithmetic(s("4", label))


def test_builtin_label_errors_go_through_the_policy():
    result = score([s("4", 4), s("4", None)], RewardConfig(fn="arithmetic", on_failure="drop"))
    assert result.keep.tolist() == [True, False] and result.failure_counts["exception"] == 1
