"""A model's shape, as much of it as memory depends on: parameter count, largest module, hidden size, layers,
attention heads, vocabulary. Read from an HF `config.json` (a local folder, or the hub cache), or taken from a small
table of well-known models so that `rlhf-ray validate` can size a 70B recipe on a laptop with no network."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GATED_MLP = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo", "olmo2",
             "granite", "smollm3", "cohere")
"""Architectures whose MLP has three matrices (gate, up, down: SwiGLU / GeGLU) instead of two."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    gated_mlp: bool = True
    head_dim: int | None = None

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """One decoder layer: attention (q, k, v, o) + MLP + two norms."""
        q_out, kv_out = self.heads * self.dim_per_head, self.kv_heads * self.dim_per_head
        attention = self.hidden * q_out + 2 * self.hidden * kv_out + q_out * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return attention + mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Total parameters of the causal LM (a scalar head instead of the LM head differs by < 1 vocab row)."""
        heads = 1 if self.tied_embeddings else 2
        return heads * self.embedding_params + self.layers * self.layer_params + self.hidden

    @property
    def backbone_params(self) -> int:
        """Without the LM head: what a reward model or critic (one-output head) holds."""
        return self.embedding_params + self.layers * self.layer_params + self.hidden

    @property
    def largest_module_params(self) -> int:
        """The biggest single parameter tensor (ZeRO-3 gathers at least this much at once): the embedding."""
        return max(self.embedding_params, self.hidden * self.intermediate)

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters of rank-`rank` LoRA on the named linear layers of every decoder layer: r x (in + out)
        each. Names the shape does not know (another architecture's) count as hidden x hidden layers."""
        q_out, kv_out = self.heads * self.dim_per_head, self.kv_heads * self.dim_per_head
        dims = {"q_proj": (self.hidden, q_out), "k_proj": (self.hidden, kv_out), "v_proj": (self.hidden, kv_out),
                "o_proj": (q_out, self.hidden), "gate_proj": (self.hidden, self.intermediate),
                "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden)}
        per_layer = sum(rank * sum(dims.get(name, (self.hidden, self.hidden))) for name in targets)
        return self.layers * per_layer

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token (the KV cache's unit)."""
        return 2 * self.layers * self.kv_heads * self.dim_per_head * dtype_bytes

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """From an HF config dict (Llama-like names, with OPT / GPT-2 / GPT-NeoX spellings understood)."""
        def get(*names, default=None):
            for n in names:
                if config.get(n) is not None:
                    return config[n]
            if default is not None:
                return default
            raise KeyError(f"config.json has none of {names}")

        text = config.get("text_config") or {}
        if text and "hidden_size" not in config:  # a multimodal wrapper: the language model's shape
            return cls.from_config({**text, "model_type": text.get("model_type", config.get("model_type"))})
        hidden = int(get("hidden_size", "n_embd", "d_model"))
        heads = int(get("num_attention_heads", "n_head"))
        return cls(hidden=hidden, layers=int(get("num_hidden_layers", "n_layer")), heads=heads,
                   kv_heads=int(get("num_key_value_heads", default=heads)),
                   intermediate=int(get("intermediate_size", "ffn_dim", "n_inner", default=4 * hidden)),
                   vocab=int(get("vocab_size")), tied_embeddings=bool(config.get("tie_word_embeddings", True)),
                   gated_mlp=str(config.get("model_type", "llama")) in GATED_MLP,
                   head_dim=config.get("head_dim"))


def _llama(hidden, layers, heads, kv, inter, vocab, tied):
    return ModelShape(hidden, layers, heads, kv, inter, vocab, tied)


KNOWN: dict[str, ModelShape] = {
    # Public config.json numbers, for sizing recipes without the files.
    "meta-llama/Llama-3.1-8B": _llama(4096, 32, 32, 8, 14336, 128256, False),
    "meta-llama/Llama-3.1-70B": _llama(8192, 80, 64, 8, 28672, 128256, False),
    "meta-llama/Llama-3.2-1B": _llama(2048, 16, 32, 8, 8192, 128256, True),
    "meta-llama/Llama-3.2-3B": _llama(3072, 28, 24, 8, 8192, 128256, True),
    "mistralai/Mistral-7B-v0.1": _llama(4096, 32, 32, 8, 14336, 32000, False),
    "Qwen/Qwen2.5-0.5B": _llama(896, 24, 14, 2, 4864, 151936, True),
    "Qwen/Qwen2.5-7B": _llama(3584, 28, 28, 4, 18944, 152064, False),
    "HuggingFaceTB/SmolLM2-135M": _llama(576, 30, 9, 3, 1536, 49152, True),
    "google/gemma-3-270m": ModelShape(640, 18, 4, 1, 2048, 262144, True, head_dim=256),
    "facebook/opt-350m": ModelShape(1024, 24, 16, 16, 4096, 50272, True, gated_mlp=False),
    "facebook/opt-1.3b": ModelShape(2048, 24, 32, 32, 8192, 50272, True, gated_mlp=False),
}


def known_shape(name: str) -> ModelShape | None:
    """A hub id of the table, its -Instruct / -Chat variants included (same shape)."""
    base = name
    for suffix in ("-Instruct", "-instruct", "-Chat", "-chat", "-Instruct-v0.1", "-Instruct-v0.2", "-it"):
        base = base.removesuffix(suffix)
    return KNOWN.get(base)


def shape_of(path: str | None) -> ModelShape | None:
    """The shape of a model folder or hub id: its config.json (local, or in the hub cache), else the table;
    None when neither knows it."""
    if not path:
        return None
    config = Path(path) / "config.json"
    if not config.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
            config = Path(cached) if isinstance(cached, str) else config
        except Exception:  # not a hub id, or no huggingface_hub: fall back to the table
            pass
    if config.is_file():
        try:
            return ModelShape.from_config(json.loads(config.read_text()))
        except (ValueError, KeyError, TypeError):
            return known_shape(path)
    return known_shape(path)
