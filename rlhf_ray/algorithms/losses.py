"""Training losses: next-token cross-entropy (SFT, PPO's pretraining mix) and the PPO losses, token-mean over the
answer tokens of a batch."""

from __future__ import annotations

import torch

from rlhf_ray.algorithms.masked import masked_mean, zero_masked
from rlhf_ray.algorithms.rewards import KLEstimator, kl_estimate
from rlhf_ray.data.tokenized import IGNORE_INDEX


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy: position t predicts labels[t + 1]; labels of -100 carry no loss. `logits`
    may cover only the last positions of the sequence (see `first_predicting_column`); they are aligned with the
    labels' last columns. Callers divide by the loss-carrying tokens of the whole global batch, not per
    micro-batch."""
    labels = labels[:, labels.shape[1] - logits.shape[1]:]
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum")


def first_predicting_column(labels: torch.Tensor) -> int:
    """The first column whose logits predict a label (the column before the earliest label of any row): logits
    left of it carry no loss, so a model may skip the vocabulary projection there (SFT: the prompt)."""
    carries = (labels[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero()
    return int(carries[0]) if len(carries) else labels.shape[1] - 1


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, action_mask: torch.Tensor,
                clip_ratio: float, dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate: max(-A r, -A clip(r, 1-eps, 1+eps)); with dual clip c, the loss of a token with A < 0
    is also capped at -c A (a very large ratio on a bad token no longer dominates)."""
    log_ratio = zero_masked(logp - old_logp, action_mask)  # padding: ratio 1, never exp of garbage
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio, 1 + clip_ratio)
    loss = torch.max(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    stats = {"clip_fraction": masked_mean((clipped > unclipped).float(), action_mask),
             "approx_kl": masked_mean(0.5 * log_ratio**2, action_mask)}
    return masked_mean(loss, action_mask), stats


def kl_loss(logp: torch.Tensor, ref_logp: torch.Tensor, action_mask: torch.Tensor,
            estimator: KLEstimator = "k3") -> torch.Tensor:
    """Token-mean KL(policy || reference) estimate, differentiable in `logp` (the KL term of GRPO's loss)."""
    return masked_mean(kl_estimate(logp, ref_logp, estimator, action_mask), action_mask)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor,
               clip_value: float) -> torch.Tensor:
    """0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2), token-mean (DeepSpeed-Chat's critic loss)."""
    clipped = old_values + (values - old_values).clamp(-clip_value, clip_value)
    loss = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, action_mask)
