"""Raw samples -> token ids for each phase, with the tokenizer's conventions (data/tokens.py: BOS placed once,
answers ending with a stop id). No padding here (collators pad per batch). The answer's stop id is always kept:
a sample that cannot fit with it is repaired by trimming its prompt from the left, or dropped, and counted."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from rlhf_ray.data.adapters import conversation_pieces
from rlhf_ray.data.raw import RawSample
from rlhf_ray.data.tokens import TokenConventions

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label of tokens that carry no loss (torch's and HF's convention)."""
Overlong = Literal["trim_prompt", "drop"]


@dataclass
class TokenReport:
    """What tokenisation did to a split, so nothing is lost silently."""

    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    repaired: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        parts = [f"kept {self.kept}"]
        parts += [f"dropped {n} ({why})" for why, n in sorted(self.dropped.items())]
        parts += [f"repaired {n} ({why})" for why, n in sorted(self.repaired.items())]
        return ", ".join(parts)


def trim_left(ids: list[int], limit: int, keep: int = 0) -> list[int]:
    """`ids` cut from the left to `limit` tokens, keeping its first `keep` (the tokenizer's BOS prefix)."""
    if len(ids) <= limit:
        return ids
    return ids[:keep] + ids[len(ids) - (limit - keep):]


def _fit(prompt: list[int], answer: list[int], max_len: int, overlong: Overlong, report: TokenReport,
         what: str, keep: int) -> list[int] | None:
    """prompt + answer within max_len, trimming the prompt's start (after its first `keep` special tokens) if
    allowed; None if it cannot fit."""
    room = max_len - len(answer)
    if len(prompt) <= room:
        return prompt
    if overlong == "trim_prompt" and room >= keep + 1:
        report.repaired[f"{what}: prompt trimmed from the left"] += 1
        return trim_left(prompt, room, keep)
    report.dropped[f"{what}: longer than {max_len} tokens with end-of-text"] += 1
    return None


def tokenize_sft(samples: list[RawSample], tokenizer, tokens: TokenConventions, max_seq_len: int,
                 train_on_prompt: bool = False, overlong: Overlong = "trim_prompt") -> tuple[list[dict], TokenReport]:
    """input_ids = prompt + chosen + stop; labels copy the answer (and the prompt if train_on_prompt), else
    -100. A conversation (`messages`) trains on each assistant reply (`conversation_ids`); one longer than
    max_seq_len is dropped (its turns are not cut)."""
    report, out = TokenReport(), []
    for s in samples:
        if s.messages is not None:
            row = conversation_ids(s.messages, tokenizer, tokens, train_on_prompt)
            if len(row["input_ids"]) > max_seq_len:
                report.dropped[f"sft: conversation longer than {max_seq_len} tokens"] += 1
            else:
                out.append(row)
            continue
        if s.chosen is None:
            report.dropped["no chosen answer"] += 1
            continue
        answer = tokens.encode_answer(tokenizer, s.chosen)
        prompt = _fit(tokens.encode_prompt(tokenizer, s.prompt), answer, max_seq_len, overlong, report, "sft",
                      len(tokens.prefix_ids))
        if prompt is None:
            continue
        labels = (prompt if train_on_prompt else [IGNORE_INDEX] * len(prompt)) + answer
        out.append({"input_ids": prompt + answer, "labels": labels})
    report.kept = len(out)
    return out, report


