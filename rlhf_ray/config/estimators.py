"""Advantage estimators: the one table validation, the job's roles and the experience maths read. Adding one is one
entry here (or, from outside the package, an `Estimator` in your own module named as `module:name`; see
docs/extending.md). The maths lives in the function an entry names (rlhf_ray/algorithms/advantages.py's `*_estimate` for the
built-in ones); this file holds only what must be known before any model loads."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Estimator:
    """What an advantage estimator needs and reads. `function` ("module:function", or the function itself) is
    called as function(inputs: rlhf_ray.algorithms.advantages.AdvantageInputs) -> (advantages [B, A], returns
    [B, A] or None); returns are the critic's targets, so only an estimator with `critic` gives them."""

    function: str | Callable
    critic: bool = False
    """Needs a critic's values: the job gets a critic group (required in the config)."""
    groups: bool = False
    """Compares the answers to one prompt: needs n_samples_per_prompt >= 2; dynamic sampling applies."""
    teacher: bool = False
    """Needs a teacher's log-probs of the sampled tokens (the job's `teacher` section)."""
    policy_logprobs: bool = False
    """Reads the policy's old log-probs itself, so they are computed at experience time even where the training
    forward could have served them."""
    reads: frozenset[str] = field(default_factory=frozenset)
    """The estimator-specific ppo options (OPTIONS) it reads; setting another one is refused."""
    summary: str = ""
    """One line for errors and docs."""


OPTIONS: dict[str, str] = {
    "whiten_advantages": "grpo normalises within each prompt's group and reinforce_pp always whitens over the batch",
    "lam": "lambda weighs the critic's temporal differences",
    "gamma": "grpo and rloo score whole answers, with nothing to discount",
    "clip_value": "it clips the critic's value loss",
    "critic_warmup": "only an estimator with a critic has one to warm up",
}
"""ppo options that only some estimators read, with why the others do not: a value other than the default under an
estimator that does not read it is refused, not ignored. `whiten_advantages` is applied after the estimator's
function, by the experience step."""

_ADV = "rlhf_ray.algorithms.advantages:"
ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(_ADV + "gae_estimate", critic=True,
                     reads=frozenset({"whiten_advantages", "lam", "gamma", "clip_value", "critic_warmup"}),
                     summary="generalised advantage estimation with a critic (PPO as in InstructGPT)"),
    "grpo": Estimator(_ADV + "grpo_estimate", groups=True,
                      summary="each answer's score against its group's mean, over the group's std"),
    "rloo": Estimator(_ADV + "rloo_estimate", groups=True, reads=frozenset({"whiten_advantages"}),
                      summary="each answer's score against the mean of the other answers to its prompt"),
    "reinforce_pp": Estimator(_ADV + "reinforce_pp_estimate", reads=frozenset({"gamma"}),
                              summary="discounted reward-to-go, whitened over the batch (REINFORCE++)"),
    "distill": Estimator(_ADV + "distill_estimate", teacher=True, policy_logprobs=True,
                         summary="on-policy distillation: the teacher's log-prob of each token minus the policy's"),
}
"""The built-in estimators by name (`ppo.advantage_estimator`)."""


def estimator(name: str) -> Estimator:
    """The estimator `name` names: a built-in one, or `module:attribute` holding an Estimator. A ValueError says
    what there is."""
    if name in ESTIMATORS:
        return ESTIMATORS[name]
    module, _, attribute = name.partition(":")
    if not attribute:
        raise ValueError(f"unknown advantage estimator {name!r}: use one of {', '.join(ESTIMATORS)}, or "
                         "'package.module:name' naming an rlhf_ray.config.estimators.Estimator")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import the advantage estimator {name!r}: {exc}") from None
    if not isinstance(found, Estimator):
        raise ValueError(f"{name} is a {type(found).__name__}, not an rlhf_ray.config.estimators.Estimator "
                         "(wrap the function: Estimator(function, groups=..., critic=...))")
    return found


def readers(option: str) -> list[str]:
    """The built-in estimators that read an estimator-specific option."""
    return sorted(n for n, e in ESTIMATORS.items() if option in e.reads)
