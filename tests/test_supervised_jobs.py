"""SFT and RM jobs end to end on a real local Ray with 2 CPU DeepSpeed ranks, the tiny model and demo/sort."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rlhf_ray.config import load_job
from rlhf_ray.jobs.supervised import run_supervised
from tests.conftest import ROOT

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("shared_ray")]  # one embedded Ray for the module


def job(kind: str, tmp_path, model, *overrides):
    return load_job(ROOT / f"configs/quickstart/{kind}.yaml",
                    [f"model.path={model}", f"output_dir={tmp_path / kind}", "cluster.dashboard=false",
                     "logging.progress=false", *overrides])


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("stage,steps", [(0, 20), (2, None), (3, 20)])
def test_sft_lowers_eval_loss_and_exports_a_plain_hf_model(request, tmp_path, tiny_model, stage, steps):
    """ZeRO-2 on two ranks is the quickstart SFT as shipped: the session's `sft_model`, trained once from the tiny
    model for every test that starts from it, is the run checked there (steps: as many as its epochs make)."""
    if steps is None:
        out = request.getfixturevalue("sft_model").parent
        summary = json.loads((out / "summary.json").read_text())
        steps = summary["steps"]
    else:
        summary = run_supervised(job("sft", tmp_path, tiny_model, f"deepspeed.zero_stage={stage}",
                                     f"train.max_steps={steps}"))
        out = tmp_path / "sft"
    assert summary["eval_loss_last"] < summary["eval_loss_first"] - 1.0
    assert summary["eval_perplexity"] < summary["eval_perplexity_first"]
    assert json.loads((out / "summary.json").read_text())["eval_loss_last"] == summary["eval_loss_last"]
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    prompt = tokenizer(" Human: Sort 3 1 2 0 Assistant:", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    before, after = weights(tiny_model), weights(out / "model")
    assert set(before) == set(after)  # same architecture, full weights gathered (ZeRO-3 included)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (out / "checkpoints").is_dir() and (out / "tensorboard").is_dir()
    # every step reports its gradient norm (fp32 ZeRO-0: DeepSpeed keeps none, the learner measures it)
    norms = [r["train/grad_norm"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if "train/grad_norm" in r]
    assert len(norms) == steps and all(0 < n < float("inf") for n in norms), norms


def test_sft_on_conversations_trains_every_assistant_turn(tmp_path, tiny_model):
    """SFT on a `messages` dataset (a wrong sort, "That is not right. Try again.", the right sort): the loss, on
    the assistant turns only, falls, on a job configured as a user would (a jsonl file and `format.messages_field`)."""
    from rlhf_ray.data import demo_sort

    raw = demo_sort.load()
    for split, samples in (("train", raw.train[:600]), ("test", raw.eval[:64])):
        rows = [{"messages": [{"role": "user", "content": s.prompt.removeprefix(" Human: ").removesuffix(" Assistant:")},
                              {"role": "assistant", "content": s.rejected.strip()},
                              {"role": "user", "content": "That is not right. Try again."},
                              {"role": "assistant", "content": s.chosen.strip()}]} for s in samples]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    sft = job("sft", tmp_path, tiny_model, "train.max_steps=20", "data.split=1,0,0", "data.max_seq_len=64",
              f"data.datasets=[{{name: custom, path: {tmp_path}, format: {{messages_field: messages}}}}]")
    summary = run_supervised(sft)
    assert summary["eval_loss_last"] < summary["eval_loss_first"] - 1.0, summary


def test_reward_model_beats_chance_on_held_out_pairs(rm_model):
    """The quickstart RM as shipped, from the quickstart SFT model: the session's `rm_model` (trained once for every
    test that scores with it) is the run checked."""
    summary = json.loads((rm_model.parent / "summary.json").read_text())
    assert summary["eval_accuracy"] >= 0.65, summary
    assert summary["eval_chosen_mean"] > summary["eval_rejected_mean"]
    rm = AutoModelForSequenceClassification.from_pretrained(rm_model)
    assert rm.config.num_labels == 1 and rm.score.weight.shape[0] == 1  # the head is saved with it


def test_a_zero3_reward_model_on_two_ranks_evaluates_an_uneven_eval_split(tmp_path, tiny_model):
    """129 held-out pairs over 2 ZeRO-3 ranks in batches of 64: one rank has 65 pairs (2 batches), the other 64 (1).
    Every ZeRO-3 forward gathers parameters from both ranks, so before the fix the rank with one batch went on to
    the metrics' all-reduce while the other waited in its second forward, and the job hung until the call timeout.
    Now the short rank runs a discarded forward; every pair is counted once."""
    from rlhf_ray.learners.schedule import eval_batches_in_step

    assert eval_batches_in_step(129, 0, 2, 64) == [list(range(0, 128, 2)), [128]]
    assert eval_batches_in_step(129, 1, 2, 64) == [list(range(1, 129, 2)), None]
    assert eval_batches_in_step(1, 1, 2, 64) == [None]  # a rank with no row still keeps in step
    summary = run_supervised(job("rm", tmp_path, tiny_model, "deepspeed.zero_stage=3", "data.split=1,3,3",
                                 "train.max_steps=2", "train.eval_batch_size=64", "cluster.call_timeout_s=120"))
    assert summary["steps"] == 2
    evals = [r for r in map(json.loads, (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines())
             if "eval_pairs" in r]
    assert len(evals) == 2 and all(r["eval_pairs"] == 129 for r in evals), evals  # at the start and the end


def test_lora_with_checkpointing_trains_only_adapters_and_exports_merged(tmp_path, tiny_model):
    sft = job("sft", tmp_path, tiny_model, "model.lora.rank=8", "model.lora.target_modules=[q_proj, v_proj]",
              "model.gradient_checkpointing=true",
              "train.max_steps=10", "optim.lr=0.01")
    summary = run_supervised(sft)
    assert summary["eval_loss_last"] < summary["eval_loss_first"]
    before, after = weights(tiny_model), weights(tmp_path / "sft" / "model")
    assert set(before) == set(after), "merged export has the base model's keys, no adapter keys"
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed


RESUMABLE = ["train.max_steps=12"]  # the resume and restart tests' runs: the same steps, weights and data


@pytest.fixture(scope="module")
def undisturbed_sft(tmp_path_factory, tiny_model):
    """The weights an SFT run of RESUMABLE exports when nothing stops it (checkpoints do not change them)."""
    out = tmp_path_factory.mktemp("undisturbed")
    run_supervised(job("sft", out, tiny_model, *RESUMABLE, "checkpoint.every_steps=0"))
    return weights(out / "sft" / "model")


def test_resume_after_a_stop_matches_an_uninterrupted_run(tmp_path, tiny_model, undisturbed_sft):
    resumed = job("sft", tmp_path / "b", tiny_model, *RESUMABLE, "checkpoint.every_steps=0")
    partial = run_supervised(resumed, stop_after=4)
    assert partial["stopped_at_step"] == 4
    assert [p.name for p in (tmp_path / "b" / "sft" / "checkpoints").iterdir()] == ["step-00000004"]
    log = tmp_path / "b" / "sft" / "metrics.jsonl"
    with log.open("a") as f:  # what a driver killed during step 5, after logging it, leaves behind
        f.write(json.dumps({"step": 5, "time": 0.0, "train/loss": 99.0}) + "\n")
    run_supervised(resumed)
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    train_steps = [r["step"] for r in logged if "train/loss" in r]
    assert train_steps == list(range(1, 13)), train_steps  # step 5 redone once, the stale line gone
    assert 99.0 not in [r["train/loss"] for r in logged if "train/loss" in r]
    b = weights(tmp_path / "b" / "sft" / "model")
    for key in undisturbed_sft:
        torch.testing.assert_close(undisturbed_sft[key], b[key], rtol=0, atol=1e-6, msg=key)


def test_killed_rank_restarts_the_job_by_itself_and_ends_as_an_undisturbed_run(tmp_path, tiny_model,
                                                                                undisturbed_sft, monkeypatch):
    """cluster.learner_restarts for SFT: a rank killed after the first checkpoint ends the attempt; the job places
    its ranks again, resumes from the newest checkpoint, logs each step once, counts the restart, and exports the
    weights an undisturbed run exports."""
    from tests.conftest import at_checkpoints
    from tests.test_fault_tolerance import kill

    disturbed = job("sft", tmp_path / "b", tiny_model, *RESUMABLE, "checkpoint.every_steps=1",
                    "checkpoint.keep_last=20")
    out = tmp_path / "b" / "sft"
    at_checkpoints(monkeypatch, kill("sft-learner-1", disturbed.cluster.namespace))
    summary = run_supervised(disturbed)
    assert summary["steps"] == 12
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))  # redone steps logged once
    assert steps[0]["actors/learner_restarts"] == 0 and steps[-1]["actors/learner_restarts"] == 1
    b = weights(out / "model")
    for key in undisturbed_sft:
        torch.testing.assert_close(undisturbed_sft[key], b[key], rtol=0, atol=1e-6, msg=key)
