"""Reward-hacking and collapse signals (rlhf_ray/algorithms/diagnostics.py) and the job's warnings on them."""

from __future__ import annotations

import logging

import pytest
import torch

from rlhf_ray.algorithms.diagnostics import correlation, entropy_collapsed, reward_hacking_signs
from rlhf_ray.jobs.alerts import Diagnostics
from rlhf_ray.jobs.held_out import Answered, Evaluation


def test_correlation_of_reward_and_length():
    lengths = torch.tensor([4.0, 8.0, 12.0, 16.0])
    assert correlation(torch.tensor([1.0, 2.0, 3.0, 4.0]), lengths) == pytest.approx(1.0)
    assert correlation(torch.tensor([4.0, 3.0, 2.0, 1.0]), lengths) == pytest.approx(-1.0)
    # scores 1, 0, 0, 1 against 4, 8, 12, 16: covariance 0
    assert correlation(torch.tensor([1.0, 0.0, 0.0, 1.0]), lengths) == pytest.approx(0.0)
    assert correlation(torch.tensor([2.0, 2.0, 2.0, 2.0]), lengths) == 0.0  # a constant reward: no relation


def evals(*points):
    """(iteration, greedy reward, greedy check) -> the series Diagnostics keeps."""
    return {"greedy": list(points)}


def held_out(reward: float, check: float | None = None) -> Evaluation:
    """An evaluation of greedy answers with this reward and check."""
    return Evaluation(Answered(reward, 0.0, check, None if check is None else 0.0))


def test_reward_rising_while_the_check_falls_over_consecutive_evaluations_is_a_hacking_sign():
    honest = evals((0, 1.0, 0.5), (3, 1.5, 0.6), (6, 1.8, 0.7))
    assert reward_hacking_signs(honest, evaluations=2) == []
    # rose together to 6, then parted: the reward kept rising, the check fell at 9 and at 12
    parted = evals((0, 1.0, 0.5), (3, 1.5, 0.6), (6, 1.8, 0.7), (9, 2.0, 0.6), (12, 2.3, 0.4))
    (sign,) = reward_hacking_signs(parted, evaluations=2)
    assert sign.answers == "greedy" and sign.parted_at == 6 and sign.steps == (6, 9, 12)
    assert sign.describe() == ("greedy answers: at iterations 6, 9, 12 the reward went 1.800 -> 2.000 -> 2.300 "
                               "while the held-out check went 0.700 -> 0.600 -> 0.400")
    first4 = {"greedy": parted["greedy"][:4]}
    assert reward_hacking_signs(first4, evaluations=2) == []  # one evaluation of parting is not yet a trend
    assert [s.parted_at for s in reward_hacking_signs(first4, evaluations=1)] == [6]
    assert reward_hacking_signs(parted, evaluations=0) == []  # off
    # the run is followed back as far as it goes: parted at 3 when 6 already diverged
    longer = evals((0, 1.0, 0.5), (3, 1.5, 0.6), (6, 1.8, 0.5), (9, 2.0, 0.4), (12, 2.3, 0.3))
    assert reward_hacking_signs(longer, evaluations=2)[0].parted_at == 3
    # a pause in the reward's rise ends the run; moves within the margin do not count
    assert reward_hacking_signs(evals((0, 1.0, 0.5), (3, 1.5, 0.4), (6, 1.5, 0.3), (9, 1.6, 0.2)), 2) == []
    assert reward_hacking_signs(evals((0, 1.0, 0.5), (3, 1.01, 0.49), (6, 1.02, 0.48)), 2) == []
    # sampled answers are watched on their own
    sampled = {"greedy": honest["greedy"], "sampled": parted["greedy"]}
    assert [s.answers for s in reward_hacking_signs(sampled, 2)] == ["sampled"]


def test_entropy_collapse_is_relative_to_the_first_value():
    assert entropy_collapsed(2.0, 0.1, ratio=0.1) and not entropy_collapsed(2.0, 0.3, ratio=0.1)
    assert not entropy_collapsed(0.0, 0.0, ratio=0.1)


def test_the_job_warns_once_for_each_sign_naming_where_reward_and_check_parted(caplog):
    watch = Diagnostics(held_out(1.0, 0.5), entropy_ratio=0.1, evaluations=2,
                        check="my.module:gold")
    with caplog.at_level(logging.WARNING, logger="rlhf_ray.jobs.alerts"):
        for step, entropy in enumerate([2.0, 1.0, 0.1, 0.05], start=1):
            watch.iteration(step, {"policy/entropy": entropy})
        assert watch.evaluation(2, held_out(1.5, 0.6)) == {"eval/reward_hacking_signs": 0.0}
        assert watch.evaluation(4, held_out(2.0, 0.4)) == {"eval/reward_hacking_signs": 0.0}
        assert watch.evaluation(6, held_out(2.5, 0.2)) == {"eval/reward_hacking_signs": 1.0,
                                                                             "eval/parted_at": 2.0}
        assert watch.evaluation(8, held_out(3.0, 0.1))["eval/parted_at"] == 2.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "iteration 3: policy entropy 0.1000 is below 0.10 x its first value 2.0000" in warnings[0]
    assert warnings[1].startswith("iteration 6: possible reward over-optimisation (reward hacking): the reward keeps "
                                  "rising while the held-out check (my.module:gold) falls; they parted after "
                                  "iteration 2: greedy answers: at iterations 2, 4, 6")
    assert Diagnostics.opening(held_out(1.0, 0.5)) == {"eval/reward_hacking_signs": 0.0}  # the series starts with the job
    unchecked = Diagnostics(held_out(1.0), 0.1)
    assert Diagnostics.opening(held_out(1.0)) == {}
    assert unchecked.evaluation(2, held_out(3.0)) == {}  # no check: no metric
    assert unchecked.evaluation(4, held_out(9.0)) == {} and unchecked.series() == {}  # and nothing to watch
