"""Worked solutions (`miles_k3.tasks.worked`, the k3-tiny-steps task): the formatter against hand-worked
examples, every step's arithmetic, the answer as the last integer (so the `arithmetic` reward scores it),
the length bound, and the problem mix's split."""

import re

import pytest

from miles_k3.rewards import Sample, arithmetic
from miles_k3.tasks import (
    ArithmeticProblem,
    ArithmeticTokenizer,
    check_answer,
    final_integer,
    make_step_problems,
    split_of,
    worked_solution,
)
from miles_k3.tasks.worked import DIGITS, MAX_RESPONSE_TOKENS, OPS, kind

TOK = ArithmeticTokenizer()
P = ArithmeticProblem


@pytest.mark.parametrize(
    "problem, text",
    [
        (P(347, 586, "+"), "7+6=13 4+8+1=13 3+5+1=9 347+586=933"),
        (P(999, 999, "+"), "9+9=18 9+9+1=19 9+9+1=19 999+999=1998"),  # the last column's carry leads the answer
        (P(120, 314, "+"), "0+4=4 2+1+0=3 1+3+0=4 120+314=434"),
        (P(347, 86, "+"), "7+6=13 4+8+1=13 3+0+1=4 347+86=433"),  # a shorter operand's missing digits are 0
        (P(52, 17, "-"), "12-7=5 5-1-1=3 52-17=35"),  # a borrowing column writes its top digit plus ten
        (P(305, 298, "-"), "15-8=7 10-9-1=0 3-2-1=0 305-298=7"),  # leading zeros drop from the answer
        (P(500, 500, "-"), "0-0=0 0-0-0=0 5-5-0=0 500-500=0"),
        (P(23, 58, "-"), "58-23 8-3=5 5-2-0=3 23-58=-35"),  # negative: the swapped problem is worked
        (P(199, 900, "-"), "900-199 10-9=1 10-9-1=0 9-1-1=7 199-900=-701"),
    ],
)
def test_formatter_matches_hand_worked_examples(problem, text):
    assert worked_solution(problem) == text


def test_multiplication_has_no_worked_form():
    with pytest.raises(ValueError, match="op"):
        worked_solution(P(12, 3, "*"))


def _sample(n=3000, seed=7):
    return make_step_problems(n, seed) + make_step_problems(n // 9, seed, split="heldout")


def test_every_step_is_right_and_the_answer_is_the_last_integer():
    for p in _sample():
        text = worked_solution(p)
        steps = text.split(" ")
        assert steps[-1] == f"{p.prompt}{p.answer}"
        for step in steps[:-1]:
            if "=" not in step:  # the swapped restatement of a negative result
                assert p.op == "-" and p.a < p.b and step == f"{p.b}-{p.a}"
                continue
            lhs, rhs = step.split("=")
            assert re.fullmatch(r"\d+([+-]\d){1,2}", lhs), step
            assert eval(lhs) == int(rhs), step  # noqa: S307 (digits and +/- only, checked above)
        assert final_integer(text) == p.answer and check_answer(text, p.answer)


def test_the_arithmetic_reward_scores_a_worked_response_unchanged():
    p = P(347, 586, "+")
    right = worked_solution(p)
    assert arithmetic(Sample(prompt=p.prompt, response=right, label=p.answer)) == 1.0
    # every step right but the final answer wrong, and the reverse: only the final answer counts
    wrong_final = right[: -len(str(p.answer))] + str(p.answer + 1)
    assert arithmetic(Sample(prompt=p.prompt, response=wrong_final, label=p.answer)) == 0.0
    wrong_step = right.replace("4+8+1=13", "4+8+1=12")
    assert arithmetic(Sample(prompt=p.prompt, response=wrong_step, label=p.answer)) == 1.0
    q = P(23, 58, "-")
    assert check_answer(worked_solution(q), -35) and not check_answer(worked_solution(q), 35)


def test_responses_are_long_tokenizable_and_bounded():
    lengths = []
    for p in _sample():
        text = worked_solution(p)
        ids = TOK.encode(text, add_eos=True)  # only the frozen vocabulary's characters
        assert TOK.decode(ids) == text
        lengths.append(len(text))
    assert max(lengths) <= MAX_RESPONSE_TOKENS and min(lengths) >= 25
    assert len(worked_solution(P(199, 900, "-"))) == MAX_RESPONSE_TOKENS  # the bound is reached
    assert 30 <= sum(lengths) / len(lengths) <= 45


def test_problems_follow_the_mix_and_the_arithmetic_split():
    train, heldout = make_step_problems(2000, 0), make_step_problems(300, 0, split="heldout")
    assert make_step_problems(2000, 0) == train  # deterministic in the seed
    assert not {p.prompt for p in train} & {p.prompt for p in heldout}
    for problems, split in ((train, "train"), (heldout, "heldout")):
        assert all(split_of(p.a, p.op, p.b) == split for p in problems)
        assert all(p.op in OPS and all(DIGITS[0] <= len(str(x)) <= DIGITS[1] for x in (p.a, p.b)) for p in problems)
    kinds = {kind(p) for p in train}
    assert kinds == {"a+b, carry", "a+b, no carry", "a-b < 0", "a-b >= 0, borrow", "a-b >= 0, no borrow"}


@pytest.mark.parametrize(
    "problem, want",
    [
        (P(347, 586, "+"), "a+b, carry"),
        (P(120, 314, "+"), "a+b, no carry"),
        (P(305, 298, "-"), "a-b >= 0, borrow"),
        (P(599, 123, "-"), "a-b >= 0, no borrow"),
        (P(199, 900, "-"), "a-b < 0"),
    ],
)
def test_kind(problem, want):
    assert kind(problem) == want
