"""Advantage estimators. GAE needs a critic; GRPO, RLOO and REINFORCE++ use only rewards; distillation a teacher.
Each is an entry of rlhf_ray/config/estimators.py naming its `*_estimate` function below, which takes one
AdvantageInputs record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlhf_ray.algorithms.masked import masked_whiten, zero_masked
from rlhf_ray.config.estimators import Estimator
from rlhf_ray.functions import load_function


def gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over answer tokens [B, A]. Rewards and values of unmasked positions are
    zeroed first and the value after the last token is 0, so nothing leaks from padding into real tokens (the
    bug DeepSpeed-Chat fixed in #620). The recursion runs over the masked-in tokens only: a span masked out between
    them (a multi-turn episode's observation tokens) is skipped, so a policy token's next state is the next policy
    token, and the result equals GAE over the policy tokens laid end to end. Returns (advantages,
    returns = advantages + values), both masked."""
    rewards, values = rewards * action_mask, values * action_mask
    taken = action_mask.bool()
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(running)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(taken[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(taken[:, t], values[:, t], next_value)
        advantages[:, t] = running
    return advantages * action_mask, (advantages + values) * action_mask


def discounted_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go of each answer token (REINFORCE), over the masked-in tokens only (as `gae`)."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    taken = action_mask.bool()
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(taken[:, t], rewards[:, t] * action_mask[:, t] + gamma * running, running)
        out[:, t] = running * action_mask[:, t]
    return out


def group_normalized(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (score - group mean) / (group std + eps) for consecutive groups of samples of one prompt."""
    grouped = scores.float().view(-1, group_size)
    mean, std = grouped.mean(-1, keepdim=True), grouped.std(-1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def leave_one_out(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: score minus the mean of the other samples of the same prompt."""
    grouped = scores.float().view(-1, group_size)
    baseline = (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).view(-1)


def broadcast_to_tokens(per_sample: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """A sequence-level advantage on every answer token."""
    return per_sample.unsqueeze(-1) * action_mask


def reinforce_pp(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++: reward-to-go of the KL-shaped token rewards, whitened over the whole batch."""
    return masked_whiten(discounted_returns(rewards, action_mask, gamma), action_mask)


def informative_groups_first(scores: torch.Tensor, group_size: int, groups: int,
                             fill: bool = True) -> tuple[list[int], int]:
    """Rows of up to `groups` groups (consecutive `group_size` rows answering one prompt) of a rollout: first the
    groups whose scores differ (their advantages are not all zero), in order, then, with `fill`, equal ones up to
    `groups` (without it, one equal group only when none differs: never an empty batch). Returns (sorted row
    indices, how many of the chosen groups differ)."""
    by_group = scores.float().reshape(-1, group_size)
    differ = (by_group.max(-1).values > by_group.min(-1).values).tolist()
    informative = [g for g, d in enumerate(differ) if d]
    equal = [g for g, d in enumerate(differ) if not d]
    fillers = max(0, groups - len(informative)) if fill else int(not informative)
    chosen = sorted(informative[:groups] + equal[:fillers])
    return [g * group_size + i for g in chosen for i in range(group_size)], min(len(informative), groups)


def distill_advantages(teacher_logp: torch.Tensor, logp: torch.Tensor, action_mask: torch.Tensor,
                       kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """On-policy distillation: each sampled token's advantage is log p_teacher(token) - log p_policy(token), the
    negated per-token sample of the reverse KL(policy || teacher), with no discounting (a token is credited with its
    own mismatch only), less a KL-to-reference penalty where the reward carries one."""
    advantages = teacher_logp - logp
    if kl_penalty is not None:
        advantages = advantages - kl_penalty
    return zero_masked(advantages, action_mask)


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read, for one batch of B answers of at most A tokens (rlhf_ray.algorithms.experience
    builds it). Per-token tensors are [B, A] and zero outside `action_mask`."""

    rewards: torch.Tensor
    """The shaped reward of each token: the KL penalty on every token (in-reward KL), the answer's score (clipped,
    with the end-of-sequence and overlong penalties) on its last."""
    sequence_rewards: torch.Tensor
    """[B] each answer's score (clipped, with the penalties) less the sum of its tokens' KL penalty."""
    action_mask: torch.Tensor
    group_size: int
    """Answers per prompt; rows of one prompt are consecutive."""
    gamma: float
    lam: float
    values: torch.Tensor | None = None
    """The critic's values (estimators with `critic`)."""
    logp: torch.Tensor | None = None
    """The policy's old log-probs (None where the training forward supplies them: estimators that read them say
    `policy_logprobs`)."""
    teacher_logp: torch.Tensor | None = None
    """The teacher's log-prob of each sampled token (estimators with `teacher`)."""
    kl_penalty: torch.Tensor | None = None
    """Each token's KL penalty (kl_coef x the KL estimate) where the reward carries one."""


Estimate = tuple[torch.Tensor, "torch.Tensor | None"]


def estimate(estimator: Estimator, inputs: AdvantageInputs) -> Estimate:
    """(advantages [B, A], returns [B, A] or None) by `estimator`'s function, masked."""
    function: Callable[[AdvantageInputs], Estimate] = (
        load_function(estimator.function) if isinstance(estimator.function, str) else estimator.function)
    advantages, returns = function(inputs)
    if advantages.shape != inputs.action_mask.shape:
        raise ValueError(f"advantage estimator {getattr(function, '__qualname__', function)} returned advantages of "
                         f"shape {tuple(advantages.shape)} for answers of shape {tuple(inputs.action_mask.shape)}")
    return zero_masked(advantages, inputs.action_mask), returns


def gae_estimate(x: AdvantageInputs) -> Estimate:
    if x.values is None:
        raise ValueError("gae needs the critic's values")
    return gae(x.rewards, x.values, x.action_mask, x.gamma, x.lam)


def grpo_estimate(x: AdvantageInputs) -> Estimate:
    return broadcast_to_tokens(group_normalized(x.sequence_rewards, x.group_size), x.action_mask), None


def rloo_estimate(x: AdvantageInputs) -> Estimate:
    return broadcast_to_tokens(leave_one_out(x.sequence_rewards, x.group_size), x.action_mask), None


def reinforce_pp_estimate(x: AdvantageInputs) -> Estimate:
    return reinforce_pp(x.rewards, x.action_mask, x.gamma), None


def distill_estimate(x: AdvantageInputs) -> Estimate:
    if x.teacher_logp is None or x.logp is None:
        raise ValueError("distillation needs the teacher's and the policy's log-probs of the sampled tokens")
    return distill_advantages(x.teacher_logp, x.logp, x.action_mask, x.kl_penalty), None
