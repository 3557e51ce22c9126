"""Micro-batches cut by a token budget instead of a row count.

A micro-batch runs at the width of its longest prompt plus its longest answer (left-padded prompts, right-padded
answers: `RolloutBatch.trimmed`), so its cost is rows x that width, pads included. Cutting a fixed number of rows in
prompt order mixes short prompts with long ones and pays for the difference in pads. Here the rows are sorted (by
prompt length, then answer length; the answers to one prompt kept together, so they still share its forward) and
cut where the next row would take the micro-batch past the budget: rows of a similar length run together, and a
micro-batch of short rows holds more of them. A rank may need fewer micro-batches than another; the split is then
refined (the costliest micro-batch halved) until every rank runs the same number, as ZeRO's collectives in each
forward and backward require.

Packed (models/packing.py: a micro-batch runs as one row of its real tokens, a shared prompt once), a micro-batch
costs its tokens, not rows x widths: the rows are taken in their order, a prompt's answers together, while their
tokens fit the budget.
"""

from __future__ import annotations

import numpy as np
import torch


def row_lengths(attention_mask: torch.Tensor, action_mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, answer columns) of each row of a [B, P + A] batch: the answer's columns run to its last
    trained token (what `trimmed` keeps)."""
    answer_width = action_mask.shape[1]
    prompt = attention_mask[:, : attention_mask.shape[1] - answer_width].sum(1).numpy()
    acted = action_mask.bool()
    last = torch.where(acted.any(1), answer_width - acted.flip(1).int().argmax(1), torch.ones(len(acted),
                                                                                             dtype=torch.long))
    return prompt.astype(np.int64), last.numpy().astype(np.int64)


def prompt_groups(sequences: torch.Tensor, answer_width: int) -> np.ndarray:
    """Each row's group: rows with the same prompt (a GRPO prompt's answers) share one id."""
    _, inverse = torch.unique(sequences[:, : sequences.shape[1] - answer_width], dim=0, return_inverse=True)
    return inverse.numpy()


def padded_tokens(prompt: np.ndarray, answer: np.ndarray) -> int:
    """Tokens of one forward over these rows, pads included: rows x (longest prompt + longest answer)."""
    return int(len(prompt) * (prompt.max() + answer.max())) if len(prompt) else 0


def by_token_budget(prompt: np.ndarray, answer: np.ndarray, budget: int, groups: np.ndarray | None = None,
                    packed: bool = False) -> list[np.ndarray]:
    """Row positions of each micro-batch: rows sorted by length and cut where one more row would pass `budget`
    padded tokens. Two orders are tried, prompt length first or answer length first (a group's longest answer
    standing for its rows while `groups` keeps the answers to one prompt together: they share its forward), and
    the one with fewer padded tokens is kept. A row longer than the budget on its own runs alone (validation keeps
    that from happening). `packed`: micro-batches of packed rows (see the module's doc)."""
    n = len(prompt)
    groups = np.arange(n) if groups is None else np.asarray(groups)
    if packed:
        return _cut_packed(np.lexsort((np.arange(n), groups)), prompt, answer, groups, budget)
    longest = np.zeros(groups.max() + 1 if n else 0, dtype=np.int64)
    np.maximum.at(longest, groups, answer)
    orders = [np.lexsort((np.arange(n), answer, groups, longest[groups], prompt)),  # the last key sorts first
              np.lexsort((np.arange(n), answer, groups, prompt, longest[groups]))]
    cuts = [_cut(order, prompt, answer, budget) for order in orders]
    return min(cuts, key=lambda parts: sum(padded_tokens(prompt[p], answer[p]) for p in parts))


def _cut(order: np.ndarray, prompt: np.ndarray, answer: np.ndarray, budget: int) -> list[np.ndarray]:
    parts: list[np.ndarray] = []
    start, widest_prompt, widest_answer = 0, 0, 0
    for i, row in enumerate(order):
        p, a = max(widest_prompt, prompt[row]), max(widest_answer, answer[row])
        if i > start and (i - start + 1) * (p + a) > budget:
            parts.append(order[start:i])
            start, p, a = i, prompt[row], answer[row]
        widest_prompt, widest_answer = p, a
    if start < len(order):
        parts.append(order[start:])
    return parts


def _cut_packed(order: np.ndarray, prompt: np.ndarray, answer: np.ndarray, groups: np.ndarray, budget: int
                ) -> list[np.ndarray]:
    parts: list[np.ndarray] = []
    start, tokens, seen = 0, 0, set()
    for i, row in enumerate(order):
        cost = answer[row] + (0 if groups[row] in seen else prompt[row])
        if i > start and tokens + cost > budget:
            parts.append(order[start:i])
            start, tokens, seen, cost = i, 0, set(), answer[row] + prompt[row]
        tokens += cost
        seen.add(groups[row])
    if start < len(order):
        parts.append(order[start:])
    return parts


def split_to(parts: list[np.ndarray], prompt: np.ndarray, answer: np.ndarray, count: int) -> list[np.ndarray]:
    """`parts` refined to exactly `count` micro-batches (count >= len(parts), at most one per row): the one with the
    most padded tokens is halved, again and again."""
    parts = list(parts)
    if count > sum(len(p) for p in parts):
        raise ValueError(f"{count} micro-batches asked of {sum(len(p) for p in parts)} rows")
    while len(parts) < count:
        i = max((i for i, p in enumerate(parts) if len(p) > 1),
                key=lambda i: padded_tokens(prompt[parts[i]], answer[parts[i]]))
        half = (len(parts[i]) + 1) // 2
        parts[i: i + 1] = [parts[i][:half], parts[i][half:]]
    return parts


def used_columns(sequences: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [b, T] without the columns none of them uses (pads every row has, on either side): a micro-batch of
    short rows runs at its own width (as `RolloutBatch.trimmed` does for the layout)."""
    used = attention_mask.any(0).nonzero()
    if not len(used):
        return sequences[:, :1], attention_mask[:, :1]
    first, last = int(used[0]), int(used[-1]) + 1
    return sequences[:, first:last], attention_mask[:, first:last]
