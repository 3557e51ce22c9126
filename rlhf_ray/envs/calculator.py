"""The bundled tool task: word problems (demo/word-problems) with a calculator. The policy may write
`<calc>expression</calc>`; the environment evaluates it (numbers, + - * / and parentheses only) and returns the
result as a tool message; an answer without a call is final and scores 1 if its last number is the ground truth."""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

from rlhf_ray.data.answers import last_number
from rlhf_ray.envs.base import Environment, Step

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
INSTRUCTION = ("Use the calculator for the arithmetic: reply with only <calc>EXPRESSION</calc>, for example "
               "<calc>12 + 7</calc>, and you will get the result. Then end with: The answer is N.")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION = 64


def calculate(expression: str) -> Fraction:
    """The value of an arithmetic expression, or ValueError saying what is not allowed."""
    text = expression.strip().replace("x", "*").replace("×", "*")
    if not text or len(text) > MAX_EXPRESSION:
        raise ValueError(f"an expression of 1 to {MAX_EXPRESSION} characters is expected")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise ValueError(f"cannot read {expression.strip()!r}") from None

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"only numbers, + - * / and parentheses are allowed in {expression.strip()!r}")

    return value(tree)


def show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


class CalculatorEnv(Environment):
    def __init__(self, max_calls: int = 3):
        self.max_calls, self.calls, self.truth = max_calls, 0, None

    def reset(self, sample: dict) -> list[dict[str, str]]:
        self.calls, self.truth = 0, Fraction(str(sample["answer"]))
        question = sample["prompt"].strip().removeprefix("Human:").removesuffix("Assistant:").strip()
        return [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}]

    def step(self, answer: str) -> Step:
        call = CALL.search(answer)
        if call is None:
            correct = last_number(answer) == self.truth
            return Step(reward=float(correct), done=True, info={"correct": correct})
        self.calls += 1
        if self.calls > self.max_calls:
            return Step(done=True, tool_call=True, info={"correct": False})
        try:
            return Step(observation=show(calculate(call.group(1))), tool_call=True, valid_call=True)
        except ValueError as exc:
            return Step(observation=f"error: {exc}", tool_call=True)
