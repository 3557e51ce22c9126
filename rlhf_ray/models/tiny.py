"""Tiny Llama models with a byte-level BPE tokenizer, built offline: what tests, the quickstart and benchmarks
train, since no model hub is reachable. head_dim stays >= 32 because vLLM's CPU attention rejects smaller."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

EOS, PAD, UNK = "<|endoftext|>", "<|pad|>", "<|unk|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ ' Human: ' + message['content'] + ' Assistant:' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + '" + EOS + "' }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position_embeddings: int = 1024

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.hidden_size // self.num_heads < 32:
            raise ValueError(f"head_dim {self.hidden_size // self.num_heads} < 32: vLLM's CPU attention rejects it")


TINY = TinyModelSpec(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=2, vocab_size=1024)
SMALL = TinyModelSpec(hidden_size=512, intermediate_size=1376, num_layers=8, num_heads=8, num_kv_heads=8,
                      vocab_size=4096)
PRESETS = {"tiny": TINY, "small": SMALL}


def default_corpus() -> list[str]:
    text = resources.files("rlhf_ray.assets").joinpath("tokenizer_corpus.txt").read_text()
    return [line for line in text.splitlines() if line.strip()]


def train_tokenizer(texts: Iterable[str], vocab_size: int, max_length: int = 1024):
    """Deterministic byte-level BPE: any text encodes, decode(encode(x)) == x, and end-of-text is one token with
    a pad token distinct from it. Nothing is added automatically: callers append end-of-text themselves."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD, UNK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, padding_side="right", model_max_length=max_length)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, corpus: Iterable[str] | None = None,
                     overwrite: bool = False) -> Path:
    """Train the tokenizer, initialise a Llama with `seed`, save both in HF format. Built in a temporary folder
    beside `out_dir` and renamed into place, so a crash never leaves half a model."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; pass overwrite=True (--overwrite) to replace it")
    tokenizer = train_tokenizer(corpus if corpus is not None else default_corpus(), spec.vocab_size,
                                spec.max_position_embeddings)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                         max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return write_model_folder(model, tokenizer, out)


def write_model_folder(model, tokenizer, out: Path, finish: Callable[[Path], None] | None = None) -> Path:
    """Save an HF model and its tokenizer into `out`, written in a temporary folder beside it and renamed into
    place, so a crash never leaves half a model (an existing `out` is replaced). `finish(folder)` may edit the
    written files before the rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if finish is not None:
            finish(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main_init_model(out: str, preset: str, seed: int, overwrite: bool) -> Path:
    return build_tiny_model(out, preset=preset, seed=seed, overwrite=overwrite)
