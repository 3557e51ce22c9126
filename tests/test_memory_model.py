"""The memory model's arithmetic: model shapes from config.json and the table, DeepSpeed's own ZeRO estimator
for model states, and how activations and logits scale."""

from __future__ import annotations

import json
import re

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
    # ZeRO-Offload exists from stage 1 up: at stage 0 nothing moves to the host (validate refuses the combination;
    # the model must not call an 8B ZeRO-0 policy "fitting" because of it)
    stage0 = model_states(params, "bf16", 0, ranks=1, offload_optimizer=True)
    assert stage0 == model_states(params, "bf16", 0, ranks=1) and stage0.host == 0
    assert model_states(params, "bf16", 1, ranks=1, offload_optimizer=True).host == 18 * params


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


def _check(path, *overrides):
    from rlhf_ray.config import load_job
    from rlhf_ray.memory.budget import check_memory
    from rlhf_ray.plan import ResourcePlan, nodes_from_shape
    from tests.conftest import ROOT

    job = load_job(ROOT / path, list(overrides))
    table, problems = check_memory(job, ResourcePlan.from_roles(job.placement_roles()), nodes_from_shape(job.cluster.shape))
    return job, problems


def test_a_gpu_plan_over_its_share_of_the_device_is_refused_naming_group_roles_and_bytes():
    """The 8B recipe as it shipped before the memory model: ZeRO-3 over 2 ranks without offload keeps ~75 GiB of
    model states per GPU, plus the colocated reference."""
    recipe = "configs/recipes/llama-8b-8gpu.yaml"
    _, problems = _check(recipe)
    assert problems == []
    old = [f"{role}.deepspeed.offload_optimizer=false" for role in ("policy", "critic")] + [
        "policy.micro_batch_size=8", "critic.micro_batch_size=8"]
    _, problems = _check(recipe, *old)
    assert len(problems) == 2, problems
    policy = next(p for p in problems if p.startswith("placement group `policy` (policy + reference) needs "))
    assert "holds 1 of a 80.0 GiB GPU = 80.0 GiB" in policy and "GiB over" in policy
    assert "deepspeed.offload_optimizer" in policy  # what to change
    _, problems = _check(recipe, "cluster.shape=[{cpus: 96, gpus: 8, gpu_memory_gb: 141}]", *old)
    assert problems == []  # the same plan on 141 GB GPUs


def test_a_vllm_engine_needs_a_share_as_large_as_its_memory_utilization():
    _, problems = _check("configs/recipes/llama-8b-8gpu.yaml", "generation.placement.num_gpus=0.5",
                         "generation.placement.replicas=8")
    assert any(p.startswith("placement group `generation` (generation) needs 68.0 GiB") for p in problems), problems


def test_pipeline_stages_size_the_models_earlier_stages_write(capsys):
    from rlhf_ray.cli import main
    from tests.conftest import ROOT

    assert main(["validate", "--quiet", "--config-only", str(ROOT / "configs/recipes/smollm2-pipeline.yaml")]) == 0
    printed = capsys.readouterr().out
    assert "memory per replica" in printed and "unknown" not in printed  # RM and PPO roles sized from the SFT model


def test_cpu_roles_must_fit_the_hosts_memory():
    recipe = "configs/recipes/smollm2-ppo.yaml"
    _, problems = _check(recipe, "cluster.shape=[{cpus: 2, memory_gb: 24}]")
    assert problems == []
    _, problems = _check(recipe, "cluster.shape=[{cpus: 2, memory_gb: 8}]")
    assert len(problems) == 1 and problems[0].startswith("CPU roles and offloaded state need ")
    assert "the cluster has 8.0 GiB" in problems[0] and "micro_batch_size" in problems[0]


