"""What a GGUF file says about its special tokens, and carrying it into the HF folder an import writes.

transformers' GGUF conversion keeps the vocabulary, the bos / eos / unk / pad tokens and the default chat template,
but drops llama.cpp's `tokenizer.ggml.add_bos_token` / `add_eos_token` flags (its tokenizer then writes no BOS,
and a model trained with one answers garbage: Gemma 3), the end-of-turn and end-of-message ids that stop
generation (`eot_token_id`, `eom_token_id`), and the named chat templates (`tokenizer.chat_template.NAME`).
It also drops the file's sampling defaults (`general.sampling.*`). `GGUFTokens` reads all of these;
`apply_to_tokenizer`, `generation_config` and `write_tokenizer_flags` write them so that plain transformers loads
the imported folder with the behaviour the GGUF describes. (The separator token, `add_sep_token`, is not carried:
no causal LM here uses one.)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "tokenizer.ggml."
SAMPLING = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "penalty_repeat": "repetition_penalty"}
"""llama.cpp's `general.sampling.KEY` -> the GenerationConfig field it sets."""


@dataclass(frozen=True)
class GGUFTokens:
    """The special-token metadata of one GGUF file; None where the file does not say."""

    add_bos: bool | None = None
    add_eos: bool | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    unk_id: int | None = None
    eot_id: int | None = None
    """End of turn (e.g. `<|eot_id|>`, `<end_of_turn>`): ends a generated answer like eos."""
    eom_id: int | None = None
    """End of message (Llama 3.1's `<|eom_id|>` after a tool call): ends a generated answer like eos."""
    chat_template: str | None = None
    named_templates: dict[str, str] = field(default_factory=dict)
    """Further chat templates by name (`tokenizer.chat_template.tool_use`, ...)."""
    sampling: dict[str, float] = field(default_factory=dict)
    """The file's recommended sampling settings as GenerationConfig fields (temperature, top_k, top_p, ...)."""

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a generated answer: eos, end of turn, end of message (in that order, no repeats)."""
        return tuple(dict.fromkeys(i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None))


def read_gguf_tokens(path: str | Path) -> GGUFTokens:
    """The special-token metadata of a GGUF file (headers only; the tensors are not read)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def value(key: str):
        entry = fields.get(key)
        return None if entry is None else entry.contents()

    def token_id(name: str) -> int | None:
        found = value(f"{PREFIX}{name}_token_id")
        return None if found is None else int(found)

    def flag(name: str) -> bool | None:
        found = value(f"{PREFIX}{name}")
        return None if found is None else bool(found)

    names = value("tokenizer.chat_templates") or []
    named = {str(name): str(value(f"tokenizer.chat_template.{name}")) for name in names
             if value(f"tokenizer.chat_template.{name}") is not None}
    template = value("tokenizer.chat_template")
    sampling = {name: value(f"general.sampling.{key}") for key, name in SAMPLING.items()}
    sampling = {name: (int(v) if name == "top_k" else float(v)) for name, v in sampling.items() if v is not None}
    return GGUFTokens(add_bos=flag("add_bos_token"), add_eos=flag("add_eos_token"), bos_id=token_id("bos"),
                      eos_id=token_id("eos"), pad_id=token_id("padding"), unk_id=token_id("unknown"),
                      eot_id=token_id("eot"), eom_id=token_id("eom"),
                      chat_template=None if template is None else str(template), named_templates=named,
                      sampling=sampling)


def apply_to_tokenizer(tokenizer, tokens: GGUFTokens) -> None:
    """Make a GGUF-converted HF tokenizer add BOS / EOS as the file says, and carry its chat templates."""
    for flag, wanted in (("add_bos_token", tokens.add_bos), ("add_eos_token", tokens.add_eos)):
        if wanted is None:
            continue
        if bool(getattr(tokenizer, flag, False)) != wanted:
            setattr(tokenizer, flag, wanted)  # the setter rebuilds the post-processor
    if tokens.named_templates:
        default = tokens.chat_template or tokenizer.chat_template
        tokenizer.chat_template = {**({"default": default} if default else {}), **tokens.named_templates}
    elif tokens.chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = tokens.chat_template


def generation_config(tokens: GGUFTokens, tokenizer):
    """The generation config the GGUF implies: its bos and pad, every stop id (eos, end of turn, end of message)
    as eos_token_id (a list when there are several, as HF models with several stop ids ship it), and its sampling
    defaults (sampling on when it recommends a temperature above 0)."""
    from transformers import GenerationConfig

    stops = list(tokens.stop_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    pad = tokens.pad_id if tokens.pad_id is not None else tokenizer.pad_token_id
    bos = tokens.bos_id if tokens.bos_id is not None else tokenizer.bos_token_id
    sampling = dict(tokens.sampling)
    if sampling.get("temperature", 0.0) > 0:
        sampling["do_sample"] = True
    return GenerationConfig(bos_token_id=bos, eos_token_id=stops[0] if len(stops) == 1 else (stops or None),
                            pad_token_id=pad, **sampling)


def write_tokenizer_flags(folder: str | Path, tokens: GGUFTokens) -> None:
    """Write the add-BOS / add-EOS flags the GGUF states into the folder's tokenizer_config.json (transformers keeps
    them only in tokenizer.json's post-processor; other readers look here)."""
    file = Path(folder) / "tokenizer_config.json"
    config = json.loads(file.read_text())
    for flag, wanted in (("add_bos_token", tokens.add_bos), ("add_eos_token", tokens.add_eos)):
        if wanted is not None:
            config[flag] = wanted
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, file)


def disagreements(tokenizer, tokens: GGUFTokens) -> list[str]:
    """Where the tokenizer's behaviour differs from the GGUF's metadata (empty when they agree): whether a text
    gets BOS in front and EOS at the end, and the bos / eos ids. Checked after an import, before it is kept."""
    probe = "a"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    found = []
    if tokens.add_bos is not None and tokens.bos_id is not None:
        has = len(full) > len(plain) and full[0] == tokens.bos_id
        if has != tokens.add_bos:
            found.append(f"add_bos_token is {tokens.add_bos} in the GGUF, the tokenizer "
                         f"{'adds' if has else 'adds no'} BOS")
    if tokens.add_eos is not None and tokens.eos_id is not None:
        has = len(full) > len(plain) and full[-1] == tokens.eos_id
        if has != tokens.add_eos:
            found.append(f"add_eos_token is {tokens.add_eos} in the GGUF, the tokenizer "
                         f"{'adds' if has else 'adds no'} EOS")
    for name, wanted in (("bos", tokens.bos_id), ("eos", tokens.eos_id)):
        got = getattr(tokenizer, f"{name}_token_id")
        if wanted is not None and got != wanted:
            found.append(f"{name} id is {wanted} in the GGUF, {got} in the tokenizer")
    return found
