"""Config models and the YAML loader: defaults, cross-field checks, and errors that name file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_ray.cli import EXIT_BAD_CONFIG, EXIT_OK, EXIT_PLAN_DOES_NOT_FIT, main
from rlhf_ray.config.pipeline_job import ANSWERS_FILE, ANSWERS_FORMAT
from rlhf_ray.config import (ConfigError, DeepSpeedSpec, FINAL_MODEL_DIR, PipelineJob, PPOJob, SFTJob, load_job,
                             job_schema)
from tests.conftest import ROOT

SFT = """\
kind: sft
output_dir: out/sft
model:
  path: some/model
  dtype: fp32
train:
  micro_batch_size: 4
  global_batch_size: 16
deepspeed:
  gradient_accumulation_steps: 2
placement:
  replicas: 2
"""

PPO = """\
kind: ppo
policy:
  model: {path: sft/model}
  micro_batch_size: 4
critic:
  micro_batch_size: 4
reward:
  model: {path: rm/model}
ppo:
  rollout_batch_size: 8
"""


def problems_of(path, overrides=(), expect=None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_job(path, list(overrides), expect=expect)
    return info.value.problems


def test_valid_sft_config_loads_with_defaults(write_yaml):
    job = load_job(write_yaml(SFT))
    assert isinstance(job, SFTJob)
    assert job.global_batch_size == 16
    assert job.deepspeed.zero_stage == 2  # DeepSpeed-Chat's default stage
    assert job.model.trust_remote_code is False


def test_unknown_key_names_file_line_and_suggests_the_closest_key(write_yaml):
    path = write_yaml(SFT.replace("micro_batch_size: 4", "micro_bach_size: 4"))
    (problem,) = [p for p in problems_of(path) if "micro_bach_size" in p]
    assert problem.startswith(f"{path}:7: train.micro_bach_size:")
    assert "did you mean 'micro_batch_size'?" in problem


def test_save_optimizer_which_never_took_effect_is_refused_at_its_line(write_yaml):
    path = write_yaml(SFT + "checkpoint:\n  every_steps: 10\n  save_optimizer: false\n")
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:15: checkpoint.save_optimizer: no longer a setting"), problem
    assert "always holds the optimizer and scheduler state" in problem


def test_unknown_top_level_section_lists_close_match(write_yaml):
    path = write_yaml(SFT + "deepspeeed:\n  zero_stage: 3\n")
    (problem,) = problems_of(path)
    assert f"{path}:13: deepspeeed:" in problem and "'deepspeed'" in problem


def test_wrong_type_names_the_field_and_the_value(write_yaml):
    path = write_yaml(SFT.replace("replicas: 2", "replicas: two"))
    (problem,) = problems_of(path)
    assert f"{path}:12: placement.replicas:" in problem
    assert "'two'" in problem


def test_global_batch_that_does_not_divide_gives_arithmetic_and_fix(write_yaml):
    path = write_yaml(SFT.replace("global_batch_size: 16", "global_batch_size: 24"))
    (problem,) = problems_of(path)
    assert f"{path}:8: train.global_batch_size:" in problem
    assert "(4) x deepspeed.gradient_accumulation_steps (2) x data-parallel ranks (2) = 16" in problem
    assert "set train.global_batch_size: 16" in problem
    assert "deepspeed.gradient_accumulation_steps: 3" in problem


def test_dotted_overrides_apply_and_parse_yaml_values(write_yaml):
    job = load_job(write_yaml(SFT), ["deepspeed.zero_stage=3", "deepspeed.offload_params=true", "optim.lr=0.5"])
    assert job.deepspeed.zero_stage == 3 and job.deepspeed.offload_params is True and job.optim.lr == 0.5


def test_bad_override_is_reported_as_coming_from_the_command_line(write_yaml):
    (problem,) = problems_of(write_yaml(SFT), ["deepspeed.zero_stag=3"])
    assert problem.startswith("--set deepspeed.zero_stag=3: deepspeed.zero_stag: unknown key")
    assert "'zero_stage'" in problem
    (problem,) = problems_of(write_yaml(SFT), ["deepspeed.zero_stage=7"])
    assert problem.startswith("--set deepspeed.zero_stage=7: deepspeed.zero_stage:")


def test_malformed_override_and_yaml_errors(write_yaml, tmp_path):
    (problem,) = problems_of(write_yaml(SFT), ["ppo.kl_coef"])
    assert "expected KEY=VALUE" in problem
    broken = write_yaml("kind: sft\nmodel: [unclosed\n", "broken.yaml")
    (problem,) = problems_of(broken)
    assert problem.startswith(f"{broken}:") and "not valid YAML" in problem
    (problem,) = problems_of(tmp_path / "missing.yaml")
    assert "no such config file" in problem


def test_kind_is_checked_against_the_command(write_yaml):
    (problem,) = problems_of(write_yaml(SFT), expect="ppo")
    assert "this is a sft config" in problem and "rlhf-ray sft --config" in problem
    (problem,) = problems_of(write_yaml(SFT.replace("kind: sft", "kind: sfft")))
    assert "did you mean 'sft'?" in problem


def test_offload_params_needs_zero3(write_yaml):
    (problem,) = problems_of(write_yaml(SFT), ["deepspeed.offload_params=true"])
    assert "deepspeed.offload_params" in problem and "zero_stage: 3" in problem


def test_optimizer_offload_at_zero0_is_refused_at_its_yaml_line_with_the_fix(write_yaml):
    """DeepSpeed offloads the optimizer only inside its ZeRO optimizers: at stage 0 the CPU Adam steps the GPU's
    parameters and fails the first step (seen on an H100), so validate refuses what would fail on a GPU."""
    path = write_yaml(SFT.replace("  gradient_accumulation_steps: 2\n",
                                  "  gradient_accumulation_steps: 2\n  zero_stage: 0\n  offload_optimizer: true\n"))
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:12: deepspeed.offload_optimizer:"), problem
    assert "zero_stage 1, 2 or 3" in problem and "set zero_stage: 1 or more" in problem
    (problem,) = problems_of(ROOT / "configs/quickstart/ppo.yaml",
                             ["critic.deepspeed.zero_stage=0", "critic.deepspeed.offload_optimizer=true"])
    assert problem.startswith("--set critic.deepspeed.offload_optimizer=true: critic.deepspeed.offload_optimizer:")
    for stage in (1, 2, 3):  # ZeRO-Offload proper
        assert load_job(path, [f"deepspeed.zero_stage={stage}"]).deepspeed.offload_optimizer


def test_ppo_defaults_follow_deepspeed_chat_and_roles_chain(write_yaml):
    job = load_job(write_yaml(PPO))
    assert isinstance(job, PPOJob)
    p = job.ppo
    assert (p.kl_coef, p.clip_reward, p.clip_ratio, p.clip_value, p.gamma, p.lam) == (0.1, 5.0, 0.2, 0.2, 1.0, 0.95)
    assert (p.ppo_epochs, p.ptx_coef, p.ema.beta) == (1, 27.8, 0.992)
    assert job.reference.model.path == "sft/model"  # reference starts from the policy
    assert job.critic is not None and job.critic.model.path == "rm/model"  # critic starts from the reward model
    assert list(job.placement_roles()) == ["policy", "critic", "reference", "reward", "generation"]


def test_critic_free_estimators_refuse_a_critic_and_need_groups(write_yaml):
    (problem,) = problems_of(write_yaml(PPO), ["ppo.advantage_estimator=grpo"])
    assert "critic: advantage_estimator grpo uses no critic" in problem
    path = write_yaml(PPO.replace("critic:\n  micro_batch_size: 4\n", ""))
    (problem,) = problems_of(path, ["ppo.advantage_estimator=grpo"])
    assert "generation.sampling.n_samples_per_prompt" in problem and "at least 2" in problem
    job = load_job(path, ["ppo.advantage_estimator=grpo", "generation.sampling.n_samples_per_prompt=4"])
    assert "critic" not in job.placement_roles()


def test_distillation_needs_a_teacher_and_a_teacher_needs_distillation(write_yaml):
    path = write_yaml(PPO.replace("critic:\n  micro_batch_size: 4\n", ""))
    (problem,) = problems_of(path, ["ppo.advantage_estimator=distill"])
    assert "teacher: advantage_estimator distill learns from a teacher model" in problem
    (problem,) = problems_of(path, ["ppo.advantage_estimator=grpo", "generation.sampling.n_samples_per_prompt=4",
                                    "teacher.model.path=teacher/model"])
    assert "teacher: a teacher is used by advantage_estimator distill, not grpo" in problem
    job = load_job(path, ["ppo.advantage_estimator=distill", "teacher.model.path=teacher/model",
                          "teacher.placement.colocate_with=policy"])
    assert list(job.placement_roles()) == ["policy", "reference", "teacher", "reward", "generation"]
    assert not job.old_logprobs_from_training  # the student's log-probs of its samples are half the reward


def test_a_run_without_a_kl_term_may_leave_out_the_reference_and_one_with_it_may_not(write_yaml):
    path = write_yaml(PPO.replace("critic:\n  micro_batch_size: 4\n", "") + "reference: null\n")
    (problem,) = problems_of(path, ["ppo.advantage_estimator=grpo", "generation.sampling.n_samples_per_prompt=4"])
    assert "job.yaml" in problem and "reference: ppo.kl_coef is 0.1: the KL term in the reward" in problem
    (problem,) = problems_of(path, ["ppo.advantage_estimator=grpo", "generation.sampling.n_samples_per_prompt=4",
                                    "ppo.kl_in_loss=true", "ppo.kl_coef=0.01"])
    assert "the KL term in the policy loss (ppo.kl_in_loss)" in problem
    (problem,) = problems_of(path, ["ppo.advantage_estimator=grpo", "generation.sampling.n_samples_per_prompt=4",
                                    "ppo.kl_coef=0", "reward.placement.colocate_with=reference"])
    assert "reward.placement.colocate_with" in problem  # no reference to sit beside
    job = load_job(path, ["ppo.advantage_estimator=grpo", "generation.sampling.n_samples_per_prompt=4",
                          "ppo.kl_coef=0"])
    assert job.reference is None and list(job.placement_roles()) == ["policy", "reward", "generation"]
    from rlhf_ray.jobs.threads import phases

    assert phases(job)["experience"] == ["reward"]  # the reward model alone scores a rollout


def test_an_option_the_advantage_estimator_does_not_read_is_refused_at_its_line(write_yaml):
    path = write_yaml(PPO.replace("critic:\n  micro_batch_size: 4\n", "").replace(
        "ppo:\n", "ppo:\n  advantage_estimator: reinforce_pp\n  whiten_advantages: false\n"))
    (problem,) = problems_of(path)
    assert "ppo.whiten_advantages" in problem and "reinforce_pp does not use whiten_advantages" in problem
    assert "job.yaml:9:" in problem  # the line the user wrote it on
    (problem,) = problems_of(path, ["ppo.advantage_estimator=grpo", "generation.sampling.n_samples_per_prompt=2"])
    assert "grpo does not use whiten_advantages" in problem
    # read by rloo: accepted; lam is GAE's only
    job = load_job(path, ["ppo.advantage_estimator=rloo", "generation.sampling.n_samples_per_prompt=2"])
    # actors get the spec as a dict with every field: defaults there are not options the user set
    for spec in (job.ppo, job.ppo.model_copy(update={"advantage_estimator": "grpo", "whiten_advantages": True})):
        assert type(spec).model_validate(spec.model_dump()) == spec
    (problem,) = problems_of(write_yaml(PPO.replace("critic:\n  micro_batch_size: 4\n", "")),
                             ["ppo.advantage_estimator=rloo", "generation.sampling.n_samples_per_prompt=2", "ppo.lam=1.0"])
    assert "ppo.lam" in problem and "rloo does not use lam" in problem
    # the critic's warm-up: gae only, and it must leave the policy iterations to train in
    (problem,) = problems_of(write_yaml(PPO.replace("critic:\n  micro_batch_size: 4\n", "")),
                             ["ppo.advantage_estimator=grpo", "generation.sampling.n_samples_per_prompt=2",
                              "ppo.critic_warmup=2"])
    assert "ppo.critic_warmup" in problem and "grpo does not use critic_warmup" in problem
    (problem,) = problems_of(write_yaml(PPO), ["ppo.iterations=3", "ppo.critic_warmup=3"])
    assert "ppo.critic_warmup" in problem and "below ppo.iterations" in problem
    assert load_job(write_yaml(PPO), ["ppo.iterations=3", "ppo.critic_warmup=2"]).ppo.critic_warmup == 2


def test_dapo_options_load_and_an_overlong_buffer_as_long_as_the_answers_is_refused(write_yaml):
    path = write_yaml(PPO)
    job = load_job(path, ["ppo.clip_ratio_high=0.28", "ppo.loss_aggregation=seq_mean_token_mean",
                          "ppo.overlong_buffer=4", "generation.sampling.max_new_tokens=16"])
    assert (job.ppo.clip_ratio_high, job.ppo.loss_aggregation, job.ppo.overlong_buffer) == (
        0.28, "seq_mean_token_mean", 4)
    (problem,) = problems_of(path, ["ppo.overlong_buffer=16", "generation.sampling.max_new_tokens=16"])
    assert "ppo.overlong_buffer" in problem and "max_new_tokens (16)" in problem
    (problem,) = problems_of(path, ["ppo.dynamic_sampling.enabled=true"])  # gae: no groups to keep
    assert "ppo.dynamic_sampling.enabled" in problem and "gae has no groups" in problem
    (problem,) = problems_of(path, ["ppo.loss_aggregation=seq_mean"])
    assert "ppo.loss_aggregation" in problem and "seq_mean_token_mean" in problem


def test_ppo_batch_checks(write_yaml):
    (problem,) = problems_of(write_yaml(PPO), ["generation.placement.replicas=16"])
    assert "ppo.rollout_batch_size" in problem and "cannot keep 16 engines busy" in problem
    (problem,) = problems_of(write_yaml(PPO), ["generation.placement.max_replicas=12"])  # as many as it may grow to
    assert "cannot keep 12 engines busy" in problem and "generation.placement.max_replicas <= 8" in problem
    (problem,) = problems_of(write_yaml(PPO), ["generation.placement.replicas=2", "generation.placement.max_replicas=1"])
    assert "generation.placement.max_replicas" in problem and "fewer than replicas (2)" in problem
    (problem,) = problems_of(write_yaml(PPO), ["ppo.train_batch_size=3"])
    assert "ppo.train_batch_size" in problem and "= 8 samples" in problem
    (problem,) = problems_of(write_yaml(PPO), ["policy.placement.replicas=4"])
    assert problem.split(": ")[1] == "policy.micro_batch_size"
    assert "8 samples does not split over policy.micro_batch_size (4) x policy.placement.replicas (4) = 16" in problem
    (problem,) = problems_of(write_yaml(PPO), ["critic.deepspeed.gradient_accumulation_steps=4"])
    assert "ppo.train_batch_size: global batch 8 != critic.micro_batch_size (4) x " in problem
    assert "or critic.deepspeed.gradient_accumulation_steps: 2" in problem
    job = load_job(write_yaml(PPO), ["ppo.train_batch_size=4"])
    assert job.policy.accumulation_steps(job.train_batch_size) == 1


def test_reward_function_replaces_the_reward_model(write_yaml):
    text = PPO.replace("reward:\n  model: {path: rm/model}", "reward:\n  function: mypkg.rewards:score")
    (problem,) = problems_of(write_yaml(text))
    assert "critic.model.path" in problem  # the critic cannot start from a reward function
    job = load_job(write_yaml(text), ["critic.model.path=rm/model"])
    assert job.reward.function == "mypkg.rewards:score" and job.reward.model.path is None
    assert "reward" in job.placement_roles()  # the function runs in the reward role's actors


def test_async_mode_needs_a_staleness_bound_of_at_least_one(write_yaml):
    (problem,) = problems_of(write_yaml(PPO), ["ppo.mode=async", "ppo.max_staleness=0"])
    assert "ppo.max_staleness" in problem and "ppo.mode: sync" in problem
    assert load_job(write_yaml(PPO), ["ppo.mode=async"]).ppo.max_staleness == 1


def test_relative_paths_are_made_absolute_once_against_the_working_directory(write_yaml, tmp_path, monkeypatch):
    """Every actor, on whatever node, gets the path the driver checked: relative paths (output_dir, model and
    tokenizer folders, dataset files, corpora) are resolved against the working directory when the config is
    validated; hub ids, packaged GGUF files and a GGUF file inside a model folder are left as they are."""
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    job = load_job(write_yaml("kind: sft\noutput_dir: runs/a\nmodel: {path: models/mine, tokenizer: org/tok}\n"
                              "data: {datasets: [{name: custom, path: ./data/../d.jsonl, format: {}}], "
                              "cache_dir: ~/cache}\n"))
    assert job.output_dir == str(tmp_path / "runs/a") and job.model.path == str(tmp_path / "models/mine")
    assert job.model.tokenizer == "org/tok"  # a hub id: nothing here by that name
    assert job.data.datasets[0].path == str(tmp_path / "d.jsonl")
    assert job.data.cache_dir == str(Path.home() / "cache")
    assert load_job(write_yaml("kind: sft\nmodel: {path: HuggingFaceTB/SmolLM2-135M}\n")).model.path == \
        "HuggingFaceTB/SmolLM2-135M"
    gguf = load_job(write_yaml("kind: sft\nmodel: {path: models/mine, gguf_file: m.gguf}\n")).model
    assert (gguf.path, gguf.gguf_file) == (str(tmp_path / "models/mine"), "m.gguf")  # relative to path
    assert load_job(write_yaml("kind: sft\nmodel: {gguf_file: m.gguf}\n")).model.gguf_file == str(tmp_path / "m.gguf")
    assert load_job(write_yaml("kind: sft\nmodel: {gguf_file: package:smollm2}\n")).model.gguf_file == \
        "package:smollm2"


def test_pipeline_wires_stage_outputs_into_ppo():
    job = load_job(ROOT / "configs/quickstart/pipeline.yaml")
    assert isinstance(job, PipelineJob)
    here = Path.cwd()  # relative paths are resolved against the working directory, once (config/paths.py)
    assert job.sft.output_dir == str(here / "outputs/quickstart/sft")
    assert job.ppo.policy.model.path == str(here / f"outputs/quickstart/sft/{FINAL_MODEL_DIR}")
    assert job.rm.model.path == job.ppo.policy.model.path  # the reward model starts from the SFT model
    assert job.ppo.reference.model.path == job.ppo.policy.model.path
    assert job.ppo.reward.model.path == str(here / f"outputs/quickstart/rm/{FINAL_MODEL_DIR}")
    assert job.ppo.critic is not None and job.ppo.critic.model.path == job.ppo.reward.model.path
    assert job.ppo.seed == job.seed and job.ppo.cluster == job.cluster
    given = load_job(ROOT / "configs/quickstart/pipeline.yaml", ["rm.model.path=my/rm-base"])
    assert given.rm.model.path == "my/rm-base"  # a hub id is kept


def test_a_pipeline_without_a_reward_model_starts_its_critic_from_the_sft_model():
    """SFT -> PPO with a critic and a reward function (configs/recipes/smollm2-sft-ppo.yaml): there is no reward
    model to start the critic from, so it takes the SFT model's backbone (a new value head); a critic model given
    is kept."""
    job = load_job(ROOT / "configs/recipes/smollm2-sft-ppo.yaml", ["output_dir=/runs/p"])
    sft_model = f"/runs/p/sft/{FINAL_MODEL_DIR}"
    assert job.rm is None and job.ppo.reward.function == "rlhf_ray.data.answers:last_number_reward"
    assert job.ppo.policy.model.path == job.ppo.reference.model.path == sft_model
    assert job.ppo.critic is not None and job.ppo.critic.model.path == sft_model
    assert job.ppo.ppo.advantage_estimator == "gae"
    given = load_job(ROOT / "configs/recipes/smollm2-sft-ppo.yaml", ["ppo.critic.model.gguf_file=package:smollm2"])
    assert given.ppo.critic.model.gguf_file == "package:smollm2" and given.ppo.critic.model.path is None


def test_deepspeed_config_translation():
    spec = DeepSpeedSpec(zero_stage=3, offload_params=True, gradient_accumulation_steps=4,
                         extra={"zero_optimization": {"round_robin_gradients": True}, "prescale_gradients": False})
    ds = spec.to_ds_config("fp16", micro_batch_size=2, data_parallel_size=8)
    assert ds["train_batch_size"] == 2 * 4 * 8
    assert ds["fp16"]["enabled"] and not ds["bf16"]["enabled"]
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert ds["zero_optimization"]["round_robin_gradients"] is True  # raw keys merge into nested sections
    assert ds["zero_optimization"]["stage"] == 3 and ds["prescale_gradients"] is False


def test_schema_is_generated_from_the_models(tmp_path):
    schema = job_schema()
    kinds = {ref.split("/")[-1] for ref in schema["discriminator"]["mapping"].values()}
    assert kinds == {"PretrainJob", "SFTJob", "RMJob", "DPOJob", "PPOJob", "PipelineJob"}
    ppo = schema["$defs"]["PPOSpec"]["properties"]
    assert ppo["kl_coef"]["default"] == 0.1 and "KL" in ppo["kl_coef"]["description"]
    assert schema["$defs"]["TrainSpec"]["additionalProperties"] is False
    out = tmp_path / "schema.json"
    assert main(["schema", "--out", str(out)]) == EXIT_OK
    assert json.loads(out.read_text()) == schema


def test_cli_exit_codes(write_yaml, capsys):
    bad = write_yaml(SFT.replace("replicas: 2", "replica: 2"), "bad.yaml")
    assert main(["validate", str(bad)]) == EXIT_BAD_CONFIG
    assert "placement.replica: unknown key; did you mean 'replicas'?" in capsys.readouterr().err
    # five roles at 1 CPU each do not fit this 2-core machine: refused before any actor starts
    assert main(["ppo", "--config", str(write_yaml(PPO)), "--set", "cluster.num_cpus=2"]) == EXIT_PLAN_DOES_NOT_FIT
    assert "refusing to start" in capsys.readouterr().err
    assert main(["sft", "--config", str(write_yaml(SFT))]) == EXIT_BAD_CONFIG  # some/model exists nowhere
    assert "model.path: 'some/model' is not a local folder and not in the hub cache" in capsys.readouterr().err


def test_field_reference_in_docs_is_generated_from_the_models():
    from rlhf_ray.config.reference import render_reference

    doc = (ROOT / "docs/configuration.md").read_text()
    marker = "## Field reference"
    generated = doc[doc.index(marker):].split("\n\n", 2)[2]
    assert generated.strip() == render_reference().strip(), "stale: run .venv/bin/python scripts/update_config_reference.py"


def test_recipe_memory_table_in_docs_is_current_and_every_gpu_recipe_is_in_it():
    from rlhf_ray.memory.recipes import HEADING, gpu_recipes, render

    doc = (ROOT / "docs/configuration.md").read_text()
    start = doc.index(HEADING)
    section = doc[start: doc.index("\n## ", start + len(HEADING))]
    assert section.strip() == render(ROOT).strip(), "stale: run .venv/bin/python scripts/update_recipe_memory.py"
    names = {p.name for p in gpu_recipes(ROOT)}
    assert {"llama-70b-4node.yaml", "llama-8b-8gpu.yaml", "opt-1.3b-single-gpu.yaml"} <= names
    assert all(f"`{name}`" in section for name in names)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates_and_fits(path, capsys):
    """--config-only: most shipped configs name models an earlier stage (or a download) provides."""
    code = main(["validate", "--quiet", "--config-only", str(path)])
    assert code == EXIT_OK, capsys.readouterr()


def test_the_70b_recipe_fits_only_with_its_reference_and_reward_sharded(capsys):
    """Whole 70B models per reference / reward replica do not fit their GPUs; sharding them is what makes it fit."""
    recipe = str(ROOT / "configs/recipes/llama-70b-4node.yaml")
    code = main(["validate", "--quiet", "--config-only", recipe, "--set", "reference.sharded=false",
                 "--set", "reward.sharded=false"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == EXIT_PLAN_DOES_NOT_FIT
    assert "placement group `policy` (policy + reference) needs" in err and "placement group `reward` (reward) needs" in err, err
    assert "sharded: true" in err  # the advice names the fix


def test_plan_needing_more_gpus_than_the_cluster_is_refused(capsys):
    config = ROOT / "configs/quickstart/ppo.yaml"
    code = main(["validate", "--quiet", str(config), "--set", "generation.placement.num_gpus=1",
                 "--set", "cluster.shape=[{cpus: 2, gpus: 0}]"])
    assert code == EXIT_PLAN_DOES_NOT_FIT
    err = capsys.readouterr().err
    assert "needs 1 GPU (generation 1 x 1) but the cluster has 0" in err
    assert "lower generation.placement.num_gpus (or replicas)" in " ".join(err.split())  # the field to change


def test_gpus_this_machine_does_not_have_are_refused_naming_the_field(write_yaml, capsys, monkeypatch):
    """An embedded local Ray would offer the declared GPUs and every process placed on one would fail at start-up;
    validate crashed in torch instead ('Torch not compiled with CUDA enabled')."""
    import rlhf_ray.cluster

    monkeypatch.setattr(rlhf_ray.cluster, "_visible_gpus", lambda: 0)  # as in CI, also where a GPU is lent
    path = write_yaml(PPO + "cluster:\n  num_gpus: 1\n")
    assert main(["validate", "--quiet", str(path)]) == EXIT_PLAN_DOES_NOT_FIT
    err = " ".join(capsys.readouterr().err.split())
    assert f"{path}:" in err and "cluster.num_gpus: 1 GPU(s) declared, but torch sees 0 CUDA GPU(s)" in err
    assert "cluster.shape" in err  # the way to plan for another machine


def test_colocation_errors_point_at_the_yaml_line(write_yaml):
    text = PPO + "reference:\n  placement: {colocate_with: polcy}\n"
    (problem,) = problems_of(write_yaml(text))
    assert problem.startswith(f"{write_yaml(text)}:12: reference.placement.colocate_with:")
    assert "policy" in problem
    job = load_job(write_yaml(PPO), ["policy.placement.replicas=2", "reference.placement.colocate_with=policy",
                                     "policy.micro_batch_size=2", "critic.micro_batch_size=2"])
    assert job.reference.placement.replicas == 2  # a colocated role follows its host's replica count


def test_validate_rejects_an_unknown_dataset_name_at_its_line(write_yaml, capsys):
    path = write_yaml(SFT + "data:\n  datasets:\n    - name: Dahoas/rm-statc\n")
    assert main(["validate", "--quiet", str(path)]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert f"{path}:15: data.datasets.0.name: unknown dataset 'Dahoas/rm-statc'; did you mean 'Dahoas/rm-static'?" in err


def test_a_missing_pretraining_corpus_is_refused_before_work(capsys, tmp_path):
    missing = tmp_path / "nothing" / "corpus"
    code = main(["ppo", "--config", str(ROOT / "configs/quickstart/ppo.yaml"), "--set",
                 f"ppo.pretrain_data=[{missing}]"])
    assert code == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "ppo.pretrain_data" in err and str(missing) in err


DPO = """\
kind: dpo
model: {path: sft/model}
dpo:
  beta: 0.2
  loss: ipo
  label_smoothing: 0.1
