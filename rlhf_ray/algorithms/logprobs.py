"""Log-probabilities of chosen tokens, computed the way the sampler drew them (same temperature)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[token] for logits [B, L, V] and tokens [B, L]. Sampling at T and scoring at 1
    would make the PPO ratio wrong from the first step, so learners pass the sampling temperature.

    Computed as logit[token] - logsumexp(logits), one sequence at a time: no [B, L, V] log-softmax is
    materialised (nor kept for the backward pass), so the working set is the logits plus one row's fp32 copy."""
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float()
    return picked - torch.stack([torch.logsumexp(row.float(), dim=-1) for row in logits])


def answer_logits(logits: torch.Tensor, answer_len: int) -> torch.Tensor:
    """The logits [B, A, V] that predict the last `answer_len` tokens, from the logits of the whole sequence
    [B, P + A, V] or of its last A + 1 positions only: the logit at position i predicts token i + 1."""
    return logits[:, -answer_len - 1: -1]


def answer_logprobs(logits: torch.Tensor, sequences: torch.Tensor, answer_len: int,
                    temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [B, A] of the last `answer_len` tokens of `sequences` [B, P + A], from logits of the whole
    sequence or of its last A + 1 positions (see answer_logits)."""
    return token_logprobs(answer_logits(logits, answer_len), sequences[:, -answer_len:], temperature)


@torch.no_grad()
def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy [B, L] of softmax(logits / T), a metric (no gradient), one sequence at a time."""
    out = []
    for row in logits:
        logp = F.log_softmax(row.float() / temperature, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(out)