def conversation_ids(messages: tuple[dict, ...], tokenizer, tokens: TokenConventions,
                     train_on_prompt: bool = False) -> dict[str, list[int]]:
    """input_ids / labels of a whole conversation, laid out as a multi-turn rollout is: each piece tokenised on its
    own (adapters.conversation_pieces), each assistant reply ending on its stop id and carrying labels, what the
    template writes after that stop (e.g. ChatML's newline) opening the next context piece, as the observation
    renderer does after a sampled turn."""
    ids: list[int] = []
    labels: list[int] = []
    carry = ""
    for k, (text, trained) in enumerate(conversation_pieces(messages, tokenizer)):
        if not trained:
            piece = (tokens.encode_prompt(tokenizer, carry + text) if k == 0
                     else tokenizer(carry + text, add_special_tokens=False)["input_ids"])
            ids += piece
            labels += piece if train_on_prompt else [IGNORE_INDEX] * len(piece)
            continue
        full = tokenizer(text, add_special_tokens=False)["input_ids"]
        end = tokens.end_of(full)
        if end is None:
            piece, carry = full + [tokens.eos_id], ""
        else:
            piece, stop = full[:end], tokenizer.decode(full[end - 1:end])
            at = text.find(stop)
            carry = text[at + len(stop):] if stop and at >= 0 else tokenizer.decode(full[end:])
        ids += piece
        labels += piece
    return {"input_ids": ids, "labels": labels}


def pack(samples: list[dict], max_seq_len: int) -> list[dict]:
    """Greedily concatenate tokenised SFT samples into sequences of at most max_seq_len (fewer pad tokens).
    Samples are never split; each keeps its own labels, so the loss stays on answers."""
    packed: list[dict] = []
    current: dict = {"input_ids": [], "labels": []}
    for s in samples:
        if current["input_ids"] and len(current["input_ids"]) + len(s["input_ids"]) > max_seq_len:
            packed.append(current)
            current = {"input_ids": [], "labels": []}
        current["input_ids"] = current["input_ids"] + s["input_ids"]
        current["labels"] = current["labels"] + s["labels"]
    if current["input_ids"]:
        packed.append(current)
    return packed


def tokenize_pairs(samples: list[RawSample], tokenizer, tokens: TokenConventions, max_seq_len: int,
                   overlong: Overlong = "trim_prompt") -> tuple[list[dict], TokenReport]:
    """chosen_ids / rejected_ids = the same prompt + each answer + stop (one shared prompt trim, so the pair
    differs only in the answer); prompt_len: the shared prompt's tokens (DPO scores only the answers)."""
    report, out = TokenReport(), []
    for s in samples:
        if s.chosen is None or s.rejected is None:
            report.dropped["not a pair (chosen or rejected missing)"] += 1
            continue
        if s.chosen == s.rejected:
            report.dropped["chosen == rejected"] += 1
            continue
        chosen = tokens.encode_answer(tokenizer, s.chosen)
        rejected = tokens.encode_answer(tokenizer, s.rejected)
        longer = chosen if len(chosen) >= len(rejected) else rejected
        prompt = _fit(tokens.encode_prompt(tokenizer, s.prompt), longer, max_seq_len, overlong, report, "pair",
                      len(tokens.prefix_ids))
        if prompt is None:
            continue
        out.append({"chosen_ids": prompt + chosen, "rejected_ids": prompt + rejected, "prompt_len": len(prompt)})
    report.kept = len(out)
    return out, report


def tokenize_prompts(samples: list[RawSample], tokenizer, tokens: TokenConventions,
                     max_prompt_len: int) -> tuple[list[dict], TokenReport]:
    """PPO prompts: ids cut from the left to max_prompt_len (the question's end is what the answer follows).
    The raw sample travels along so rule-based rewards can see the prompt's text and its dataset columns."""
    report, out = TokenReport(), []
    for s in samples:
        ids = tokens.encode_prompt(tokenizer, s.prompt)
        if len(ids) <= len(tokens.prefix_ids):
            report.dropped["empty prompt"] += 1
            continue
        if len(ids) > max_prompt_len:
            report.repaired[f"prompt longer than {max_prompt_len} tokens, cut from the left"] += 1
            ids = trim_left(ids, max_prompt_len, len(tokens.prefix_ids))
        out.append({"prompt_ids": ids, "prompt": s.prompt, "reference": s.chosen, "columns": dict(s.columns)})
    report.kept = len(out)
    return out, report
