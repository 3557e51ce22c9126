"""Sequence packing: a micro-batch's rows end to end in one row of real tokens, no pads.

A batch's rows are laid out [left-padded prompt | right-padded answer] (`pack_rollouts`), so a forward over them
computes every pad position of the widest prompt and the longest answer. Packed, each row keeps only its tokens,
with position ids counting from 0 per row, and attention runs block by block: a row attends only to itself
(varlen attention, as flash-attention's kernel does on a GPU). Rows that share a prompt (a GRPO prompt's answers)
can share it in the packed row too: the prompt once, then each answer, which attends to the prompt and to itself
(`share_prompts`), the same logits as the shared-prompt forward of models/shared_prompt.py.

The attention runs through transformers' attention interface: `enable(model)` registers ATTENTION (plain SDPA for
every unpacked forward, whose masks are built as usual) and a packed forward (`PackedRows.forward`) sets the
blocks for its duration. Each block is one SDPA call over its queries and keys, so no [N, N] mask over the packed
row is built or computed: the attention costs what the rows cost unpadded.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from rlhf_ray.models.loading import head_values

ATTENTION = "rlhf_packed_sdpa"
_BLOCKS: contextvars.ContextVar[list | None] = contextvars.ContextVar("packed_blocks", default=None)
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)
"""What a packed forward passes as its attention mask: transformers returns a 4-D mask as it is, so no mask over the
packed row is built (the blocks say who attends to whom)."""


@dataclass(frozen=True)
class Block:
    """Queries `queries` (positions in the packed row) attend causally to `keys`: None for the same positions;
    else their positions, the queries' own last, with `mask` [queries, keys] (causal, aligned at the end)."""

    queries: slice
    keys: torch.Tensor | None = None
    mask: torch.Tensor | None = None


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs):
    """Attention over [1, heads, N, head_dim] packed rows, block by block; any other forward: transformers' SDPA."""
    blocks = _BLOCKS.get()
    if blocks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = key.shape[1] != query.shape[1]
    outputs = []
    for block in blocks:
        q = query[:, :, block.queries]
        k, v = ((key[:, :, block.queries], value[:, :, block.queries]) if block.keys is None
                else (key[:, :, block.keys], value[:, :, block.keys]))
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=block.mask, dropout_p=dropout,
                                                      is_causal=block.mask is None, scale=scaling, enable_gqa=gqa))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def enable(model: torch.nn.Module) -> None:
    """Let `model` run packed forwards (its attention becomes ATTENTION: SDPA whenever no packed forward runs)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if reason := problem(type(base), base.config.to_dict()):
        raise ValueError(f"pack_sequences: {reason}")
    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    base.set_attn_implementation(ATTENTION)


PACK_MIN_HIDDEN = 256
"""Below this hidden size the packed path's attention, a Python loop over blocks per layer, costs more than the pads
it saves, so the default leaves such models padded. Measured side by side (one thread, policy forward + backward,
answers of varied length): the --pipeline quickstart's tiny model (hidden 128, 2 layers) 41.0 ms padded against 45.7 ms
packed (0.90x); SmolLM2-135M (hidden 576, 30 layers) 11.2 s against 7.5 s (1.50x)."""


def worth_packing(config: dict) -> bool:
    """Whether the default packs a model of this config (config.json's content): large enough that the pads cost
    more than the block loop (PACK_MIN_HIDDEN)."""
    text = config.get("text_config") or config
    return text.get("hidden_size", 0) >= PACK_MIN_HIDDEN


def enable_if(model: torch.nn.Module, requested: bool | None) -> bool:
    """Packed forwards for `model` as the role's `pack_sequences` asks: True enables them (a model that cannot run
    them raises, naming why), False leaves the padded path, None (the default) enables them where the model can
    and is large enough to gain (`worth_packing`). Returns whether they are on."""
    if requested is False:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.to_dict()
    if requested is None and (problem(type(base), config) is not None or not worth_packing(config)):
        return False
    enable(model)
    return True


def problem(model_class: type, config: dict) -> str | None:
    """Why a model of this class and config (config.json's content) cannot run packed forwards, or None: its
    attention must go through transformers' attention interface, without logit soft-capping (SDPA has none)."""
    text = config.get("text_config") or config
    if not getattr(model_class, "_supports_attention_backend", False):
        return f"{model_class.__name__} does not run its attention through transformers' attention interface"
    if text.get("attn_logit_softcapping"):
        return f"{model_class.__name__} soft-caps its attention logits, which packed attention (SDPA) does not do"
    return None


@dataclass
class PackedRows:
    """Rows [B, P + A] of the batch layout packed into one row of N real tokens."""

    input_ids: torch.Tensor
    """[1, N]."""
    position_ids: torch.Tensor
    """[1, N]: each row's positions from 0 (an answer sharing a prompt continues after it)."""
    blocks: list[Block]
    answer_index: torch.Tensor
    """[B, A]: the packed position whose output predicts answer token j of row b (0 past the row's answer)."""
    ends: torch.Tensor
    """[B]: the packed position of each row's last real token."""
    longest: int
    """The longest row's tokens (prompt + answer)."""

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]

    def forward(self, forward: Callable, **kwargs):
        """`forward` (the model or its DeepSpeed engine) over the packed row."""
        with _blocks(self.blocks):
            return forward(input_ids=self.input_ids, position_ids=self.position_ids,
                           attention_mask=_NO_MASK.to(self.input_ids.device), **kwargs)


