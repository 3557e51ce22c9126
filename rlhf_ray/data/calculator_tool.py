"""The calculator tool of the bundled tool task, as pure functions: the call syntax (`<calc>expression</calc>`), the
instruction that shows it, and evaluating an expression (numbers, + - * / and parentheses only). The environment
(envs/calculator.py) plays it; demo/word-problems-calculator writes worked conversations with it."""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

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


def first_message(prompt: str) -> dict[str, str]:
    """The episode's first message: the dataset's question (its ' Human: ... Assistant:' wrapper removed) and how
    to call the calculator."""
    question = prompt.strip().removeprefix("Human:").removesuffix("Assistant:").strip()
    return {"role": "user", "content": f"{question}\n{INSTRUCTION}"}
