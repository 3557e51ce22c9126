"""Direct preference optimisation losses on sequence log-probs (sums over each answer's tokens) of the policy and
the frozen reference, for a batch of (chosen, rejected) pairs. Variants: DPO (sigmoid), conservative DPO (sigmoid
with label smoothing: the preference label is wrong with probability eps) and IPO (squared, on per-token means, as
TRL computes it), and the pair layout the DPO learner and its reference score (jobs/dpo_job.py runs them)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from rlhf_ray.algorithms.batch import RolloutBatch
from rlhf_ray.algorithms.experience import pack_rollouts

DPOLossType = Literal["sigmoid", "ipo"]


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float, loss_type: DPOLossType = "sigmoid",
             label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None, rpo_alpha: float = 0.0
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean loss over the pairs and the metrics DPO users watch. With h = (chosen - ref_chosen) - (rejected -
    ref_rejected):
    sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (eps = label_smoothing; 0 is DPO)
    ipo:     (h' - 1 / (2 beta))^2, h' the same difference with each log-ratio divided by its answer's token count
    rpo_alpha > 0 adds rpo_alpha x the chosen answers' negative log-likelihood per token (RPO, TRL's `rpo_alpha`):
    the preference is learned while the chosen answers stay likely.
    Implicit rewards: beta x (policy - reference) log-prob of each answer; `accuracy` is the share of pairs whose
    chosen answer gets the larger one, `margin` the mean difference."""
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        h = chosen_ratio - rejected_ratio
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss needs each answer's token count (chosen_tokens, rejected_tokens)")
        h = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}: use sigmoid or ipo")
    loss = losses.mean()
    extra = {}
    if rpo_alpha:
        if chosen_tokens is None:
            raise ValueError("rpo_alpha needs each chosen answer's token count (chosen_tokens)")
        nll = -chosen_logps.sum() / chosen_tokens.sum().clamp(min=1)
        loss = loss + rpo_alpha * nll
        extra["nll_loss"] = nll.detach()
    chosen_reward, rejected_reward = (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()
    metrics = {"rewards/chosen": chosen_reward.mean(), "rewards/rejected": rejected_reward.mean(),
               "rewards/margin": (chosen_reward - rejected_reward).mean(),
               "rewards/accuracy": (chosen_reward > rejected_reward).float().mean(),
               "logps/chosen": chosen_logps.detach().mean(), "logps/rejected": rejected_logps.detach().mean(), **extra}
    return loss, metrics


def pack_pairs(pairs: list[dict], pad_id: int) -> RolloutBatch:
    """2B rows in the rollout layout (pack_rollouts: left-padded prompt, right-padded answer): the B chosen answers
    first, then the B rejected ones, each after the pair's shared prompt (`prompt_len` tokens of either sequence)."""
    prompts = [p["chosen_ids"][: p["prompt_len"]] for p in pairs]
    answers = ([p["chosen_ids"][p["prompt_len"]:] for p in pairs] +
               [p["rejected_ids"][p["prompt_len"]:] for p in pairs])
    return pack_rollouts(prompts + prompts, answers, pad_id)


def pair_sequence_logps(token_logps: torch.Tensor, action_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-pair sums of answer-token log-probs [B] and answer lengths [B], from [2B, A] tensors laid out by
    pack_pairs (chosen rows, then rejected rows)."""
    sums, counts = (token_logps * action_mask).sum(-1), action_mask.sum(-1)
    n = sums.shape[0] // 2
    return {"chosen": sums[:n], "rejected": sums[n:], "chosen_tokens": counts[:n], "rejected_tokens": counts[n:]}
