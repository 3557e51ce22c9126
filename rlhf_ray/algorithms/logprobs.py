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


class _ProjectedLogProbs(torch.autograd.Function):
    """log softmax(h W^T / T)[token] and the entropy there, a chunk of positions at a time: [N, V] logits never
    exist, only [chunk, V]; the backward pass projects each chunk again (softmax from the saved logsumexp)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk):
        acc = torch.promote_types(hidden.dtype, torch.float32)  # at least fp32, as token_logprobs computes
        logp = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        ent, lse = torch.empty_like(logp), torch.empty_like(logp)
        for s in range(0, hidden.shape[0], chunk):
            logits = (hidden[s: s + chunk] @ weight.T).to(acc) / temperature
            lse[s: s + chunk] = torch.logsumexp(logits, dim=-1)
            logp[s: s + chunk] = logits.gather(-1, tokens[s: s + chunk, None])[:, 0] - lse[s: s + chunk]
            probs = torch.exp(logits - lse[s: s + chunk, None])
            ent[s: s + chunk] = lse[s: s + chunk] - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, tokens, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, tokens, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = lse.dtype
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None  # the weight's dtype: no fp32
        # [V, H] copy (each chunk's product accumulates in fp32 inside the matmul)
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s: s + ctx.chunk]
            logits = (h @ weight.T).to(acc) / ctx.temperature
            g = grad_logp[s: s + ctx.chunk].to(acc)
            # d logp[token] / d logits = onehot(token) - softmax; times the incoming gradient, over T
            grad_logits = torch.exp(logits - lse[s: s + ctx.chunk, None]).mul_(-g[:, None])
            grad_logits.scatter_add_(-1, tokens[s: s + ctx.chunk, None], g[:, None])
            grad_logits = grad_logits.div_(ctx.temperature).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s: s + ctx.chunk] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, h)
        return grad_hidden, grad_weight, None, None, None


CHUNK_BYTES = 2**28
"""fp32 logits of one chunk of positions (256 MiB: ~1365 positions of a 49k vocabulary, 512 of Llama 3's 128k)."""


def projected_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                       chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [B, A], entropy [B, A] without gradient) of `tokens` [B, A] under softmax(hidden W^T / T), for
    final hidden states [B, A, H] and an LM head's weight [V, H]: the same numbers as token_logprobs and entropy on
    the projected logits, without ever holding [B, A, V] (at most `chunk` positions' logits at a time, default
    CHUNK_BYTES of them, in the forward and again in the backward pass)."""
    b, a = tokens.shape
    chunk = chunk or max(16, CHUNK_BYTES // (4 * weight.shape[0]))
    logp, ent = _ProjectedLogProbs.apply(hidden.reshape(b * a, -1), weight, tokens.reshape(-1), float(temperature),
                                         int(chunk))
    return logp.view(b, a), ent.view(b, a)
