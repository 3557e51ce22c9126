"""The logits that score a batch's answers, with each distinct prompt run through the model once.

GRPO and RLOO sample several answers per prompt, so a batch holds each prompt n times, and the reference and the
policy score every row over prompt + answer. The answers need the prompt only as context: its keys and values do
not depend on the answer. So the distinct prompts run once with the KV cache kept, the cache is repeated row by
row, and the answers run on top of it: the same logits as the whole-sequence forward at P/n + A instead of P + A
tokens per row, with gradients flowing through the cache into the prompt's forward. Rows are left-padded prompts
followed by right-padded answers (the layout `pack_rollouts` writes), so a prompt's pads are part of its key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Callable

import torch

from rlhf_ray.algorithms.logprobs import entropy, projected_logprobs, token_logprobs
from rlhf_ray.models.loading import last_logits_only, logits_at, mask_positions
from rlhf_ray.models.packing import pack


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the first row of each distinct row [U], index of each row's distinct row [B]) for rows [B, L]."""
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), rows.shape[0], dtype=torch.long, device=rows.device)
    first = first.scatter_reduce(0, inverse, torch.arange(rows.shape[0], device=rows.device), "amin")
    return first, inverse


def _sliding_window(model: torch.nn.Module) -> int | None:
    """The model's sliding attention window, if some of its layers have one."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    return window if window and (types is None or "sliding_attention" in types) else None


def _keeps_every_position(cache, prompt_len: int) -> bool:
    """A cache whose rows can be selected and that kept all `prompt_len` positions of every layer (a sliding layer
    does while the prompt fits its window; recurrent or compressed caches never do)."""
    layers = getattr(cache, "layers", None)
    return (hasattr(cache, "batch_select_indices") and bool(layers)
            and all(type(layer).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer")
                    and layer.keys.shape[-2] == prompt_len for layer in layers))


def forward_answer_logits(forward: Callable, model: torch.nn.Module, sequences: torch.Tensor,
                          attention_mask: torch.Tensor, answer_len: int, share_prompts: bool = True,
                          packed: bool = False) -> torch.Tensor:
    """Logits [B, A, V] predicting the last `answer_len` tokens of `sequences` [B, P + A]: position i's logits
    predict token i + 1. `forward` is the callable that runs `model` (a DeepSpeed engine or the model itself).
    Prompts shared by several rows run once; a batch of distinct prompts, a model that trains with gradient
    checkpointing (it drops the cache), a sequence longer than the model's sliding window, or a cache that does not
    keep every position (recurrent layers) runs whole. `share_prompts=False` always runs whole: ranks whose weights
    are sharded (ZeRO-3) must all run the same number of forwards, whatever rows each holds.

    `packed` (a model set up by models/packing.enable): the rows run as one packed row of their real tokens, each
    prompt once (one forward whatever the rows, so ZeRO-3 ranks stay in step): no pad is computed. A model that
    trains with gradient checkpointing (its recomputed forward would not see the packing) or whose sliding window is
    shorter than a row runs the padded rows instead, as `share_prompts` says."""
    prompt_len, window = sequences.shape[1] - answer_len, _sliding_window(model)
    checkpointed = model.training and getattr(model, "is_gradient_checkpointing", False)
    if packed and not checkpointed and answer_len > 0:
        rows = pack(sequences, attention_mask, answer_len, share_prompts=True)  # one forward whatever the rows
        if window is None or rows.longest < window:
            out = rows.forward(forward, **logits_at(model, rows.answer_index.flatten())).logits[0]
            index = rows.answer_index if len(out) == rows.tokens else torch.arange(out.shape[0], device=out.device)
            return out[index.view(rows.answer_index.shape)]
    if (share_prompts and prompt_len > 0 and answer_len > 0 and not checkpointed
            and (window is None or sequences.shape[1] < window)):
        first, inverse = distinct_rows(torch.cat([sequences[:, :prompt_len], attention_mask[:, :prompt_len]], 1))
        if len(first) < len(sequences):
            positions = mask_positions(model, attention_mask)
            head = forward(input_ids=sequences[first, :prompt_len], attention_mask=attention_mask[first, :prompt_len],
                           use_cache=True, **last_logits_only(model, 1),
                           **{k: v[first, :prompt_len] for k, v in positions.items()})
            cache = head.past_key_values
            if _keeps_every_position(cache, prompt_len):
                cache.batch_select_indices(inverse)
                tail = forward(input_ids=sequences[:, prompt_len:], attention_mask=attention_mask,
                               past_key_values=cache, use_cache=True, **last_logits_only(model, answer_len),
                               **{k: v[:, prompt_len:] for k, v in positions.items()})
                return torch.cat([head.logits[inverse, -1:], tail.logits[:, :-1]], dim=1)
    logits = forward(input_ids=sequences, attention_mask=attention_mask, **mask_positions(model, attention_mask),
                     **last_logits_only(model, answer_len + 1)).logits
    return logits[:, -answer_len - 1: -1]


@contextlib.contextmanager
def head_as_identity(head: torch.nn.Module) -> Iterator[None]:
    """Within: the LM head passes its input through, so a forward's `logits` are the final hidden states of the
    positions it would have projected. The forward still runs through the caller's callable (a DeepSpeed engine
    registers its backward bookkeeping on the outputs)."""
    head.forward = lambda hidden_states: hidden_states
    try:
        yield
    finally:
        del head.forward


def projection_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head when a model's logits are exactly `hidden @ head.weight^T` (no bias, no soft-capping or logit
    scaling, as in Gemma 2 / 3, Cohere or Granite): then log-probs can be projected a chunk at a time."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    scaled = any(getattr(config, key, None) not in (None, 1, 1.0)
                 for key in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"))
    if type(head) is not torch.nn.Linear or head.bias is not None or scaled:
        return None
    return head


def answer_logprobs_and_entropy(forward: Callable, model: torch.nn.Module, sequences: torch.Tensor,
                                attention_mask: torch.Tensor, answer_len: int, temperature: float,
                                share_prompts: bool = True, chunked: bool = True, with_entropy: bool = True,
                                packed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, A] of the answer tokens at the sampling temperature, and (with_entropy) the sampling
    distribution's entropy there [B, A] without gradient. Chunked (the default, where `projection_head` allows):
    the backbone's hidden states go through the LM head a chunk of positions at a time
    (algorithms/logprobs.projected_logprobs), so no [B, A, V] logits are held. It reads the head's weight outside the
    head's forward, so a ZeRO-3 engine (whose hooks gather that weight) passes chunked=False. `packed`: see
    forward_answer_logits."""
    tokens = sequences[:, -answer_len:]
    head = projection_head(model) if chunked else None
    if head is not None:
        with head_as_identity(head):
            hidden_states = forward_answer_logits(forward, model, sequences, attention_mask, answer_len, share_prompts,
                                                  packed)
        logp, ent = projected_logprobs(hidden_states, head.weight, tokens, temperature)
        return logp, ent if with_entropy else None
    logits = forward_answer_logits(forward, model, sequences, attention_mask, answer_len, share_prompts, packed)
    logits.div_(temperature)  # in place: no second vocabulary-sized tensor (the head's backward needs its input)
    return token_logprobs(logits, tokens), entropy(logits) if with_entropy else None
