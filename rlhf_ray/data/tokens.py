"""Token conventions of one tokenizer, decided once and handed to everything that builds or reads sequences.

Real chat models differ in how they mark a sequence: Llama, Mistral and Gemma tokenizers put a BOS token first,
Qwen and GPT-2 put none, OPT puts `</s>`; Llama 3 Instruct and Qwen end an answer on any of several ids
(`generation_config.eos_token_id` is a list); Llama 3 and GPT-2 have no pad token, Qwen and SmolLM2 pad with
their end-of-text. `TokenConventions` captures that once per tokenizer:

- `prefix_ids`: the special tokens the tokenizer itself writes before a text (BOS), placed exactly once: a text
  that a chat template already began with them is not given them again;
- `eos_id`: what training data appends to an answer that does not already end with a stop id;
- `stop_ids`: every id that ends a generated answer (the tokenizer's eos plus the generation config's), used by
  both engines, by `finished`, by where the sequence score lands, and by GAE's last step;
- `pad_id`: only a filler. Lengths, answer ends and last tokens always come from attention / action masks, never
  from searching for it, so a pad equal to eos (or no pad at all: eos fills) needs no user action.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from rlhf_ray.data.errors import DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenConventions:
    name: str
    eos_id: int
    stop_ids: tuple[int, ...]
    pad_id: int
    prefix_ids: tuple[int, ...] = ()

    @classmethod
    def from_tokenizer(cls, tokenizer, model_path: str | Path | None = None) -> "TokenConventions":
        """Read the conventions off a HF tokenizer and, where given, the model folder's generation config."""
        name = str(getattr(tokenizer, "name_or_path", "") or "tokenizer")
        eos = tokenizer.eos_token_id
        if eos is None:
            raise DataError(f"{name}: the tokenizer has no end-of-text (eos) token, so answers cannot end; set "
                            f"tokenizer.eos_token (or give the model a generation_config.json with eos_token_id)")
        stops = [eos, *generation_stop_ids(model_path)]
        pad = tokenizer.pad_token_id
        if pad is None:
            log.info("%s: no pad token; padding with end-of-text %d (masks carry every length)", name, eos)
            pad = eos
        return cls(name=name, eos_id=eos, stop_ids=tuple(dict.fromkeys(stops)), pad_id=pad,
                   prefix_ids=tuple(special_prefix(tokenizer)))

    # ---- building sequences -------------------------------------------------------------------------------
    def encode_prompt(self, tokenizer, text: str) -> list[int]:
        """A prompt's ids, beginning with the tokenizer's special prefix exactly once."""
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prefix = list(self.prefix_ids)
        return ids if not prefix or ids[: len(prefix)] == prefix else prefix + ids

    def encode_answer(self, tokenizer, text: str) -> list[int]:
        """An answer's ids ending with one stop id: the one a chat template wrote, else `eos_id` appended."""
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        end = self.end_of(ids)
        return ids[:end] if end is not None else ids + [self.eos_id]

    # ---- reading answers ----------------------------------------------------------------------------------
    def end_of(self, ids: list[int]) -> int | None:
        """Length of the answer up to and including its first stop id; None when it has none."""
        stops = set(self.stop_ids)
        for i, token in enumerate(ids):
            if token in stops:
                return i + 1
        return None

    def cut(self, ids: list[int]) -> tuple[list[int], bool]:
        """(the answer up to its first stop id included, whether it had one)."""
        end = self.end_of(ids)
        return (ids, False) if end is None else (ids[:end], True)


def special_prefix(tokenizer) -> list[int]:
    """The special ids the tokenizer writes before any text (e.g. [bos]), found by encoding a probe with and
    without special tokens: what only the first has in front is the prefix."""
    probe = "a"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start: start + len(plain)] == plain:
            return full[:start]
    return []


def generation_stop_ids(model_path: str | Path | None) -> list[int]:
    """eos ids of a local model's generation_config.json (an int or a list), else of its config.json."""
    if model_path is None:
        return []
    folder = Path(model_path)
    if not folder.is_dir():  # a hub id: the generation config from the hub cache, if it can be had
        try:
            from transformers import GenerationConfig

            value = GenerationConfig.from_pretrained(str(model_path)).eos_token_id
        except Exception:  # noqa: BLE001 - no generation config: the tokenizer's eos alone
            return []
        return [] if value is None else [int(v) for v in (value if isinstance(value, list) else [value])]
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if not file.is_file():
            continue
        value = json.loads(file.read_text()).get("eos_token_id")
        if value is None:
            continue
        return [int(v) for v in (value if isinstance(value, list) else [value])]
    return []