"""


def test_dpo_options_and_label_smoothing_only_with_the_sigmoid_loss(write_yaml):
    path = write_yaml(DPO)
    (problem,) = problems_of(path)
    assert f"{path}:6: dpo.label_smoothing:" in problem and "loss: sigmoid" in problem
    job = load_job(path, ["dpo.loss=sigmoid"])
    assert job.dpo.beta == 0.2 and job.dpo.label_smoothing == 0.1 and job.dpo.reference.precompute
    assert job.reference_model.path == "sft/model"  # the reference defaults to the model DPO starts from
    assert set(job.placement_roles()) == {"learner", "reference"}
    assert load_job(path, ["dpo.loss=sigmoid", "dpo.reference.model.path=other"]).reference_model.path == "other"


def test_a_pipeline_runs_sft_then_dpo_or_rm_and_ppo_not_both(write_yaml):
    job = load_job(ROOT / "configs/quickstart/pipeline-dpo.yaml")
    assert [s.kind for s in job.stages()] == ["sft", "dpo"]
    assert job.dpo.model.path == f"{job.sft.output_dir}/{FINAL_MODEL_DIR}" and job.dpo.seed == job.seed
    both = write_yaml("kind: pipeline\nsft: {model: {path: m}}\nrm: {}\n"
                      "ppo: {reward: {function: a.b:c}, critic: {model: {path: m}}}\ndpo: {}\n")
    (problem,) = problems_of(both)
    assert "either rm and ppo after sft, or dpo" in problem
    (problem,) = problems_of(write_yaml("kind: pipeline\nsft: {model: {path: m}}\nrm: {}\n"))
    assert "ppo" in problem and "or a dpo one" in problem


def test_a_pipeline_goes_from_sft_to_ppo_without_an_rm_stage_when_the_reward_is_a_function(write_yaml):
    job = load_job(ROOT / "configs/recipes/smollm2-calculator.yaml")
    assert [s.kind for s in job.stages()] == ["sft", "ppo"]
    assert job.ppo.policy.model.path == f"{job.sft.output_dir}/{FINAL_MODEL_DIR}" and job.ppo.critic is None
    assert job.sft.data.datasets[0].name == "demo/word-problems-calculator"
    # a reward model with no rm stage to train it (and no path) is refused, naming the field
    (problem,) = problems_of(write_yaml("kind: pipeline\nsft: {model: {path: m}}\nppo: {}\n"))
    assert "ppo.reward.model.path" in problem and "no reward" in problem


def test_a_warmup_stage_trains_the_student_on_the_teachers_answers_and_ppo_starts_from_it(write_yaml):
    job = load_job(ROOT / "configs/recipes/smollm2-distill-warmup.yaml")
    assert list(job.named_stages()) == ["sft", "warmup", "ppo"] and job.warmup.kind == "sft"
    warmup = f"{job.output_dir}/warmup"
    assert job.warmup.output_dir == warmup and job.warmup.prompts == 240 and not job.warmup.keep_unfinished
    assert job.warmup.model.gguf_file == "package:smollm2"  # the student: ppo's policy model as written
    (answers,) = job.warmup.data.datasets
    assert answers.path == f"{warmup}/{ANSWERS_FILE}" and answers.format.model_dump(include=set(ANSWERS_FORMAT)) \
        == ANSWERS_FORMAT and job.warmup.data.split == "1,0,0" and job.warmup.data.max_seq_len == 256
    assert job.ppo.policy.model.path == f"{warmup}/{FINAL_MODEL_DIR}" and job.ppo.policy.model.gguf_file is None
    assert job.ppo.policy.model.dtype == "fp32" and job.ppo.teacher.model.path == f"{job.sft.output_dir}/model"
    # a warm-up needs a teacher to answer: refused at its line without one
    ppo = "ppo: {reward: {function: a.b:c}, policy: {model: {path: base}}, "
    (problem,) = problems_of(write_yaml(f"kind: pipeline\nsft: {{model: {{path: m}}}}\nwarmup: {{}}\n"
                                        f"{ppo}critic: {{model: {{path: c}}}}}}\n"))
    assert ":3: warmup:" in problem and "needs a ppo stage with a teacher section" in problem
    # a student named in the warm-up is the one it trains; ppo's policy still starts from the warm-up's model
    job = load_job(write_yaml(f"kind: pipeline\nsft: {{model: {{path: m}}}}\nwarmup: {{model: {{path: small}}}}\n"
                              f"{ppo}critic: null, teacher: {{}}, ppo: {{advantage_estimator: distill}}}}\n"))
    assert job.warmup.model.path == "small" and job.ppo.policy.model.path == str(Path.cwd() / "outputs/run/warmup/model")
    (problem,) = problems_of(write_yaml(f"kind: pipeline\nsft: {{model: {{path: m}}}}\nwarmup: {{}}\n{ppo}critic: null, "
                                        "teacher: {}, ppo: {advantage_estimator: distill}, generation: {environment: "
                                        "{path: rlhf_ray.envs.calculator:CalculatorEnv}}}\n"))
    assert ":3: warmup:" in problem and "multi-turn episodes" in problem


def test_lora_adapter_sync_is_refused_where_it_cannot_work_naming_the_field():
    config = ROOT / "configs/quickstart/ppo.yaml"
    lora = ["policy.model.lora.rank=8", "policy.model.lora.target_modules=[q_proj]"]
    assert load_job(config, lora).policy.model.lora.enabled  # LoRA policies are a PPO option now (merged sync)
    for overrides, why in [([], "the policy has none"),
                           ([*lora, "policy.model.lora.only_optimize_lora=false"], "base weights train too"),
                           ([*lora, "generation.engine=hf"], "engine is hf")]:
        (problem,) = problems_of(config, [*overrides, "generation.weight_sync.lora=adapter"])
        assert "generation.weight_sync.lora" in problem and why in problem, problem
    assert load_job(config, [*lora, "generation.engine=vllm", "generation.weight_sync.lora=adapter"])


def test_zero_knobs_that_do_nothing_or_that_deepspeed_rejects_are_refused_naming_the_field():
    config = ROOT / "configs/quickstart/ppo.yaml"  # policy and critic: fp32, ZeRO-2
    for overrides, field, why in [
            (["policy.deepspeed.zero_stage=1", "policy.deepspeed.round_robin_gradients=true"],
             "round_robin_gradients", "acts at ZeRO stage 2, not at zero_stage 1"),
            (["critic.deepspeed.hysteresis=4"], "critic.deepspeed.hysteresis", "model.dtype is fp32"),
            (["policy.deepspeed.allgather_bucket_size=1001"], "allgather_bucket_size", "multiple of 2")]:
        problems = problems_of(config, overrides)
        assert any(field in p and why in p for p in problems), problems
    (problem,) = problems_of(config, ["policy.deepspeed.zero_stage=0", "policy.deepspeed.grad_accum_dtype=bf16"])
    assert "policy.deepspeed.grad_accum_dtype" in problem and "only under ZeRO" in problem
    (problem,) = problems_of(config, ["policy.deepspeed.zero_stage=0", "policy.deepspeed.reduce_scatter=false"])
    assert "reduce_scatter acts at ZeRO stage 1 / 2" in problem
    job = load_job(config, ["policy.deepspeed.overlap_comm=true", "policy.deepspeed.grad_accum_dtype=fp32",
                            "policy.deepspeed.reduce_bucket_size=1000000"])
    zero = job.policy.deepspeed.to_ds_config("fp32", 4, 1)["zero_optimization"]
    assert zero["overlap_comm"] is True and zero["reduce_bucket_size"] == 1000000


def test_a_prompt_template_is_a_format_string_and_one_way_of_wrapping(write_yaml):
    base = PPO + "data:\n  datasets:\n    - name: demo/arithmetic\n"
    load_job(write_yaml(base + "      prompt_template: \"Question: {prompt}\\nAnswer:\"\n"))
    (problem,) = problems_of(write_yaml(base + "      prompt_template: \"Q: {question}\"\n"))
    assert "data.datasets.0.prompt_template" in problem and "using only {prompt}" in problem and "job.yaml:14" in problem
    (problem,) = problems_of(write_yaml(base + "      chat_template: true\n      prompt_template: \"Q: {prompt}\"\n"))
    assert "data.datasets.0.prompt_template" in problem and "drop one of the two" in problem


def test_packed_rows_with_gradient_checkpointing_are_refused_at_their_line(write_yaml):
    path = write_yaml(PPO.replace("critic:\n  micro_batch_size: 4\n",
                                  "critic:\n  micro_batch_size: 4\n  pack_sequences: true\n"))
    load_job(path)
    (problem,) = problems_of(path, ["critic.model.gradient_checkpointing=true"])
    assert "critic.pack_sequences" in problem and "gradient checkpointing" in problem and "job.yaml:7:" in problem


def test_a_token_budget_that_cannot_hold_the_longest_row_is_refused_at_its_line(write_yaml):
    path = write_yaml(PPO.replace("critic:\n  micro_batch_size: 4\n",
                                  "critic:\n  micro_batch_size: 4\n  max_tokens_per_micro_batch: 300\n"))
    (problem,) = problems_of(path, ["data.max_prompt_len=256", "generation.sampling.max_new_tokens=64"])
    assert "critic.max_tokens_per_micro_batch" in problem and "= 320; set at least 320" in problem
    assert "job.yaml:7:" in problem
    job = load_job(path, ["data.max_prompt_len=200", "generation.sampling.max_new_tokens=64",
                          "reference.max_tokens_per_micro_batch=264"])
    assert (job.critic.max_tokens_per_micro_batch, job.reference.max_tokens_per_micro_batch) == (300, 264)
