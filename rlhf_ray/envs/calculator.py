"""The bundled tool task: word problems (demo/word-problems) with a calculator. The policy may write
`<calc>expression</calc>`; the environment evaluates it (numbers, + - * / and parentheses only) and returns the
result as a tool message; an answer without a call is final and scores 1 if its last number is the ground truth.
The tool itself (syntax, instruction, evaluation) is data/calculator_tool.py."""

from __future__ import annotations

from fractions import Fraction

from rlhf_ray.data.answers import last_number
from rlhf_ray.data.calculator_tool import CALL, calculate, first_message, show
from rlhf_ray.envs.environment import Environment, Step


class CalculatorEnv(Environment):
    def __init__(self, max_calls: int = 3):
        self.max_calls, self.calls, self.truth = max_calls, 0, None

    def reset(self, sample: dict) -> list[dict[str, str]]:
        self.calls, self.truth = 0, Fraction(str(sample["answer"]))
        return [first_message(sample["prompt"])]

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
