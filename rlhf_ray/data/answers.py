"""Checking answers of verifiable tasks against a ground truth: the final number, the last `\\boxed{}`, or an exact
match after normalisation. Pure string functions, and reward functions built on them that take the ground truth
as the dataset column `answer` (`reward.function: rlhf_ray.data.answers:last_number_reward`). They live beside
the generated tasks whose rules they are."""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?![.\d]*\.\d)")
"""A number on its own: "1,234", "-3.5", "3/4"; not part of a word ("x2"), nor of a dotted version ("3.10.2")."""
_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u00a0": " "})


def number_value(text: str) -> Fraction | None:
    """The exact value of a number written as "1,234", "-3.50", "+7", "3/4" (None if it is not one)."""
    text = text.strip().translate(_MINUS).replace(",", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> Fraction | None:
    """The last number in a text ("59 + 63 = 122." -> 122; "costs $1,200.50 in total" -> 1200.5), or None."""
    found = _NUMBER.findall(text.translate(_MINUS))
    return number_value(found[-1]) if found else None


def boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced: "\\boxed{\\frac{1}{2}}" ->
    "\\frac{1}{2}". None when there is none or it is never closed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None


def normalize(text: str) -> str:
    """Lower case, single spaces, no surrounding quotes, `$`, `\\text{}` or final period: "  The Answer: Paris. "
    -> "the answer: paris"."""
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text.translate(_MINUS))
    text = " ".join(text.lower().split())
    return text.strip(" \"'`$.")


def same_answer(answer: str, truth: str) -> bool:
    """Equal as numbers when both are numbers ("3.50" == "3.5", "1,000" == "1000"), else after `normalize`."""
    a, b = number_value(answer.strip(" $.%")), number_value(str(truth).strip(" $.%"))
    if a is not None and b is not None:
        return a == b
    return normalize(answer) == normalize(str(truth))


# ---- reward functions: (prompts, answers, answer=[ground truth per answer]) -> scores ------------------------------

def _check(answers: Sequence[str], truths: Sequence, extract) -> list[float]:
    if len(answers) != len(truths):
        raise ValueError(f"{len(answers)} answers but {len(truths)} ground-truth values")
    return [1.0 if _matches(extract(text), str(truth)) else 0.0 for text, truth in zip(answers, truths)]


def _matches(got: str | Fraction | None, truth: str) -> bool:
    if got is None:
        return False
    if isinstance(got, Fraction):
        want = number_value(truth.strip(" $.%"))
        return want is not None and got == want
    return same_answer(got, truth)


def last_number_reward(prompts: Sequence[str], answers: Sequence[str], answer: Sequence, **_) -> list[float]:
    """1 when the answer's last number equals the ground truth, else 0."""
    return _check(answers, answer, last_number)


def first_line_number_reward(prompts: Sequence[str], answers: Sequence[str], answer: Sequence, **_) -> list[float]:
    """1 when the last number on the answer's first non-empty line equals the ground truth, else 0: for base models,
    which answer on one line ("Answer: 12 + 7 = 19") and then go on writing the next question."""
    return _check(answers, answer, lambda text: last_number(first_line(text)))


def first_line(text: str) -> str:
    """The first line of a text that is not blank ("" when there is none)."""
    return next((line for line in text.splitlines() if line.strip()), "")


def boxed_reward(prompts: Sequence[str], answers: Sequence[str], answer: Sequence, **_) -> list[float]:
    """1 when the last `\\boxed{}` of the answer holds the ground truth, else 0."""
    return _check(answers, answer, boxed)


def exact_match_reward(prompts: Sequence[str], answers: Sequence[str], answer: Sequence, **_) -> list[float]:
    """1 when the whole answer equals the ground truth after normalisation, else 0."""
    return _check(answers, answer, lambda text: text)
