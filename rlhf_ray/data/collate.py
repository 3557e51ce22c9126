"""Batching with per-batch padding: right padding for training, left padding for generation prompts."""

from __future__ import annotations

import torch

from rlhf_ray.data.tokenized import IGNORE_INDEX


def _pad(rows: list[list[int]], value: int, left: bool = False) -> torch.Tensor:
    width = max(len(r) for r in rows)
    padded = [([value] * (width - len(r)) + r) if left else (r + [value] * (width - len(r))) for r in rows]
    return torch.tensor(padded, dtype=torch.long)


def _mask(rows: list[list[int]], left: bool = False) -> torch.Tensor:
    return _pad([[1] * len(r) for r in rows], 0, left)


def collate_lm(batch: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Rows of input_ids and labels (the language-model loss: SFT's answers, pretraining's every token) ->
    input_ids / attention_mask / labels [B, L], padded on the right; padding never carries a label."""
    ids = [b["input_ids"] for b in batch]
    return {"input_ids": _pad(ids, pad_id), "attention_mask": _mask(ids),
            "labels": _pad([b["labels"] for b in batch], IGNORE_INDEX)}


def collate_pairs(batch: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """[2B, L]: the B chosen sequences first, then the B rejected ones (DeepSpeed-Chat's DataCollatorReward)."""
    rows = [b["chosen_ids"] for b in batch] + [b["rejected_ids"] for b in batch]
    return {"input_ids": _pad(rows, pad_id), "attention_mask": _mask(rows)}


def collate_prompts(batch: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts, so every answer starts at the same column."""
    ids = [b["prompt_ids"] for b in batch]
    return {"input_ids": _pad(ids, pad_id, left=True), "attention_mask": _mask(ids, left=True)}
