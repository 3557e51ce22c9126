"""Pre-flight checks: a broken input a job reads is refused by `rlhf-ray validate` and by the job command before Ray
starts, naming the YAML field and line, the file and the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import ray

from rlhf_ray.cli import EXIT_BAD_CONFIG, EXIT_OK, main
from tests.conftest import ROOT

GRPO = ROOT / "configs/quickstart/grpo.yaml"


@pytest.fixture(autouse=True)
def ray_must_not_start(monkeypatch):
    """Every check here must refuse before any Ray process starts: starting one fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init was called: the bad input was not caught before Ray started")

    monkeypatch.setattr(ray, "init", refuse)


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())  # rich wraps long lines


def sft_yaml(write_yaml, model: Path, extra: str = "", output_dir: str | None = None) -> Path:
    out = output_dir or str(Path(write_yaml("", "placeholder.yaml").parent / "out"))
    return write_yaml(f"""\
kind: sft
output_dir: {out}
model:
  path: {model}
  dtype: fp32
{extra}""")


@pytest.fixture
def model_copy(tiny_model, tmp_path) -> Path:
    path = tmp_path / "model"
    shutil.copytree(tiny_model, path)
    return path


# ---- the config file itself ------------------------------------------------------------------------------------

def test_a_duplicate_key_is_refused_naming_both_lines(write_yaml, tiny_model, capsys):
    path = sft_yaml(write_yaml, tiny_model, "train:\n  epochs: 1\ndeepspeed:\n  zero_stage: 0\ntrain:\n  epochs: 3\n")
    for command in (["validate", "--quiet", str(path)], ["sft", "--config", str(path)]):
        code, out = run_cli(capsys, *command)
        assert code == EXIT_BAD_CONFIG
        assert f"{path}:10: train: given twice (lines 6 and 10)" in out


