"""Worked, step-by-step solutions of the arithmetic task: the long, partly predictable responses that the
embedded ``k3-tiny-steps`` base is pretrained on (a target worth speculating on).

``347+586=`` -> ``7+6=13 4+8+1=13 3+5+1=9 347+586=933``: one step per column, units first, each step the
column's digits, the carry into it (from the second column on) and the column's sum; then the prompt again
and the answer. ``52-17=`` -> ``12-7=5 5-1-1=3 52-17=35``: a column that has to borrow writes its top digit
plus ten (``12``), the next column subtracts the borrow. A negative result restates the problem swapped first
and works that one: ``23-58=`` -> ``58-23 8-3=5 5-2-0=3 23-58=-35``. A shorter operand's missing digits are 0.

The answer is always the response's last integer, so the ``arithmetic`` reward (`check_answer`) scores a
worked response unchanged. Most tokens are predictable from what came before (the separators, the carry or
borrow term that the previous step's result fixes, the digits and the prompt copied again at the end): what
a drafter can win on. Only characters of `ArithmeticTokenizer`'s vocabulary occur.

The problems are `make_problems`' (the same generator and the same hash split, so a problem is held out
here exactly when it is held out in the arithmetic task) with the mix below; `write_jsonl` writes them.
"""

from __future__ import annotations

from miles_k3.tasks.arithmetic import ArithmeticProblem, make_problems

# The problem mix: 3-digit operands, + and -: responses of 31-44 characters (one token each), 37 on average;
# the final answer is right only when all three column steps are. One fixed layout (every prompt is
# "abc+def=") keeps the digit look-ups simple enough for a 2M-parameter model to learn on a CPU.
DIGITS = (3, 3)
OPS = ("+", "-")
# The longest response over the mix: "199-900=" -> "900-199 10-9=1 10-9-1=0 9-1-1=7 199-900=-701" (a swap,
# two borrows, the restated problem), 44 characters (tests/tasks/test_worked.py checks it on a sample);
# generation budgets add the eos.
MAX_RESPONSE_TOKENS = 44


def _digit(x: int, i: int) -> int:
    """The i-th decimal digit of x >= 0, counting from the units (0 past its length)."""
    return x // 10**i % 10


def _columns(x: int) -> int:
    return len(str(x))


def _addition_steps(a: int, b: int) -> list[str]:
    steps, carry = [], 0
    for i in range(max(_columns(a), _columns(b))):
        x, y = _digit(a, i), _digit(b, i)
        s = x + y + carry
        steps.append(f"{x}+{y}={s}" if i == 0 else f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return steps


def _subtraction_steps(a: int, b: int) -> list[str]:
    """Columns of a - b for a >= b >= 0."""
    steps, borrow = [], 0
    for i in range(_columns(a)):
        x, y = _digit(a, i), _digit(b, i)
        d, top = x - y - borrow, x
        if d < 0:
            d, top = d + 10, x + 10
        steps.append(f"{top}-{y}={d}" if i == 0 else f"{top}-{y}-{borrow}={d}")
        borrow = int(top > x)
    return steps


def worked_steps(problem: ArithmeticProblem) -> list[str]:
    """The response's parts before the restated problem (joined by single spaces in `worked_solution`).
    ValueError for an operator without a worked form (``*``)."""
    a, b, op = problem.a, problem.b, problem.op
    if op == "+":
        return _addition_steps(a, b)
    if op == "-":
        return _subtraction_steps(a, b) if a >= b else [f"{b}-{a}", *_subtraction_steps(b, a)]
    raise ValueError(f"op: worked solutions cover '+' and '-', got {op!r}")


def worked_solution(problem: ArithmeticProblem) -> str:
    """The worked response to ``problem.prompt``; its last integer is ``problem.answer``."""
    return " ".join([*worked_steps(problem), f"{problem.prompt}{problem.answer}"])


def kind(problem: ArithmeticProblem) -> str:
    """Problem kind by what makes its worked solution hard: a carry or a borrow in any column (a chain of them
    starts where a column's own digits overflow), a negative result (the swapped restatement)."""
    a, b, op = problem.a, problem.b, problem.op
    cols = range(max(_columns(a), _columns(b)))
    if op == "+":
        return "a+b, carry" if any(_digit(a, i) + _digit(b, i) >= 10 for i in cols) else "a+b, no carry"
    if a < b:
        return "a-b < 0"
    return "a-b >= 0, borrow" if any(_digit(a, i) < _digit(b, i) for i in cols) else "a-b >= 0, no borrow"


def make_step_problems(n: int, seed: int, *, split: str = "train") -> list[ArithmeticProblem]:
    """``n`` distinct problems of ``split`` in this task's mix (`DIGITS`, `OPS`), via `make_problems`."""
    return make_problems(n, seed, digits=DIGITS, ops=OPS, split=split)
