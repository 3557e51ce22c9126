"""Reward-hacking and collapse signals (rlhf_ray/algorithms/diagnostics.py) and the job's warnings on them."""

from __future__ import annotations

import logging

import pytest
import torch

from rlhf_ray.algorithms.diagnostics import correlation, entropy_collapsed, reward_hacking_signs
from rlhf_ray.jobs.alerts import Diagnostics


def test_correlation_of_reward_and_length():
    lengths = torch.tensor([4.0, 8.0, 12.0, 16.0])
    assert correlation(torch.tensor([1.0, 2.0, 3.0, 4.0]), lengths) == pytest.approx(1.0)
    assert correlation(torch.tensor([4.0, 3.0, 2.0, 1.0]), lengths) == pytest.approx(-1.0)
    # scores 1, 0, 0, 1 against 4, 8, 12, 16: covariance 0
    assert correlation(torch.tensor([1.0, 0.0, 0.0, 1.0]), lengths) == pytest.approx(0.0)
    assert correlation(torch.tensor([2.0, 2.0, 2.0, 2.0]), lengths) == 0.0  # a constant reward: no relation


def test_reward_up_while_accuracy_down_is_a_hacking_sign():
    before = {"reward": 1.0, "task_accuracy": 0.5, "sampled_reward": 0.5, "sampled_task_accuracy": 0.4}
    honest = {"reward": 1.5, "task_accuracy": 0.6, "sampled_reward": 0.8, "sampled_task_accuracy": 0.5}
    assert reward_hacking_signs(before, honest) == []
    hacked = {"reward": 1.5, "task_accuracy": 0.3, "sampled_reward": 0.8, "sampled_task_accuracy": 0.5}
    (sign,) = reward_hacking_signs(before, hacked)
    assert sign.startswith("greedy answers: reward 1.000 -> 1.500") and "0.500 -> 0.300" in sign
    assert reward_hacking_signs({"reward": 1.0}, {"reward": 9.0}) == []  # no rule accuracy: nothing to compare
    assert reward_hacking_signs(before, before | {"reward": 1.01, "task_accuracy": 0.49}) == []  # within margin


def test_entropy_collapse_is_relative_to_the_first_value():
    assert entropy_collapsed(2.0, 0.1, ratio=0.1) and not entropy_collapsed(2.0, 0.3, ratio=0.1)
    assert not entropy_collapsed(0.0, 0.0, ratio=0.1)


def test_the_job_warns_once_for_each_sign(caplog):
    watch = Diagnostics({"reward": 1.0, "task_accuracy": 0.5}, entropy_ratio=0.1)
    with caplog.at_level(logging.WARNING, logger="rlhf_ray.jobs.alerts"):
        for step, entropy in enumerate([2.0, 1.0, 0.1, 0.05], start=1):
            watch.iteration(step, {"policy/entropy": entropy})
        assert watch.evaluation(5, {"reward": 2.0, "task_accuracy": 0.2}) == {"eval/reward_hacking_signs": 1.0}
        assert watch.evaluation(6, {"reward": 2.0, "task_accuracy": 0.1}) == {"eval/reward_hacking_signs": 1.0}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "iteration 3: policy entropy 0.1000 is below 0.10 x its first value 2.0000" in warnings[0]
    assert "iteration 5: possible reward over-optimisation" in warnings[1]
    assert Diagnostics({"reward": 1.0}, 0.1).evaluation(2, {"reward": 3.0}) == {}  # no rule: no metric