def test_fp32_zero_stages_keep_deepspeeds_copies_and_the_gradient_bucket_counts():
    """Calibrated against measured peaks (benchmarks/bench_memory_model.py): from ZeRO-1 on DeepSpeed clones the
    rank's partition as an fp32 master and flattens each step's gradient partition, also in fp32 training; the
    gradient bucket is reserved whole on a GPU and filled only as far as the gradients go on a CPU."""
    from rlhf_ray.memory.estimate import gradient_bucket

    p = 10**8
    assert model_states(p, "fp32", 2, ranks=1).device == 24 * p  # 4 weights + 4 grads + 4 flattened + 4 master + 8 Adam
    assert model_states(p, "fp32", 2, ranks=2).device == 14 * p  # 4 weights + (4 + 4 + 4 + 8) / 2
    assert model_states(p, "fp32", 0, ranks=1).device == 16 * p  # ZeRO-0 in fp32: no copies
    assert model_states(p, "fp32", 2, ranks=1, grad_bucket=p).gradients == 12 * p
    bucket = 5 * 10**8
    assert gradient_bucket(p, 2, 2, bucket, on_gpu=True, overlap_comm=False) == bucket
    assert gradient_bucket(p, 2, 2, bucket, on_gpu=True, overlap_comm=True) == 2 * bucket
    assert gradient_bucket(p, 3, 2, bucket, on_gpu=True, overlap_comm=True) == bucket  # stage 3: one buffer
    assert gradient_bucket(p, 2, 2, bucket, on_gpu=False, overlap_comm=False) == p  # touched pages only
    assert gradient_bucket(p, 0, 1, bucket, on_gpu=True, overlap_comm=False) == 0  # one rank reduces nothing
    assert gradient_bucket(p, 0, 2, bucket, on_gpu=True, overlap_comm=False) == p  # all-reduce flattening


def test_a_cpu_tensor_parallel_engine_holds_the_whole_model_and_cache_once():
    """On CPU a tensor-parallel engine's workers share one bundle's host memory: the shards add up to the model, and
    kv_cache_gb is the engine's (split among its workers), not each worker's."""
    from rlhf_ray.memory.estimate import engine_bytes

    shape = KNOWN["meta-llama/Llama-3.1-8B"]
    one, two = (engine_bytes(shape, dtype="bf16", device_bytes=None, gpu_memory_utilization=0.9, kv_cache_gb=2,
                             tensor_parallel=tp) for tp in (1, 2))
    # bf16 weights, held twice on CPU (vLLM re-lays them for its CPU kernels)
    assert one == two and one.weights == 2 * 2 * shape.params and one.kv_cache == 2 * 2**30
    gpu = engine_bytes(shape, dtype="bf16", device_bytes=80 * 2**30, gpu_memory_utilization=0.9, kv_cache_gb=2,
                       tensor_parallel=2)
    assert gpu.weights == shape.params  # per GPU


def test_lora_trainable_parameters_equal_pefts_count_and_shrink_the_learner():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_ray.config.deepspeed import DeepSpeedSpec
    from rlhf_ray.config.model import ModelSpec
    from rlhf_ray.memory.budget import learner_memory
    from rlhf_ray.memory.shapes import ModelShape

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    shape = ModelShape(hidden=64, layers=3, heads=4, kv_heads=2, intermediate=160, vocab=128, tied_embeddings=False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert shape.lora_params(8, targets) == trainable
    full = ModelSpec(path="x", dtype="bf16")
    lora = ModelSpec(path="x", dtype="bf16", lora={"rank": 8, "target_modules": targets})
    sizes = [learner_memory(KNOWN["meta-llama/Llama-3.1-8B"], spec, DeepSpeedSpec(zero_stage=0), 1, 1, 512, 512,
                            True, False) for spec in (full, lora)]
    assert sizes[1].device < 0.25 * sizes[0].device  # no gradients or Adam state for the frozen base


def test_the_plan_and_memory_tables_read_at_80_columns_in_a_log(capsys):
    """validate's output piped (a CI log, `ray job logs`): no table line is wider than 80 columns, role names are
    whole, and each role's assumptions are written below the memory table, not squeezed into a column."""
    from rlhf_ray.cli import main
    from tests.conftest import ROOT

    assert main(["validate", str(ROOT / "configs/recipes/llama-8b-8gpu.yaml"), "--quiet", "--config-only"]) == 0
    lines = capsys.readouterr().out.splitlines()
    tables = lines[: next(i for i, line in enumerate(lines) if line.startswith("checked against"))]
    assert max(len(line.rstrip()) for line in tables) <= 80, "\n".join(tables)
    rows = {line.split()[0]: line for line in tables if line.split() and line.split()[0] in
            ("policy", "reference", "critic", "reward", "generation")}
    assert set(rows) == {"policy", "reference", "critic", "reward", "generation"}
    assert len(rows["generation"].split()) == 9  # the role and its 8 numbers, one line
    assert "assumed:" in tables and "  policy: 8.03B bf16, ZeRO-3 over 2, micro-batch 4 x 2048 tokens, checkpointed" \
        in tables
    assert any(re.match(r"generation +generation: CPU 8, GPU 1", line) for line in tables)
