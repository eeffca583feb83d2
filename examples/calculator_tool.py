"""A multi-turn tool-use environment: the arithmetic task with a calculator the policy may call.

The policy sees the problem (`<bos>90-1=`) and may answer at once (`89<eos>`), or call the calculator by
writing a space: the environment evaluates the problem and appends the result (`89`) to the sequence as
masked tokens (read by the model, no loss), and the policy continues to its answer (`<eos>`, or more text).
Whatever the policy wrote before the call stays in the sequence and carries loss. The reward
(`reward.fn=arithmetic`) scores the last integer of the whole response, tool output included, so calling the
tool and stopping right after it is a correct answer: RL can learn to use the tool.

    PYTHONPATH=examples miles-train recipe=k3_grpo rollout.fn=calculator_tool:rollout

The rollout plugin's contract: `miles_k3.trainer.rollout_plugin`.
"""

from __future__ import annotations

import ast

from miles_k3.data import PromptRecord
from miles_k3.data.sample import Sample
from miles_k3.trainer.rollout_plugin import PolicyClient

CALL = " "  # the policy's tool call (a token the pretrained tiny model already writes)


def calculate(expression: str) -> int | None:
    """The calculator: integers with + - * (and unary minus); None for anything else."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 10**12:
                raise ValueError("too large")
            return OPS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.dump(node)}")

    try:
        return value(tree.body)
    except ValueError:
        return None


OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


async def rollout(client: PolicyClient, record: PromptRecord) -> Sample:
    sample = client.sample
    (call,) = client.encode(CALL)
    turn = await client.generate(sample.ids, stop_token_ids=[call])
    sample.add_policy(turn)
    if turn.finish_reason != "stop" or turn.output_ids[-1] != call:
        return sample  # the policy answered without the tool (<eos>) or ran out of tokens
    result = calculate(record.prompt.removesuffix("="))
    if result is not None:
        sample.add_environment(client.encode(str(result)))
    sample.add_policy(await client.generate(sample.ids))  # the answer, having read the tool's
    return sample
