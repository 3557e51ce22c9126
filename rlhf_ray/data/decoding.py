"""Token ids back to text, for actors that only decode (the reward-function actor). The `tokenizers` library reads
a model folder's tokenizer.json in ~0.1 s, where importing transformers' AutoTokenizer costs ~3 s of CPU in every
such actor's start. transformers' fast tokenizers decode with the same library and the same file, then clean up
spaces only where the tokenizer config asks for it; a tokenizer that needs more than the file (no tokenizer.json,
that clean-up, its own code, a special token the file does not mark special) is decoded by AutoTokenizer itself."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _named_specials(config: dict) -> set[str]:
    """Token strings tokenizer_config.json declares special."""
    named = set()
    for key in _SPECIAL_KEYS:
        value = config.get(key)
        named.add(value.get("content") if isinstance(value, dict) else value)
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        named.update(extra.values() if isinstance(extra, dict) else extra)
    named.update(t["content"] for t in (config.get("added_tokens_decoder") or {}).values() if t.get("special"))
    return {t.get("content") if isinstance(t, dict) else t for t in named} - {None}


def file_decodes_alike(path: str | Path) -> bool:
    """Whether tokenizer.json alone decodes as transformers would decode this folder's tokenizer."""
    folder = Path(path)
    file, config_file = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if not file.is_file():
        return False
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("auto_map") or config.get("clean_up_tokenization_spaces"):
        return False
    marked = {t["content"] for t in json.loads(file.read_text()).get("added_tokens", []) if t.get("special")}
    return _named_specials(config) <= marked


class TextDecoder:
    """`decode(ids, skip_special_tokens)` as the folder's transformers tokenizer does it."""

    def __init__(self, path: str | Path):
        if file_decodes_alike(path):
            from tokenizers import Tokenizer

            self.backend = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        else:
            from transformers import AutoTokenizer

            self.backend = AutoTokenizer.from_pretrained(str(path))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
