"""Tiny random models of the common chat-model families, built offline with each family's real config class and
special-token conventions: whether the tokenizer writes a BOS, which ids stop an answer (several for Llama 3
Instruct, Qwen, Gemma and Phi-3), whether there is a pad token and whether it is the end-of-text, tied or untied
embeddings, and a chat template in the family's style (none for the Gemma 3 base model, like the real 270M). The architecture tests train, score, sample and export
each of them, so what holds for Llama 3 or OPT does not rest on the one tiny Llama the quickstart uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_ray.models.tiny import default_corpus, write_model_folder

HIDDEN, INTERMEDIATE, LAYERS, HEADS, HEAD_DIM, VOCAB = 128, 256, 2, 2, 64, 1024

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@dataclass(frozen=True)
class Family:
    """One family's shape and token conventions, as its real checkpoints have them."""

    name: str
    architecture: str
    specials: tuple[str, ...]
    """Special tokens, in id order from 0."""
    eos: str
    """The tokenizer's eos token."""
    stops: tuple[str, ...]
    """generation_config.eos_token_id, as tokens."""
    bos: str | None = None
    adds_bos: bool = False
    """The tokenizer writes `bos` before every text (Llama, Mistral, Gemma, OPT)."""
    pad: str | None = None
    chat_template: str | None = None
    tied: bool = False


def _config(family: Family, vocab: int, ids: dict[str, int]):
    import transformers

    special = {"bos_token_id": ids.get(family.bos or ""), "eos_token_id": [ids[t] for t in family.stops],
               "pad_token_id": ids.get(family.pad or "")}
    common = dict(vocab_size=vocab, tie_word_embeddings=family.tied, max_position_embeddings=512, **special)
    llama_like = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, **common)
    name = family.architecture
    if name == "LlamaForCausalLM":
        return transformers.LlamaConfig(num_key_value_heads=1, rope_theta=500000.0, **llama_like)
    if name == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(num_key_value_heads=1, **llama_like)
    if name == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(num_key_value_heads=1, head_dim=HEAD_DIM, **llama_like)
    if name == "MistralForCausalLM":
        return transformers.MistralConfig(num_key_value_heads=1, sliding_window=None, **llama_like)
    if name == "Gemma2ForCausalLM":
        return transformers.Gemma2Config(num_key_value_heads=1, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                         sliding_window=256, **llama_like)
    if name == "Gemma3ForCausalLM":  # one sliding-window layer and one global one, as Gemma 3 alternates them
        return transformers.Gemma3TextConfig(num_key_value_heads=1, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                             sliding_window=256, layer_types=["sliding_attention", "full_attention"],
                                             **llama_like)
    if name == "Phi3ForCausalLM":
        return transformers.Phi3Config(num_key_value_heads=HEADS, **llama_like)
    if name == "OPTForCausalLM":
        return transformers.OPTConfig(hidden_size=HIDDEN, ffn_dim=INTERMEDIATE, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN,
                                      do_layer_norm_before=True, **common)
    if name == "GPT2LMHeadModel":
        return transformers.GPT2Config(n_embd=HIDDEN, n_inner=INTERMEDIATE, n_layer=LAYERS, n_head=HEADS,
                                       n_positions=512, vocab_size=vocab, tie_word_embeddings=family.tied, **special)
    raise ValueError(f"no tiny config for {name}")


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama3", "LlamaForCausalLM",
           ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|eom_id|>"),
           eos="<|eot_id|>", stops=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), bos="<|begin_of_text|>",
           adds_bos=True, chat_template=LLAMA3_TEMPLATE),
    Family("qwen2", "Qwen2ForCausalLM", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), eos="<|im_end|>",
           stops=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>", chat_template=CHATML_TEMPLATE, tied=True),
    Family("qwen3", "Qwen3ForCausalLM", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), eos="<|im_end|>",
           stops=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>", chat_template=CHATML_TEMPLATE, tied=True),
    Family("mistral", "MistralForCausalLM", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), eos="</s>",
           stops=("</s>",), bos="<s>", adds_bos=True, chat_template=MISTRAL_TEMPLATE),
    Family("gemma2", "Gemma2ForCausalLM", ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
           eos="<eos>", stops=("<eos>", "<end_of_turn>"), bos="<bos>", adds_bos=True, pad="<pad>",
           chat_template=GEMMA_TEMPLATE, tied=True),
    Family("gemma3", "Gemma3ForCausalLM", ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
           eos="<eos>", stops=("<eos>",), bos="<bos>", adds_bos=True, pad="<pad>", tied=True),  # a base model
    Family("phi3", "Phi3ForCausalLM", ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"),
           eos="<|endoftext|>", stops=("<|endoftext|>", "<|assistant|>", "<|end|>"), bos="<s>",
           pad="<|endoftext|>", chat_template=PHI3_TEMPLATE),
    Family("opt", "OPTForCausalLM", ("<s>", "<pad>", "</s>", "<unk>"), eos="</s>", stops=("</s>",), bos="</s>",
           adds_bos=True, pad="<pad>", tied=True),
    Family("gpt2", "GPT2LMHeadModel", ("<|endoftext|>",), eos="<|endoftext|>", stops=("<|endoftext|>",),
           bos="<|endoftext|>", tied=True),
)}


def family_tokenizer(family: Family, vocab_size: int = VOCAB):
    """A byte-level BPE trained on the bundled corpus, with the family's special tokens, BOS rule and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(family.specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(default_corpus(), trainer=trainer)
    if family.adds_bos:
        bos_id = tok.token_to_id(family.bos)
        tok.post_processor = processors.TemplateProcessing(single=f"{family.bos} $A", pair=f"{family.bos} $A $B",
                                                           special_tokens=[(family.bos, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=family.eos, bos_token=family.bos,
                                   pad_token=family.pad, model_max_length=512)
    if family.chat_template:
        fast.chat_template = family.chat_template
    return fast


def build_family_model(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny random `name` model (see FAMILIES) and its tokenizer, saved in HF format with a generation config
    listing the family's stop ids. Written beside `out_dir` and renamed into place."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    family = FAMILIES[name]
    tokenizer = family_tokenizer(family)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in family.specials}
    config = _config(family, len(tokenizer), ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=ids.get(family.bos or ""),
                                               eos_token_id=[ids[t] for t in family.stops],
                                               pad_token_id=ids.get(family.pad or ""))
    return write_model_folder(model, tokenizer, Path(out_dir))
