"""The policy's EMA (ppo.ema): the average's arithmetic, where it is kept, and that its time counts as the
learner's own (it was left out, so a GPU rehearsal of the OPT-1.3B shape called ~3 s of each 9 s iteration
orchestration)."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import torch

from rlhf_ray.learners.policy import PolicyLearner, average_into, host_average
from rlhf_ray.learners.ppo_base import TrainReport


def test_average_is_beta_times_the_average_plus_the_rest_times_the_weights():
    torch.manual_seed(0)
    average, weights = torch.randn(64), torch.randn(64, dtype=torch.bfloat16)
    expected = 0.9 * average + 0.1 * weights.float()
    before = weights.clone()
    average_into(average, weights, 0.9)
    torch.testing.assert_close(average, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(weights, before)  # the live weights are only read


def test_host_average_is_an_fp32_copy_on_the_host():
    weights = {"w": torch.ones(3, dtype=torch.float16)}
    ema = host_average(weights, torch.device("cpu"))
    assert ema["w"].dtype == torch.float32 and ema["w"].device.type == "cpu"
    ema["w"].add_(1)
    assert weights["w"].tolist() == [1.0, 1.0, 1.0]


def test_update_ema_averages_the_live_parameters_of_every_group():
    live = {"a": torch.full((2,), 2.0), "b": torch.full((3,), 4.0)}
    learner = object.__new__(PolicyLearner)
    learner.ema_beta, learner.ema = 0.5, host_average({k: torch.zeros_like(v) for k, v in live.items()},
                                                      torch.device("cpu"))
    learner.deepspeed = SimpleNamespace(device=torch.device("cpu"))
    learner.gathered_groups = lambda bucket_bytes, copy=True: iter([[("a", live["a"])], [("b", live["b"])]])
    PolicyLearner.update_ema(learner)
    assert learner.ema["a"].tolist() == [1.0, 1.0] and learner.ema["b"].tolist() == [2.0, 2.0, 2.0]


def test_the_learners_seconds_include_the_ema_update():
    learner = object.__new__(PolicyLearner)
    learner.ema_beta = 0.99
    epochs = TrainReport("policy", {"loss": 0.5}, seconds=0.01, steps_applied=1, padding_fraction=0.0)
    learner.run_epochs = lambda minibatches, token_loss: epochs
    learner.update_ema = lambda: time.sleep(0.2)
    report = PolicyLearner.train(learner, minibatches=None)
    assert report.ema_seconds >= 0.2
    assert report.seconds >= 0.21  # what the driver subtracts from the phase's wall time
    assert report.metrics()["policy/ema_seconds"] == report.ema_seconds

    learner.run_epochs = lambda minibatches, token_loss: dataclasses.replace(epochs, steps_applied=0)
    skipped = PolicyLearner.train(learner, minibatches=None)  # no step applied: nothing to average in
    assert skipped.ema_seconds < 0.1 and skipped.seconds < 0.1


def test_a_train_report_logs_the_names_runs_always_had():
    critic = TrainReport("critic", {"loss": 0.25, "lr": 1e-5}, seconds=1.5, steps_applied=2, padding_fraction=0.1)
    assert critic.metrics() == {"critic/loss": 0.25, "critic/lr": 1e-5, "critic/seconds": 1.5,
                                "critic/steps_applied": 2.0, "critic/padding_fraction": 0.1}
