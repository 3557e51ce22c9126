"""Per-token rewards: a KL penalty on every answer token plus the clipped score on the last one."""

from __future__ import annotations

from typing import Literal

import torch

from rlhf_ray.algorithms.masked import zero_masked

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k1",
                action_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.
    k1 = log r (unbiased, can be negative), k2 = (log r)^2 / 2, k3 = r' - 1 - log r' with r' = ref / policy
    (unbiased and non-negative), where log r = logp - ref_logp. With `action_mask`, 0 off the answer tokens
    (masked before k3's exponential)."""
    log_ratio = logp - ref_logp
    if action_mask is not None:
        log_ratio = zero_masked(log_ratio, action_mask)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def last_action_index(action_mask: torch.Tensor) -> torch.Tensor:
    """Index of each answer's last real token (its end-of-text when it has one) in [B, A] action space; with a
    multi-turn mask (observation tokens 0 between the policy's turns) the last token of the last turn. 0 for a row
    without any."""
    taken = action_mask.ne(0)
    last = action_mask.shape[-1] - 1 - taken.flip(-1).int().argmax(-1)
    return torch.where(taken.any(-1), last, torch.zeros_like(last)).long()


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment per answer: 0 up to `max_length - buffer` tokens, then falling linearly to
    -penalty at `max_length` (and staying there beyond it)."""
    over = (lengths.float() - (max_length - buffer)).clamp(min=0)
    return -penalty * (over / buffer).clamp(max=1.0)


def sequence_scores(scores: torch.Tensor, clip_reward: float, ended: torch.Tensor | None = None,
                    eos_penalty: float | None = None, dtype: torch.dtype = torch.float32,
                    bonus: torch.Tensor | None = None) -> torch.Tensor:
    """clip(score_b, +-clip_reward), plus `eos_penalty` for an answer that never produced end-of-text (cut at
    max_new_tokens), plus `bonus` (other per-answer terms, e.g. overlong_penalty): what every estimator rewards an
    answer with, before any KL term. The penalties come after the clip, so a clipped score still feels them."""
    score = scores.to(dtype).clamp(-clip_reward, clip_reward)
    if eos_penalty is not None and ended is not None:
        score = score + eos_penalty * (~ended.bool()).to(dtype)
    if bonus is not None:
        score = score + bonus.to(dtype)
    return score


def shaped_rewards(scores: torch.Tensor, logp: torch.Tensor | None, ref_logp: torch.Tensor | None,
                   action_mask: torch.Tensor, kl_coef: float, clip_reward: float, estimator: KLEstimator = "k1",
                   ended: torch.Tensor | None = None, eos_penalty: float | None = None,
                   bonus: torch.Tensor | None = None) -> torch.Tensor:
    """rewards[b, t] = -kl_coef * KL_t on answer tokens, plus the answer's sequence_scores (clipped score,
    `eos_penalty` for an answer that never produced end-of-text, `bonus`) on its last token; 0 on padding. With
    kl_coef 0 the log-probs are not read (and may be None)."""
    if kl_coef:
        rewards = -kl_coef * kl_estimate(logp, ref_logp, estimator, action_mask) * action_mask
    else:
        rewards = torch.zeros(action_mask.shape, dtype=torch.float32 if logp is None else logp.dtype)
    score = sequence_scores(scores, clip_reward, ended, eos_penalty, rewards.dtype, bonus)
    last = last_action_index(action_mask)
    return rewards.scatter_add(1, last.unsqueeze(1), score.unsqueeze(1) * (action_mask.sum(-1, keepdim=True) > 0))
