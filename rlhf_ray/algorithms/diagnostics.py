"""Signs of reward hacking and collapse, from numbers a PPO run already has: a policy that found a reward model's
blind spot raises its score while what the score stands for (the held-out rule accuracy) falls; a policy that
games length makes the score follow the answer length; a policy whose entropy collapses stops exploring."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-d series; 0 when either is constant (no linear relation to speak of)."""
    x, y = x.double().flatten(), y.double().flatten()
    x, y = x - x.mean(), y - y.mean()
    scale = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
    return float((x * y).sum()) / scale if scale > 0 else 0.0


@dataclass(frozen=True)
class Parting:
    """Held-out evaluations in which the reward rose and the check fell from each one to the next: `answers`
    ("greedy" or "sampled"), the iterations of those evaluations (the first is where the two parted: the last one
    before the check began to fall), and the reward's and the check's value at each."""

    answers: str
    steps: tuple[int, ...]
    reward: tuple[float, ...]
    check: tuple[float, ...]

    @property
    def parted_at(self) -> int:
        return self.steps[0]

    def describe(self) -> str:
        join = lambda values: " -> ".join(f"{v:.3f}" for v in values)  # noqa: E731
        return (f"{self.answers} answers: at iterations {', '.join(map(str, self.steps))} the reward went "
                f"{join(self.reward)} while the held-out check went {join(self.check)}")


def reward_hacking_signs(series: Mapping[str, Sequence[tuple[int, float, float]]], evaluations: int,
                         margin: float = 0.02) -> list[Parting]:
    """What the held-out evaluations so far say (`series`: for each way of answering, "greedy" or "sampled", the
    (iteration, reward, check) of every evaluation that had a check, oldest first): the reward rose by more than
    `margin` and the check fell by more than `margin` at each of the last `evaluations` evaluations, against the one
    before it. The run of such evaluations is followed back as far as it goes, so `parted_at` is where the two began
    to part. [] when nothing looks wrong."""
    signs = []
    for what, points in series.items():
        run = 0
        while run + 1 < len(points):
            (_, r0, c0), (_, r1, c1) = points[-run - 2], points[-run - 1]
            if not (r1 > r0 + margin and c1 < c0 - margin):
                break
            run += 1
        if evaluations > 0 and run >= evaluations:
            kept = points[-run - 1:]
            signs.append(Parting(what, *(tuple(column) for column in zip(*kept))))
    return signs


def entropy_collapsed(first: float, now: float, ratio: float) -> bool:
    """The policy's entropy fell below `ratio` x its first measured value."""
    return first > 0 and now < ratio * first
