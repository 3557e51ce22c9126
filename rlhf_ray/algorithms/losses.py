"""Training losses: next-token cross-entropy (SFT, PPO's pretraining mix) and the PPO losses, token-mean over the
answer tokens of a batch unless the policy loss is told another aggregation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_ray.config.ppo import LossAggregation
from rlhf_ray.algorithms.masked import masked_mean, zero_masked
from rlhf_ray.data.tokenized import IGNORE_INDEX


@dataclass(frozen=True)
class PolicyLoss:
    """The policy's PPO loss, as `ppo.*` sets it: the clip range (`clip_ratio`, and `clip_ratio_high` for a higher
    upper bound), the dual clip, how token losses are averaged, the truncated importance-sampling cap, and the KL
    term in the loss (its coefficient, 0 where the KL is in the reward instead) with its estimator."""

    clip_ratio: float = 0.2
    dual_clip: float | None = None
    clip_ratio_high: float | None = None
    aggregation: LossAggregation = "token_mean"
    tis_cap: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy: position t predicts labels[t + 1]; labels of -100 carry no loss. `logits`
    may cover only the last positions of the sequence (see `first_predicting_column`); they are aligned with the
    labels' last columns. Callers divide by the loss-carrying tokens of the whole global batch, not per
    micro-batch."""
    labels = labels[:, labels.shape[1] - logits.shape[1]:]
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum")


def loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss in `lm_loss_sum`: labels after the one-position shift, excluding -100."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def first_predicting_column(labels: torch.Tensor) -> int:
    """The first column whose logits predict a label (the column before the earliest label of any row): logits
    left of it carry no loss, so a model may skip the vocabulary projection there (SFT: the prompt)."""
    carries = (labels[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero()
    return int(carries[0]) if len(carries) else labels.shape[1] - 1


def loss_units(action_mask: torch.Tensor, aggregation: LossAggregation = "token_mean") -> float:
    """What a batch's loss is averaged over: its answer tokens (token_mean) or its answers (the sequence means)."""
    if aggregation == "token_mean":
        return float(action_mask.sum())
    return float((action_mask.sum(-1) > 0).sum())


def aggregated_sum(per_token: torch.Tensor, action_mask: torch.Tensor,
                   aggregation: LossAggregation = "token_mean") -> torch.Tensor:
    """The sum whose division by `loss_units` is the batch loss: token_mean, sum over every answer token (each
    token weighs the same, so long answers weigh more: DeepSpeed-Chat, DAPO); seq_mean_token_mean, sum over answers
    of each answer's token mean (each answer weighs the same: GRPO as published); seq_mean_token_sum, sum over
    answers of each answer's token sum (Dr. GRPO's unbiased form up to a constant). Split over micro-batches and
    ranks, the sums add up and the units are counted over the whole mini-batch."""
    per_token = zero_masked(per_token, action_mask) * action_mask
    if aggregation == "seq_mean_token_mean":
        return (per_token.sum(-1) / action_mask.sum(-1).clamp(min=1)).sum()
    if aggregation in ("token_mean", "seq_mean_token_sum"):
        return per_token.sum()
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def aggregate(per_token: torch.Tensor, action_mask: torch.Tensor,
              aggregation: LossAggregation = "token_mean") -> torch.Tensor:
    """The batch loss under `aggregation` (0 for a batch without answer tokens)."""
    return aggregated_sum(per_token, action_mask, aggregation) / max(loss_units(action_mask, aggregation), 1.0)


def policy_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      action_mask: torch.Tensor, clip_ratio: float, dual_clip: float | None = None,
                      clip_ratio_high: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), eps_low = clip_ratio and
    eps_high = clip_ratio_high (DAPO's clip-higher: a larger upper bound lets unlikely tokens with A > 0 grow,
    against entropy collapse) or clip_ratio; with dual clip c, the loss of a token with A < 0 is also capped at
    -c A (a very large ratio on a bad token no longer dominates). 0 on padding."""
    log_ratio = zero_masked(logp - old_logp, action_mask)  # padding: ratio 1, never exp of garbage
    ratio = torch.exp(log_ratio)
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio, 1 + high)
    loss = torch.max(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    stats = {"clip_fraction": masked_mean((clipped > unclipped).float(), action_mask),
             "approx_kl": masked_mean(0.5 * log_ratio**2, action_mask)}
    return zero_masked(loss, action_mask), stats


def truncated_is_weights(learner_logp: torch.Tensor, engine_logp: torch.Tensor, action_mask: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Truncated importance sampling per token: min(pi_learner / pi_engine, cap), the correction for answers sampled
    by an engine whose distribution differs from the learner's (lower precision, other kernels, stale weights in
    async mode). No gradient flows through it; 0 on padding."""
    ratio = torch.exp(zero_masked(learner_logp - engine_logp, action_mask)).clamp(max=cap)
    return (ratio * action_mask).detach()


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, action_mask: torch.Tensor,
                clip_ratio: float, dual_clip: float | None = None, clip_ratio_high: float | None = None,
                aggregation: LossAggregation = "token_mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch's policy loss: policy_token_loss aggregated by `aggregation`."""
    loss, stats = policy_token_loss(logp, old_logp, advantages, action_mask, clip_ratio, dual_clip, clip_ratio_high)
    return aggregate(loss, action_mask, aggregation), stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor,
               clip_value: float) -> torch.Tensor:
    """0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2), token-mean (DeepSpeed-Chat's critic loss)."""
    clipped = old_values + (values - old_values).clamp(-clip_value, clip_value)
    loss = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, action_mask)
