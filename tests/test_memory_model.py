"""The memory model's arithmetic: model shapes from config.json and the table, DeepSpeed's own ZeRO estimator
for model states, and how activations and logits scale."""

from __future__ import annotations

import json

import pytest

from rlhf_ray.memory.estimate import activation_bytes, learner_bytes, logits_bytes, model_states
from rlhf_ray.memory.shapes import KNOWN, ModelShape, shape_of


def test_the_shape_of_a_local_model_counts_its_parameters(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    real = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())  # tied weights once
    assert shape_of(str(tiny_model)).params == real


@pytest.mark.parametrize("name, published", [("meta-llama/Llama-3.1-8B-Instruct", 8_030_261_248),
                                             ("meta-llama/Llama-3.1-70B-Instruct", 70_553_706_496),
                                             ("HuggingFaceTB/SmolLM2-135M-Instruct", 134_515_008)])
def test_hub_ids_of_the_table_are_sized_without_the_files(name, published):
    assert shape_of(name).params == published  # the parameter counts their model cards give


def test_opt_and_gpt2_spellings_of_config_json_are_understood(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "opt", "hidden_size": 64, "num_hidden_layers": 2,
                                                      "num_attention_heads": 4, "ffn_dim": 256, "vocab_size": 100}))
    opt = shape_of(str(tmp_path))
    assert not opt.gated_mlp and opt.params == 100 * 64 + 2 * (4 * 64 * 64 + 2 * 64 * 256 + 2 * 64) + 64
    gpt2 = ModelShape.from_config({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100})
    assert gpt2.intermediate == 256 and gpt2.params == opt.params
    assert shape_of(str(tmp_path / "missing")) is None and shape_of("someone/unknown-model") is None


@pytest.mark.parametrize("ranks", [1, 2, 8])
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_model_states_equal_deepspeeds_estimator(ranks, offload):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    params = KNOWN["meta-llama/Llama-3.1-8B"].params
    _, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=ranks, cpu_offload=offload)
    ours = model_states(params, "bf16", zero_stage=2, ranks=ranks, offload_optimizer=offload)
    assert ours.device == pytest.approx(gpu, rel=1e-6)


def test_each_zero_stage_shards_more_and_fp32_has_no_master_copy():
    params, largest = 10**9, 10**8
    by_stage = [model_states(params, "bf16", stage, ranks=4, largest_module=largest).device for stage in range(4)]
    assert by_stage == sorted(by_stage, reverse=True) and len(set(by_stage)) == 4
    assert by_stage[0] == 20 * params  # 2 weights + 2 + 4 gradients + 12 Adam with master weights
    assert model_states(params, "fp32", 0, ranks=1).device == 16 * params  # 4 + 4 + 8
    lora = model_states(params, "bf16", 0, ranks=1, trainable=params // 100)
    assert lora.device == 2 * params + 18 * (params // 100)


def test_activations_grow_with_tokens_and_checkpointing_keeps_one_layer():
    shape = KNOWN["meta-llama/Llama-3.1-8B"]
    full = activation_bytes(shape, "bf16", micro_batch=4, seq_len=1024, gradient_checkpointing=False,
                            attention_scores=False)
    assert activation_bytes(shape, "bf16", 8, 1024, False, False) == 2 * full
    checkpointed = activation_bytes(shape, "bf16", 4, 1024, True, False)
    assert checkpointed < full / 5
    assert checkpointed == 2 * 4 * 1024 * shape.hidden * shape.layers + full // shape.layers
    scores = activation_bytes(shape, "bf16", 4, 1024, False, True) - full
    assert scores == 2 * 2 * shape.heads * 1024 * 4 * 1024 * shape.layers  # quadratic in the sequence


def test_the_logit_working_set_is_the_vocabulary_times_the_positions():
    shape = KNOWN["meta-llama/Llama-3.1-8B"]
    # 8 sequences x 1k answer positions x 128k vocabulary x fp32 = 4 GiB per copy, 3 copies in training
    assert logits_bytes(shape, 8, 1024, training=True) == 3 * 4 * 8 * 1024 * 128256
    lm = learner_bytes(shape, dtype="bf16", zero_stage=3, ranks=2, micro_batch=8, seq_len=2048, logit_positions=1024,
                       gradient_checkpointing=True, attention_scores=False)
    critic = learner_bytes(shape, dtype="bf16", zero_stage=3, ranks=2, micro_batch=8, seq_len=2048,
                           logit_positions=1024, gradient_checkpointing=True, attention_scores=False, scalar_head=True)
    assert lm.logits > 0 and critic.logits == 0 and critic.weights < lm.weights