def test_a_config_that_is_not_utf8_or_a_directory_is_named_as_such(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("kind: sft\noutput_dir: out\n# caf\xe9\n".encode("latin-1"))
    code, out = run_cli(capsys, "validate", str(path))
    assert code == EXIT_BAD_CONFIG and f"{path}:3: not UTF-8 text: byte 0xe9 at column 6" in out
    code, out = run_cli(capsys, "validate", str(ROOT / "configs/quickstart"))
    assert code == EXIT_BAD_CONFIG and "is a directory, not a config file" in out and "grpo.yaml" in out


# ---- what the config points at -----------------------------------------------------------------------------------

def test_a_misspelt_reward_function_is_refused_at_its_line(capsys):
    code, out = run_cli(capsys, "ppo", "--config", str(GRPO), "--set",
                        "reward.function=rlhf_ray.data.answer:last_number_reward")
    assert code == EXIT_BAD_CONFIG
    assert "--set reward.function=rlhf_ray.data.answer:last_number_reward: reward.function: cannot import" in out
    assert "No module named 'rlhf_ray.data.answer'" in out and "check the spelling" in out
    code, out = run_cli(capsys, "validate", "--quiet", str(GRPO), "--set",
                        "reward.function=rlhf_ray.data.answers:last_numbr_reward")
    assert code == EXIT_BAD_CONFIG and "has no attribute 'last_numbr_reward'" in out


def test_a_reward_function_with_the_wrong_arguments_is_refused(capsys):
    code, out = run_cli(capsys, "validate", "--quiet", str(GRPO), "--set", "reward.function=math:sqrt")
    assert code == EXIT_BAD_CONFIG and "reward.function: math:sqrt cannot be called as f(prompts, answers" in out


def test_truncated_weights_are_refused_naming_the_file(write_yaml, model_copy, capsys):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    path = sft_yaml(write_yaml, model_copy)
    code, out = run_cli(capsys, "sft", "--config", str(path))
    assert code == EXIT_BAD_CONFIG
    assert f"{path}:4: model.path: {weights}: truncated" in out and "download or save it again" in out
    weights.write_bytes(b"\x00" * 4)
    code, out = run_cli(capsys, "validate", "--quiet", str(path))
    assert code == EXIT_BAD_CONFIG and "shorter than a safetensors header" in out


def test_a_tokenizer_that_cannot_load_is_named_as_a_local_folder(write_yaml, model_copy, capsys):
    (model_copy / "tokenizer.json").write_text("{not json")
    for name in ("tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        (model_copy / name).unlink(missing_ok=True)
    path = sft_yaml(write_yaml, model_copy)
    code, out = run_cli(capsys, "validate", "--quiet", str(path))
    assert code == EXIT_BAD_CONFIG
    assert f"model.path: cannot load the tokenizer in the local folder {model_copy}" in out
    assert "hub" not in out


def test_a_missing_model_folder_names_field_and_line_without_hub_noise(write_yaml, tmp_path, capsys):
    path = sft_yaml(write_yaml, Path("outputs/never-built/model"))
    code, out = run_cli(capsys, "sft", "--config", str(path))
    assert code == EXIT_BAD_CONFIG
    assert f"{path}:4: model.path: no such folder '{Path.cwd() / 'outputs/never-built/model'}'" in out
    assert "Repo id" not in out


def test_an_output_dir_that_is_a_file_is_refused(write_yaml, tiny_model, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    code, out = run_cli(capsys, "sft", "--config", str(sft_yaml(write_yaml, tiny_model, output_dir=str(taken))))
    assert code == EXIT_BAD_CONFIG and f"output_dir: {taken} is a file, not a folder" in out
    code, out = run_cli(capsys, "validate", "--quiet", str(sft_yaml(write_yaml, tiny_model,
                                                                      output_dir=str(taken / "run"))))
    assert code == EXIT_BAD_CONFIG and f"output_dir: {taken} is a file, so {taken / 'run'} cannot be created" in out


def test_a_corrupt_checkpoint_state_is_named_with_the_way_out(write_yaml, tiny_model, tmp_path, capsys):
    out_dir = tmp_path / "run"
    state = out_dir / "checkpoints" / "step-00000002" / "trainer_state.json"
    state.parent.mkdir(parents=True)
    state.write_text('{"step": 2, "first_eval": {\x01}}')
    path = sft_yaml(write_yaml, tiny_model, output_dir=str(out_dir))
    code, out = run_cli(capsys, "sft", "--config", str(path))
    assert code == EXIT_BAD_CONFIG
    assert f"checkpoint.resume: the newest checkpoint's state {state} is unreadable" in out
    assert "set checkpoint.resume: false" in out
    code, _ = run_cli(capsys, "validate", "--quiet", str(path), "--set", "checkpoint.resume=false")
    assert code == EXIT_OK


def test_a_bad_line_in_a_local_dataset_is_named(write_yaml, tiny_model, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": \n')
    extra = f"data:\n  datasets:\n    - name: custom\n      path: {data}\n" \
            "      format: {prompt_field: prompt, chosen_field: chosen, rejected_field: rejected}\n"
    code, out = run_cli(capsys, "validate", "--quiet", str(sft_yaml(write_yaml, tiny_model, extra)))
    assert code == EXIT_BAD_CONFIG and f"{data}:2: malformed JSON line" in out


def test_config_only_skips_the_files_and_the_good_case_passes(write_yaml, tiny_model, capsys):
    code, out = run_cli(capsys, "validate", "--quiet", "--config-only", str(sft_yaml(write_yaml, Path("not/built/yet"))))
    assert code == EXIT_OK, out
    code, out = run_cli(capsys, "validate", "--quiet", str(sft_yaml(write_yaml, tiny_model)))
    assert code == EXIT_OK, out


def test_pickled_weights_are_refused_unless_allowed(write_yaml, model_copy, capsys):
    import torch
    from safetensors.torch import load_file

    weights = model_copy / "model.safetensors"
    torch.save(load_file(str(weights)), model_copy / "pytorch_model.bin")
    weights.unlink()
    path = sft_yaml(write_yaml, model_copy)
    code, out = run_cli(capsys, "validate", "--quiet", str(path))
    assert code == EXIT_BAD_CONFIG
    assert "model.path: " in out and "holds pickled weights only" in out and "allow_pickle_weights: true" in out
    code, out = run_cli(capsys, "validate", "--quiet", str(path), "--set", "model.allow_pickle_weights=true")
    assert code == EXIT_OK, out


def test_the_learner_loads_safetensors_only_unless_allowed(model_copy):
    import torch
    from safetensors.torch import load_file

    from rlhf_ray.config.model import ModelSpec
    from rlhf_ray.models.loading import load_causal_lm

    weights = model_copy / "model.safetensors"
    torch.save(load_file(str(weights)), model_copy / "pytorch_model.bin")
    weights.unlink()
    with pytest.raises(OSError):
        load_causal_lm(ModelSpec(path=str(model_copy), dtype="fp32"))
    assert load_causal_lm(ModelSpec(path=str(model_copy), dtype="fp32", allow_pickle_weights=True)) is not None


def test_keep_best_is_refused_where_its_score_is_never_computed(capsys):
    """ppo.keep_best names a held-out score: refused, naming the field and the fix, when there are no held-out
    prompts, no sampled answers for a sampled_* score, or no rule for task accuracy (a job, not only validate)."""
    code, out = run_cli(capsys, "ppo", "--config", str(GRPO), "--set", "ppo.keep_best=task_accuracy",
                        "--set", "ppo.eval_prompts=0")
    assert code == EXIT_BAD_CONFIG and "ppo.keep_best: task_accuracy is scored on held-out prompts and " \
                                      "eval_prompts is 0" in out
    code, out = run_cli(capsys, "validate", "--quiet", str(GRPO), "--set", "ppo.keep_best=sampled_task_accuracy",
                        "--set", "ppo.eval_samples=0")
    assert code == EXIT_BAD_CONFIG and "eval_samples is 0: set ppo.eval_samples, or keep the best by greedy " \
                                      "task_accuracy" in out
    code, out = run_cli(capsys, "ppo", "--config", str(GRPO), "--set", "ppo.keep_best=task_accuracy",
                        "--set", "ppo.accuracy_function=null", "--set", "data.datasets=[{name: Dahoas/rm-static}]")
    assert code == EXIT_BAD_CONFIG
    assert "--set ppo.keep_best=task_accuracy: ppo.keep_best: task_accuracy needs a rule that marks answers " \
           "right, and the data (Dahoas/rm-static) has none of its own: set ppo.accuracy_function" in out
    code, out = run_cli(capsys, "validate", "--quiet", str(GRPO), "--set", "ppo.keep_best=reward",
                        "--set", "ppo.accuracy_function=null", "--set", "data.datasets=[{name: Dahoas/rm-static}]")
    assert "keep_best" not in out  # the reward is scored without a rule


def test_the_answers_a_warmup_stage_samples_are_not_asked_for_before_the_pipeline_writes_them(capsys, tmp_path):
    recipe = str(ROOT / "configs/recipes/smollm2-distill-warmup.yaml")
    code, out = run_cli(capsys, "validate", "--quiet", recipe, "--set", f"output_dir={tmp_path}")
    assert code == EXIT_OK, out
    named = f"[{{name: custom, path: {tmp_path / 'mine.jsonl'}, format: {{prompt_field: p, chosen_field: a}}}}]"
    code, out = run_cli(capsys, "validate", "--quiet", recipe, "--set", f"output_dir={tmp_path}",
                        "--set", f"warmup.data.datasets={named}")  # a file of the user's own must be there
    assert code == EXIT_BAD_CONFIG and f"warmup.data.datasets.0.path: no such file or folder '{tmp_path / 'mine.jsonl'}'" in out
