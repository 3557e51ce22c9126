"""Advantage estimators. GAE needs a critic; GRPO, RLOO and REINFORCE++ use only rewards."""

from __future__ import annotations

import torch

from rlhf_ray.algorithms.masked import masked_whiten


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