@contextlib.contextmanager
def _blocks(blocks: list[Block]):
    token = _BLOCKS.set(blocks)
    try:
        yield
    finally:
        _BLOCKS.reset(token)


def pack(sequences: torch.Tensor, attention_mask: torch.Tensor, answer_len: int, share_prompts: bool = False
         ) -> PackedRows:
    """Pack rows laid out [padded prompt | right-padded answer] (the answer: the last `answer_len` columns; 0 for
    rows that are one padded sequence). A row's tokens must be contiguous in each part (pads only around them).
    With `share_prompts`, rows with the same prompt share it."""
    device = sequences.device
    width = sequences.shape[1] - answer_len
    mask = attention_mask.bool().cpu()
    prompts, answer_lens = [], []  # each row's prompt columns (first, end), its answer's tokens
    for b, row in enumerate(mask):
        used = row[:width].nonzero()
        first, end = (int(used[0]), int(used[-1]) + 1) if len(used) else (width, width)
        acted = row[width:].nonzero()
        a = int(acted[-1]) + 1 if len(acted) else 0
        if not (row[first:end].all() and row[width: width + a].all()):
            raise ValueError(f"row {b} has pads between its tokens: it cannot be packed")
        prompts.append((first, end))
        answer_lens.append(a)
    prompt_lens = [end - first for first, end in prompts]
    groups: dict[tuple, list[int]] = {}
    for b, (first, end) in enumerate(prompts):
        key = tuple(sequences[b, first:end].tolist()) if share_prompts and end > first else (b,)
        groups.setdefault(key, []).append(b)

    ids, positions, blocks = [], [], []
    answer_index = torch.zeros(len(sequences), answer_len, dtype=torch.long)
    ends = torch.zeros(len(sequences), dtype=torch.long)
    start = 0
    for rows in groups.values():
        p = prompt_lens[rows[0]]
        prompt = sequences[rows[0], prompts[rows[0]][0]: prompts[rows[0]][1]]
        if len(rows) == 1:  # the row alone: one causal block
            (b,) = rows
            a = answer_lens[b]
            ids += [prompt, sequences[b, width: width + a]]
            positions.append(torch.arange(p + a))
            blocks.append(Block(slice(start, start + p + a)))
            _point(answer_index, ends, b, start + p - 1, start + p, a)
            start += p + a
            continue
        ids.append(prompt)
        positions.append(torch.arange(p))
        blocks.append(Block(slice(start, start + p)))
        prompt_keys = torch.arange(start, start + p)
        at = start + p
        for b in rows:
            a = answer_lens[b]
            if a:
                ids.append(sequences[b, width: width + a])
                positions.append(torch.arange(p, p + a))
                keys = torch.cat([prompt_keys, torch.arange(at, at + a)]).to(device)
                causal = torch.ones(a, p + a, dtype=torch.bool, device=device).tril(p)
                blocks.append(Block(slice(at, at + a), keys, causal))
            _point(answer_index, ends, b, start + p - 1, at, a)
            at += a
        start = at
    return PackedRows(input_ids=torch.cat(ids).to(device)[None], position_ids=torch.cat(positions).to(device)[None],
                      blocks=blocks, answer_index=answer_index.to(device), ends=ends.to(device),
                      longest=max(p + a for p, a in zip(prompt_lens, answer_lens)))


def _point(answer_index: torch.Tensor, ends: torch.Tensor, row: int, prompt_last: int, answer_at: int,
           answer_len: int) -> None:
    """Row `row`'s answer token j is predicted at its previous token: the prompt's last, then the answer's own."""
    if answer_len:
        answer_index[row, 0] = prompt_last
        answer_index[row, 1:answer_len] = torch.arange(answer_at, answer_at + answer_len - 1)
    ends[row] = answer_at + answer_len - 1 if answer_len else prompt_last


def packed_values(model: torch.nn.Module, rows: PackedRows, forward: Callable | None = None) -> torch.Tensor:
    """A scalar-head model's head at every position of the packed row: [N] (index it with `answer_index` for a
    critic's values, with `ends` for a reward model's scores)."""
    return head_values(model, lambda: rows.forward(forward or model))[0]
