"""Log-probabilities of chosen tokens, computed the way the sampler drew them (same temperature)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[token] for logits [B, L, V] and tokens [B, L]. Sampling at T and scoring at 1
    would make the PPO ratio wrong from the first step, so learners pass the sampling temperature."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def answer_logprobs(logits: torch.Tensor, sequences: torch.Tensor, answer_len: int,
                    temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [B, A] of the last `answer_len` tokens of `sequences` [B, P + A], from logits [B, P + A, V]:
    the logit at position i predicts token i + 1."""
    start = sequences.shape[1] - answer_len
    return token_logprobs(logits[:, start - 1: -1], sequences[:, start:], temperature)


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)
