"""Hugging Face models and tokenizers from a ModelSpec: causal LMs for policy/reference, and scalar-head models
(reward model, critic) that score every token and are saved and loaded in plain HF format."""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from rlhf_ray.config.model import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ModelLoadError(ValueError):
    """A model or tokenizer could not be found or read; the message names the path and what to check."""


def load_tokenizer(spec: ModelSpec):
    """The tokenizer; loaded first by every job, so a wrong model path fails before any actor starts."""
    if spec.tokenizer_path is None:
        raise ModelLoadError("model.path (or model.tokenizer) is not set")
    try:
        return AutoTokenizer.from_pretrained(spec.tokenizer_path, trust_remote_code=spec.trust_remote_code,
                                             revision=spec.revision)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {spec.tokenizer_path!r}: it is not a local HF model "
                             f"folder and could not be fetched from the hub ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0]})") from exc


def _common(spec: ModelSpec) -> dict:
    return {"dtype": DTYPES[spec.dtype], "trust_remote_code": spec.trust_remote_code, "revision": spec.revision,
            "use_safetensors": None if spec.allow_pickle_weights else True}


def disable_dropout(model: torch.nn.Module) -> None:
    """Log-probs and values must be deterministic functions of the weights (DeepSpeed-Chat's --disable_dropout)."""
    rates = ("dropout", "attention_dropout", "activation_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
             "attn_pdrop", "layerdrop")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for key in rates:  # layers that copied a rate at construction and call F.dropout with it (OPT's layers)
            if type(getattr(module, key, None)) is float:
                setattr(module, key, 0.0)
    for key in rates:
        if hasattr(model.config, key):
            setattr(model.config, key, 0.0)


@functools.lru_cache(maxsize=None)
def _forward_parameters(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def _keeps_logits(cls: type) -> bool:
    return "logits_to_keep" in _forward_parameters(cls)


def last_logits_only(model: torch.nn.Module, n: int) -> dict:
    """Forward kwargs that make a causal LM compute logits for its last `n` positions only (transformers'
    `logits_to_keep`), where the model supports it: scoring answers then skips the vocabulary projection and its
    [B, L, V] tensor over the prompt, a large share of a small model's forward (SmolLM2: 49k-token vocabulary)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper passes kwargs on
    return {"logits_to_keep": n} if _keeps_logits(type(base)) else {}


def mask_positions(model: torch.nn.Module, attention_mask: torch.Tensor) -> dict:
    """Forward kwargs giving each token its position within its own row (pads skipped: a left-padded prompt starts
    at 0), as the engines number them; where the model takes position ids. Models with absolute position
    embeddings (GPT-2) otherwise count the pads; rotary ones are unchanged by the shift."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "position_ids" not in _forward_parameters(type(base)):
        return {}
    return {"position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0)}


def logits_at(model: torch.nn.Module, positions: torch.Tensor) -> dict:
    """Forward kwargs that make a causal LM compute logits at `positions` (1-D) only, where the model supports it;
    {} otherwise (then it computes them at every position)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"logits_to_keep": positions} if _keeps_logits(type(base)) else {}


def load_causal_lm(spec: ModelSpec) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(spec.path, **_common(spec))
    if spec.disable_dropout:
        disable_dropout(model)
    return model


def load_scalar_model(spec: ModelSpec, pad_token_id: int) -> PreTrainedModel:
    """A backbone with a one-output linear head (HF's *ForSequenceClassification, num_labels=1). From a causal-LM
    checkpoint the head starts fresh; from a saved reward model it is loaded with it."""
    model = AutoModelForSequenceClassification.from_pretrained(spec.path, num_labels=1, pad_token_id=pad_token_id,
                                                               **_common(spec))
    if spec.disable_dropout:
        disable_dropout(model)
    return model


def scalar_head(model: PreTrainedModel) -> torch.nn.Module:
    for name in ("score", "classifier", "v_head"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise TypeError(f"{type(model).__name__} has no scalar head (score / classifier)")


def token_values(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 forward=None) -> torch.Tensor:
    """The head applied at every position: [B, T]. Rewards read it at the last real token; critics use it all.

    Runs the root module's forward (`forward`: the DeepSpeed engine wrapping `model`, else the model), which
    applies the head at every position before pooling the last one, and keeps the head's per-position output: a
    ZeRO-3 engine's parameter prefetch is driven by the root module's forward, which calling the backbone directly
    would skip (every all-gather then runs in series with compute)."""
    return head_values(model, lambda: (forward or model)(input_ids=input_ids, attention_mask=attention_mask,
                                                         **mask_positions(model, attention_mask)))


def head_values(model: PreTrainedModel, run) -> torch.Tensor:
    """The scalar head's output at every position [B, T] of the forward `run()` runs."""
    captured: list[torch.Tensor] = []
    handle = scalar_head(model).register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        run()
    finally:
        handle.remove()
    return captured[-1].squeeze(-1).float()

