"""The DPO job end to end on a real local Ray: a DeepSpeed learner and the reference as a Ray role of its own, the
quickstart SFT model and the bundled preference pairs (demo/sort)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhf_ray.config import load_job
from rlhf_ray.jobs.dpo_job import REFERENCE_FILE, run_dpo
from tests.conftest import ROOT

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("shared_ray")]  # one embedded Ray for the module

STEPS = 40


def dpo_job(out, model, *overrides):
    return load_job(ROOT / "configs/quickstart/dpo.yaml",
                    [f"model.path={model}", f"output_dir={out}", "cluster.dashboard=false", "logging.progress=false",
                     f"train.max_steps={STEPS}", *overrides])


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory, sft_model):
    out = tmp_path_factory.mktemp("dpo") / "precomputed"
    return out, run_dpo(dpo_job(out, sft_model))


def test_dpo_raises_held_out_preference_accuracy_over_the_sft_model(precomputed, sft_model):
    out, summary = precomputed
    # the SFT model is its own reference: every implicit reward starts at 0 (chance), then the chosen answers win
    assert summary["eval_accuracy_first"] == pytest.approx(0.5, abs=0.05) and abs(summary["eval_margin_first"]) < 1e-4
    assert summary["eval_accuracy"] >= 0.8 and summary["eval_margin"] > 0.2, summary
    assert summary["eval_loss"] < summary["eval_loss_first"]  # DPO + the chosen answers' NLL (rpo_alpha 1)
    assert summary["eval_chosen_reward"] > summary["eval_rejected_reward"]
    assert summary["reference"] == "precomputed" and (out / REFERENCE_FILE).is_file()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum("train/rewards/margin" in line for line in lines) == STEPS
    before, after = load_file(str(sft_model / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert set(before) == set(after) and any(not torch.equal(before[k], after[k]) for k in before)


def test_an_on_the_fly_reference_gives_the_precomputed_numbers(precomputed, sft_model, tmp_path):
    _, want = precomputed
    got = run_dpo(dpo_job(tmp_path / "fly", sft_model, "dpo.reference.precompute=false"))
    assert got["reference"] == "on the fly" and not (tmp_path / "fly" / REFERENCE_FILE).exists()
    for key in ("eval_accuracy", "eval_margin", "eval_loss", "eval_chosen_logp"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key


def test_a_stopped_run_resumes_with_its_saved_reference_and_ends_as_an_uninterrupted_one(precomputed, sft_model,
                                                                                       tmp_path, caplog):
    _, want = precomputed
    job = dpo_job(tmp_path / "resumed", sft_model, "checkpoint.every_steps=0")
    assert run_dpo(job, stop_after=STEPS // 2)["stopped_at_step"] == STEPS // 2
    with caplog.at_level("INFO", logger="rlhf_ray.jobs.dpo_job"):
        got = run_dpo(job)
    assert any("reference log-probs from" in r.getMessage() for r in caplog.records)  # not scored again
    for key in ("eval_accuracy", "eval_margin", "eval_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
