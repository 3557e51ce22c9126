"""Small GGUF files written by the `gguf` package, for import tests that need no download: a random model of a few
thousand parameters and a tokenizer whose special-token metadata (add BOS / EOS, stop ids, chat templates,
sampling defaults) the test chooses.

Two shapes: `llama` with a byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`, as SmolLM2, Llama 3 and Qwen
GGUFs have), and `gemma3` with a SentencePiece vocabulary (`llama`, as the real Gemma 3 270M GGUF has)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 2, 1, 16, 64, 1


@dataclass
class GGUFSpec:
    arch: str = "llama"
    add_bos: bool | None = True
    add_eos: bool | None = None
    chat_template: str | None = None
    named_templates: dict[str, str] = field(default_factory=dict)
    eot: bool = False
    eom: bool = False
    sampling: dict[str, float] = field(default_factory=dict)


SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<eot>", "<eom>"]
PAD, EOS, BOS, UNK, EOT, EOM = range(len(SPECIALS))


def _byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    tokens = SPECIALS + alphabet + ["hi", "Ġt"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, ["h i", "Ġ t"]


def _sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    pieces = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["▁a", "▁t", "hi", "▁hi"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    tokens = SPECIALS + pieces
    types = [3, 3, 3, 2, 3, 3] + [1] * (len(pieces) - 256) + [6] * 256
    return tokens, types, [0.0] * len(tokens)


def write_tiny_gguf(path: Path, spec: GGUFSpec, seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    if spec.arch == "llama":
        tokens, types, merges = _byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_merges(merges)
    elif spec.arch == "gemma3":
        tokens, types, scores = _sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_scores(scores)
        writer.add_add_space_prefix(False)
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_sliding_window(16)
    else:
        raise ValueError(spec.arch)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(PAD)
    writer.add_unk_token_id(UNK)
    if spec.eot:
        writer.add_eot_token_id(EOT)
    if spec.eom:
        writer.add_eom_token_id(EOM)
    if spec.add_bos is not None:
        writer.add_add_bos_token(spec.add_bos)
    if spec.add_eos is not None:
        writer.add_add_eos_token(spec.add_eos)
    if spec.chat_template is not None or spec.named_templates:
        templates = ([{"name": "default", "template": spec.chat_template}] if spec.chat_template else [])
        templates += [{"name": name, "template": text} for name, text in spec.named_templates.items()]
        writer.add_chat_template(templates if spec.named_templates else spec.chat_template)
    for key, value in spec.sampling.items():
        getattr(writer, f"add_sampling_{key}")(value)

    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if spec.arch == "llama":
        writer.add_rope_dimension_count(HEAD_DIM)
        writer.add_vocab_size(len(tokens))

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    writer.add_tensor("token_embd.weight", weight(len(tokens), HIDDEN))
    for i in range(LAYERS):
        block = f"blk.{i}"
        writer.add_tensor(f"{block}.attn_norm.weight", ones(HIDDEN))
        writer.add_tensor(f"{block}.attn_q.weight", weight(HEADS * HEAD_DIM, HIDDEN))
        writer.add_tensor(f"{block}.attn_k.weight", weight(KV_HEADS * HEAD_DIM, HIDDEN))
        writer.add_tensor(f"{block}.attn_v.weight", weight(KV_HEADS * HEAD_DIM, HIDDEN))
        writer.add_tensor(f"{block}.attn_output.weight", weight(HIDDEN, HEADS * HEAD_DIM))
        writer.add_tensor(f"{block}.ffn_norm.weight", ones(HIDDEN))
        writer.add_tensor(f"{block}.ffn_gate.weight", weight(FFN, HIDDEN))
        writer.add_tensor(f"{block}.ffn_up.weight", weight(FFN, HIDDEN))
        writer.add_tensor(f"{block}.ffn_down.weight", weight(HIDDEN, FFN))
        if spec.arch == "gemma3":
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"{block}.{norm}.weight", ones(HEAD_DIM))
            for norm in ("post_attention_norm", "post_ffw_norm"):
                writer.add_tensor(f"{block}.{norm}.weight", ones(HIDDEN))
    writer.add_tensor("output_norm.weight", ones(HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
