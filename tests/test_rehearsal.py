"""`rlhf-ray rehearse`: a PPO job with random weights in its models' shapes, its measured memory per role beside
the plan's, its time split and sync bandwidth."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from rlhf_ray.jobs.rehearsal import config_for_shape
from rlhf_ray.memory.shapes import KNOWN, ModelShape
from rlhf_ray.models.tiny import default_corpus, train_tokenizer
from tests.conftest import ROOT


def test_a_known_shape_becomes_a_config_of_the_same_size():
    tokenizer = train_tokenizer(default_corpus()[:50], 300)
    for name, shape in KNOWN.items():
        config = config_for_shape(shape, tokenizer).to_dict()
        again = ModelShape.from_config(config)
        assert again.params == shape.params and again.kv_bytes_per_token(2) == shape.kv_bytes_per_token(2), name
        assert again.gated_mlp == shape.gated_mlp, name


@pytest.mark.system
@pytest.mark.usefixtures("shared_ray")
def test_rehearse_runs_the_job_on_random_weights_and_sets_memory_beside_the_plan(tmp_path, tiny_model, capsys):
    from rlhf_ray.cli import EXIT_OK, main

    out = tmp_path / "rehearsal"
    code = main(["rehearse", str(ROOT / "configs/quickstart/ppo.yaml"), "--iterations", "2", "--out", str(out),
                 "--set", f"policy.model.path={tiny_model}", "--set", f"reward.model.path={tiny_model}",
                 "--set", f"output_dir={tmp_path / 'ppo'}", "--set", "cluster.dashboard=false",
                 "--set", "logging.progress=false", "--set", "generation.engine=hf"])
    printed = capsys.readouterr().out
    assert code == EXIT_OK, printed
    lines = printed.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("rehearsal: ")):]  # after Ray's actor logs
    assert lines[0] == "rehearsal: 2 iterations with random weights (cpu)"
    assert all(len(line) <= 80 for line in lines if not line.startswith(("config: ", "written: "))), lines
    report = json.loads((out / "rehearsal.json").read_text())
    assert set(report["memory_gib"]) == {"policy", "critic", "reference", "reward", "generation"}
    for role, numbers in report["memory_gib"].items():
        assert numbers["plan"] > 0 and numbers["measured"] > 0, role
        row = next(line for line in lines if line.startswith(role))
        assert f"{numbers['measured']:.2f}" in row and f"{numbers['plan']:.2f}" in row
    assert report["transport"] == "ipc" and report["sync_bytes"] > 0
    assert any(line.startswith("weight sync: ") and "GB/s, ipc)" in line for line in lines)
    assert report["seconds"]["iteration"] > report["seconds"]["training"] > 0
    # the weights were random, not the configured model's, in its shape
    policy_dir = out / "models" / "model-0"
    mine, theirs = load_file(str(next(policy_dir.glob("*.safetensors")))), load_file(
        str(next(tiny_model.glob("*.safetensors"))))
    assert mine.keys() == theirs.keys()
    key = "model.layers.0.mlp.up_proj.weight"
    assert mine[key].shape == theirs[key].shape and not (mine[key].float() == theirs[key]).all()
    assert not (tmp_path / "ppo").exists()  # the configured output_dir is not touched
