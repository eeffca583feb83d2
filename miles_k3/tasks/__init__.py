"""Synthetic verifiable tasks: generators, tokenizers and answer checkers for the embedded tiny K3."""

from miles_k3.tasks.arithmetic import (HELDOUT_MODULUS, ArithmeticProblem, ArithmeticTokenizer, check_answer,
                                       final_integer, make_problems, split_of, write_jsonl)
from miles_k3.tasks.worked import make_step_problems, worked_solution

__all__ = ["HELDOUT_MODULUS", "ArithmeticProblem", "ArithmeticTokenizer", "check_answer", "final_integer",
           "make_problems", "make_step_problems", "split_of", "worked_solution", "write_jsonl"]
