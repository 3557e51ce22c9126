"""DataSpec + tokenizer -> one phase's tokenised train/eval data, cached under a key of everything that
changes it (dataset content fingerprints included, so an edited local file never serves a stale cache)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_ray.config.data import DataSpec
from rlhf_ray.data import registry
from rlhf_ray.data.adapters import apply_chat_template, apply_prompt_template
from rlhf_ray.data.errors import DataError
from rlhf_ray.data.split import PHASES, blend, phase_split, stable_seed
from rlhf_ray.data.tokenized import pack, tokenize_pairs, tokenize_prompts, tokenize_sft
from rlhf_ray.data.tokens import TokenConventions

log = logging.getLogger(__name__)
CACHE_VERSION = 4  # 2: BOS prefixes and stop sets (data/tokens.py); 3: prompt rows carry dataset columns;
# 4: pair rows carry prompt_len


@dataclass
class PhaseData:
    """Tokenised samples of one phase; `report` says what was dropped or repaired and why."""

    phase: str
    train: list[dict]
    eval: list[dict]
    report: dict[str, str] = field(default_factory=dict)
    cache_file: str | None = None


def tokenizer_fingerprint(tokenizer, tokens: TokenConventions | None = None) -> str:
    """Same fingerprint, same token ids for every text: the vocabulary and merges, the special tokens and the
    chat template (and, given, the conventions: prefix and stop ids)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    specials = {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
                "template": getattr(tokenizer, "chat_template", None)}
    if tokens is not None:
        specials |= {"prefix": list(tokens.prefix_ids), "stops": list(tokens.stop_ids), "pad_id": tokens.pad_id}
    return hashlib.sha256((text + json.dumps(specials, sort_keys=True)).encode()).hexdigest()[:16]


def same_tokenizer(a, b) -> bool:
    """Both write the same ids for every text (vocabulary, merges, special tokens and chat template agree)."""
    return tokenizer_fingerprint(a) == tokenizer_fingerprint(b)


def cache_key(spec: DataSpec, phase: str, seed: int, tokenizer, tokens: TokenConventions, options: dict) -> str:
    parts = {
        "version": CACHE_VERSION, "phase": phase, "seed": seed, "options": options,
        "data": spec.model_dump(mode="json", exclude={"cache_dir"}),
        "content": [registry.fingerprint(d) for d in spec.datasets],
        "tokenizer": tokenizer_fingerprint(tokenizer, tokens),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _tokenize(phase: str, samples, tokenizer, tokens: TokenConventions, spec: DataSpec, options: dict):
    if phase == "sft":
        rows, report = tokenize_sft(samples, tokenizer, tokens, spec.max_seq_len, options["train_on_prompt"],
                                    spec.overlong)
        return (pack(rows, spec.max_seq_len) if options["packing"] else rows), report
    if phase == "rm":
        return tokenize_pairs(samples, tokenizer, tokens, spec.max_seq_len, spec.overlong)
    return tokenize_prompts(samples, tokenizer, tokens, spec.max_prompt_len)


def build_phase_data(spec: DataSpec, tokenizer, phase: str, seed: int, cache_dir: str | Path, *,
                     tokens: TokenConventions | None = None, train_on_prompt: bool = False,
                     packing: bool = False) -> PhaseData:
    """Load, split, blend and tokenise the datasets of `spec` for `phase` (sft, rm or ppo). `tokens`: the
    conventions of the model's tokenizer (default: read off the tokenizer alone, without a generation config)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    tokens = tokens or TokenConventions.from_tokenizer(tokenizer)
    options = {"train_on_prompt": train_on_prompt, "packing": packing}
    cache_file = Path(cache_dir) / f"{phase}-{cache_key(spec, phase, seed, tokenizer, tokens, options)}.pkl"
    if cache_file.is_file():
        with cache_file.open("rb") as f:
            data: PhaseData = pickle.load(f)
        log.info("%s data from cache %s: %d train / %d eval", phase, cache_file, len(data.train), len(data.eval))
        return data

    shares = spec.split_shares
    train_parts, eval_parts, report = [], [], {}
    for d in spec.datasets:
        raw = registry.load_raw(d)
        train, evaluation = phase_split(raw, shares, phase, seed, spec.eval_fraction)
        train, evaluation = (_rendered(samples, d, tokenizer) for samples in (train, evaluation))
        if not train:
            raise DataError(f"dataset {d.name}: the {phase} phase gets no training samples from split "
                            f"{spec.split!r} of {len(raw.train)} rows; give the phase a share or add data")
        train_parts.append((train, d.weight))
        eval_parts.append((evaluation, 1.0))
        if raw.dropped:
            report[f"{d.name} (read)"] = ", ".join(f"dropped {n} ({why})" for why, n in raw.dropped.items())
    train_rows, train_report = _tokenize(phase, blend(train_parts, stable_seed(seed, phase, "train")),
                                         tokenizer, tokens, spec, options)
    eval_rows, eval_report = _tokenize(phase, blend(eval_parts, stable_seed(seed, phase, "eval")),
                                       tokenizer, tokens, spec, options)
    if not train_rows:
        raise DataError(f"the {phase} training split is empty after tokenisation ({train_report.summary()}); "
                        f"raise data.max_seq_len / max_prompt_len or check the data")
    report["train"], report["eval"] = train_report.summary(), eval_report.summary()
    for split, text in report.items():
        log.info("%s data, %s: %s", phase, split, text)
    data = PhaseData(phase, train_rows, eval_rows, report, str(cache_file))
    _write_atomically(cache_file, data)
    return data


def _rendered(samples, spec, tokenizer) -> list:
    """The samples as the model sees them: through the chat template (conversations always), or re-wrapped by the
    dataset's prompt_template."""
    render = registry.uses_chat_template(spec)
    if spec.prompt_template is not None:
        return [apply_prompt_template(s, spec.prompt_template) for s in samples]
    return [apply_chat_template(s, tokenizer) if render or s.messages else s for s in samples]


def _write_atomically(path: Path, data: PhaseData) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("wb") as f:
        pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
