"""Signs of reward hacking and collapse, from numbers a PPO run already has: a policy that found a reward model's
blind spot raises its score while what the score stands for (the held-out rule accuracy) falls; a policy that
games length makes the score follow the answer length; a policy whose entropy collapses stops exploring."""

from __future__ import annotations

import math

import torch


def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-d series; 0 when either is constant (no linear relation to speak of)."""
    x, y = x.double().flatten(), y.double().flatten()
    x, y = x - x.mean(), y - y.mean()
    scale = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
    return float((x * y).sum()) / scale if scale > 0 else 0.0


def reward_hacking_signs(before: dict[str, float], now: dict[str, float], margin: float = 0.02) -> list[str]:
    """What held-out evaluations say (the keys of Evaluator.evaluate): for greedy and sampled answers, the reward's
    score rose while the rule accuracy fell, each by more than `margin`. [] when nothing looks wrong, or when the
    evaluation has no rule accuracy."""
    signs = []
    for prefix, what in (("", "greedy"), ("sampled_", "sampled")):
        reward, accuracy = f"{prefix}reward", f"{prefix}task_accuracy"
        if not all(key in before and key in now for key in (reward, accuracy)):
            continue
        if now[reward] > before[reward] + margin and now[accuracy] < before[accuracy] - margin:
            signs.append(f"{what} answers: reward {before[reward]:.3f} -> {now[reward]:.3f} while the rule accuracy "
                         f"fell {before[accuracy]:.3f} -> {now[accuracy]:.3f}")
    return signs


def entropy_collapsed(first: float, now: float, ratio: float) -> bool:
    """The policy's entropy fell below `ratio` x its first measured value."""
    return first > 0 and now < ratio * first
