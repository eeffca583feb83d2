"""Synthetic verifiable tasks: generators, tokenizers and answer checkers for the embedded tiny K3 bases
(`arithmetic` and its `worked` solutions for the text bases; `squares`, counting coloured squares in a
picture, for the vision-language base)."""

from miles_k3.tasks.arithmetic import (
    HELDOUT_MODULUS,
    ArithmeticProblem,
    ArithmeticTokenizer,
    check_answer,
    final_integer,
    make_problems,
    split_of,
    write_jsonl,
)
from miles_k3.tasks.squares import SquaresProblem, SquaresTokenizer, check_count, count_reward, make_square_problems
from miles_k3.tasks.worked import make_step_problems, worked_solution

__all__ = [
    "HELDOUT_MODULUS",
    "ArithmeticProblem",
    "ArithmeticTokenizer",
    "SquaresProblem",
    "SquaresTokenizer",
    "check_answer",
    "check_count",
    "count_reward",
    "final_integer",
    "make_problems",
    "make_square_problems",
    "make_step_problems",
    "split_of",
    "worked_solution",
    "write_jsonl",
]
