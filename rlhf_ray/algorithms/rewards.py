"""Per-token rewards: a KL penalty on every answer token plus the clipped score on the last one."""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.
    k1 = log r (unbiased, can be negative), k2 = (log r)^2 / 2, k3 = r' - 1 - log r' with r' = ref / policy
    (unbiased and non-negative), where log r = logp - ref_logp."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def last_action_index(action_mask: torch.Tensor) -> torch.Tensor:
    """Index of each answer's last real token (its end-of-text when it has one) in [B, A] action space."""
    return (action_mask.sum(-1) - 1).clamp(min=0).long()


def shaped_rewards(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, action_mask: torch.Tensor,
                   kl_coef: float, clip_reward: float, estimator: KLEstimator = "k1",
                   ended: torch.Tensor | None = None, eos_penalty: float | None = None) -> torch.Tensor:
    """rewards[b, t] = -kl_coef * KL_t on answer tokens, plus clip(score_b, +-clip_reward) (and `eos_penalty`
    for an answer that never produced end-of-text) on the answer's last token; 0 on padding."""
    score = scores.float().clamp(-clip_reward, clip_reward)
    if eos_penalty is not None and ended is not None:
        score = score + eos_penalty * (~ended.bool()).float()
    rewards = -kl_coef * kl_estimate(logp, ref_logp, estimator) * action_mask
    last = last_action_index(action_mask)
    return rewards.scatter_add(1, last.unsqueeze(1), score.unsqueeze(1) * (action_mask.sum(-1, keepdim=True) > 0))
