"""Masked reductions: every per-token quantity of RLHF lives on answer tokens only."""

from __future__ import annotations

import torch


def zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x on answer tokens, 0 elsewhere, whatever x holds there (inf or NaN included). Apply it to a log-ratio
    before exponentiating: masking after exp turns an overflow on a padding token into NaN, in the value and in
    the gradient."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask): the token mean (DeepSpeed-Chat's reduction); 0 where the mask is empty. Values
    under the mask's zeros never reach the result, even inf or NaN."""
    x = zero_masked(x, mask) * mask
    if dim is None:
        return x.sum() / mask.sum().clamp(min=1)
    return x.sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over masked entries (unbiased variance); masked-out entries come back as 0."""
    mean = masked_mean(x, mask)
    var = ((x - mean) ** 2 * mask).sum() / (mask.sum() - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row, for right, left or both-sided padding: lengths and ends come
    from the mask, never from searching for a pad id (which may equal the end-of-text)."""
    width = attention_mask.shape[-1]
    return width - 1 - attention_mask.flip(-1).long().argmax(-1)
