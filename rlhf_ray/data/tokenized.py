"""Raw samples -> token ids for each phase. No padding here (collators pad per batch); end-of-text is always
kept: a sample that cannot fit with it is repaired by trimming its prompt from the left, or dropped, and counted."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from rlhf_ray.data.errors import DataError
from rlhf_ray.data.raw import RawSample

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


def check_tokenizer(tokenizer, allow_pad_equals_eos: bool = False) -> None:
    """Refuse tokenizers that would corrupt training before any work starts."""
    name = getattr(tokenizer, "name_or_path", "tokenizer")
    if tokenizer.eos_token_id is None:
        raise DataError(f"{name}: the tokenizer has no end-of-text (eos) token; set tokenizer.eos_token")
    if tokenizer.pad_token_id is None:
        raise DataError(f"{name}: the tokenizer has no pad token; add one distinct from eos "
                        f"(tokenizer.add_special_tokens({{'pad_token': '<|pad|>'}}) and resize the embeddings)")
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        if not allow_pad_equals_eos:
            raise DataError(f"{name}: pad token == eos token ({tokenizer.eos_token!r}); every 'first pad' would also "
                            f"be the answer's end, so end-of-text positions and lengths become ambiguous. Add a "
                            f"distinct pad token, or allow it explicitly")
        log.warning("%s: pad token == eos token; lengths are taken from attention masks, never from the first pad",
                    name)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _answer_ids(tokenizer, text: str) -> list[int]:
    """An answer always ends with end-of-text, exactly once (a chat template may already have written it)."""
    ids = _ids(tokenizer, text)
    return ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]


def _fit(prompt: list[int], answer: list[int], max_len: int, overlong: Overlong, report: TokenReport,
         what: str) -> list[int] | None:
    """prompt + answer within max_len, trimming the prompt's start if allowed; None if it cannot fit."""
    room = max_len - len(answer)
    if len(prompt) <= room:
        return prompt
    if overlong == "trim_prompt" and room >= 1:
        report.repaired[f"{what}: prompt trimmed from the left"] += 1
        return prompt[len(prompt) - room:]
    report.dropped[f"{what}: longer than {max_len} tokens with end-of-text"] += 1
    return None


def tokenize_sft(samples: list[RawSample], tokenizer, max_seq_len: int, train_on_prompt: bool = False,
                 overlong: Overlong = "trim_prompt") -> tuple[list[dict], TokenReport]:
    """input_ids = prompt + chosen + eos; labels copy the answer (and the prompt if train_on_prompt), else -100."""
    report, out = TokenReport(), []
    for s in samples:
        if s.chosen is None:
            report.dropped["no chosen answer"] += 1
            continue
        answer = _answer_ids(tokenizer, s.chosen)
        prompt = _fit(_ids(tokenizer, s.prompt), answer, max_seq_len, overlong, report, "sft")
        if prompt is None:
            continue
        labels = (prompt if train_on_prompt else [IGNORE_INDEX] * len(prompt)) + answer
        out.append({"input_ids": prompt + answer, "labels": labels})
    report.kept = len(out)
    return out, report


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


def tokenize_pairs(samples: list[RawSample], tokenizer, max_seq_len: int,
                   overlong: Overlong = "trim_prompt") -> tuple[list[dict], TokenReport]:
    """chosen_ids / rejected_ids = the same prompt + each answer + eos (one shared prompt trim, so the pair
    differs only in the answer)."""
    report, out = TokenReport(), []
    for s in samples:
        if s.chosen is None or s.rejected is None:
            report.dropped["not a pair (chosen or rejected missing)"] += 1
            continue
        if s.chosen == s.rejected:
            report.dropped["chosen == rejected"] += 1
            continue
        chosen = _answer_ids(tokenizer, s.chosen)
        rejected = _answer_ids(tokenizer, s.rejected)
        longer = chosen if len(chosen) >= len(rejected) else rejected
        prompt = _fit(_ids(tokenizer, s.prompt), longer, max_seq_len, overlong, report, "pair")
        if prompt is None:
            continue
        out.append({"chosen_ids": prompt + chosen, "rejected_ids": prompt + rejected})
    report.kept = len(out)
    return out, report


def tokenize_prompts(samples: list[RawSample], tokenizer, max_prompt_len: int) -> tuple[list[dict], TokenReport]:
    """PPO prompts: ids cut from the left to max_prompt_len (the question's end is what the answer follows).
    The raw sample travels along so rule-based rewards can see the prompt's text."""
    report, out = TokenReport(), []
    for s in samples:
        ids = _ids(tokenizer, s.prompt)
        if not ids:
            report.dropped["empty prompt"] += 1
            continue
        if len(ids) > max_prompt_len:
            report.repaired[f"prompt longer than {max_prompt_len} tokens, cut from the left"] += 1
            ids = ids[-max_prompt_len:]
        out.append({"prompt_ids": ids, "prompt": s.prompt, "reference": s.chosen})
    report.kept = len(out)
    return out, report
