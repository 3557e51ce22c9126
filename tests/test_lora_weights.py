"""LoRA weights for the engines (models/lora_weights.py): folding adapters into the base weights equals peft's own
merge, on a Llama-style model and on GPT-2 (Conv1D layers store weights transposed: fan_in_fan_out); a scalar head
trains with the adapters."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from rlhf_ray.config.model import ModelSpec
from rlhf_ray.learners.deepspeed_setup import apply_lora
from rlhf_ray.models.lora_weights import folded, units


def with_trained_adapters(model, targets, **kwargs):
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, **kwargs))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # B starts at zero: give the adapters something to fold
    return peft_model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_folded_weights_equal_peft_merge_under_base_names(family):
    if family == "llama":
        base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))
        model = with_trained_adapters(base, ["q_proj", "v_proj", "down_proj"])
    else:
        base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4))
        model = with_trained_adapters(base, ["c_attn"], fan_in_fan_out=True)
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    groups = units([n for n, _ in named])
    assert all(len({n.split(".lora_")[0].split(".base_layer")[0] for n in g}) == 1 for g in groups)
    assert any(len(g) >= 3 for g in groups)  # a base weight (and bias) and its two adapter matrices travel together
    ours = dict(folded(model, named))
    merged = model.merge_and_unload().state_dict()
    expected = {k: v for k, v in merged.items() if k in dict(base.named_parameters())}
    assert set(ours) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-6, atol=1e-6, msg=key)


def test_embedding_adapters_are_refused_naming_the_module():
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2))
    model = with_trained_adapters(base, ["embed_tokens"])
    with pytest.raises(ValueError, match="model.embed_tokens is a Embedding"):
        folded(model, [(n, p.detach()) for n, p in model.named_parameters()])


def test_a_scalar_models_head_trains_with_the_adapters():
    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=4,
                                                       num_key_value_heads=2, num_labels=1, pad_token_id=0))
    spec = ModelSpec(path="unused", lora={"rank": 4, "target_modules": ["q_proj"]})
    trainable = {n for n, p in apply_lora(model, spec).named_parameters() if p.requires_grad}
    assert any("score" in n for n in trainable) and any("lora_A" in n for n in trainable)
    assert not any("embed_tokens" in n or "o_proj" in n for n in trainable)
