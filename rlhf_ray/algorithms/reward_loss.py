"""Reward-model losses on a batch of (chosen, rejected) pairs; scores are read at each sequence's last real token."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_ray.algorithms.masked import last_token_index


def end_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values [B, T] read at the last position whose mask is 1 (works for left and right padding)."""
    last = last_token_index(attention_mask)
    return values.gather(-1, last.unsqueeze(-1)).squeeze(-1)


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected), averaged over pairs (logsigmoid: stable for large margins)."""
    return -F.logsigmoid(chosen - rejected).mean()


def divergence_window_loss(chosen_values: torch.Tensor, rejected_values: torch.Tensor, chosen_ids: torch.Tensor,
                           rejected_ids: torch.Tensor, chosen_mask: torch.Tensor,
                           rejected_mask: torch.Tensor) -> torch.Tensor:
    """DeepSpeed-Chat's per-token variant: for each pair, mean over positions [d, e) of -log sigmoid(c_t - r_t),
    where d is the first position at which the two sequences differ and e the end of the longer one; then the
    mean over pairs. Identical pairs compare only their last position (loss log 2)."""
    losses = []
    for c_val, r_val, c_ids, r_ids, c_m, r_m in zip(chosen_values, rejected_values, chosen_ids, rejected_ids,
                                                    chosen_mask, rejected_mask):
        end = int(max(c_m.sum(), r_m.sum()))
        differ = (c_ids != r_ids).nonzero()
        start = int(differ[0]) if len(differ) else end - 1
        losses.append(-F.logsigmoid(c_val[start:end] - r_val[start:end]).mean())
    return torch.stack(losses).mean()
