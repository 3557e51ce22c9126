"""The held-out evaluation's standard errors: over prompts, not over answers."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from rlhf_ray.jobs.ppo.evaluation import mean_and_error


def test_the_error_is_over_prompts_so_answers_to_one_prompt_count_once():
    # 100 prompts, 8 answers each, every answer to a prompt alike (the policy solves a problem always or never):
    # the 800 answers hold only 100 prompts' worth of evidence
    solved = [1.0] * 30 + [0.0] * 70
    values = [v for v in solved for _ in range(8)]
    prompts = [i for i in range(100) for _ in range(8)]
    mean, error = mean_and_error(values, prompts)
    assert mean == pytest.approx(0.3)
    assert error == pytest.approx(statistics.stdev(solved) / 10)  # the greedy error of 100 answers
    assert error > 2.5 * math.sqrt(0.3 * 0.7 / 800)  # a binomial error over 800 answers would understate it

    # answers that vary within each prompt as much as across prompts: close to the binomial error over answers
    rng = random.Random(0)
    values = [float(rng.random() < 0.3) for _ in range(800)]
    mean, error = mean_and_error(values, prompts)
    binomial = math.sqrt(mean * (1 - mean) / 800)
    assert 0.8 * binomial < error < 1.2 * binomial


def test_one_answer_per_prompt_is_the_standard_error_of_the_mean_and_one_prompt_has_none():
    values = [0.5, 2.0, 1.0, 3.5]
    assert mean_and_error(values, [3, 1, 0, 2]) == pytest.approx((1.75, statistics.stdev(values) / 2))
    # prompts with different numbers of answers: the mean is over answers, the error the ratio estimator's
    mean, error = mean_and_error([1.0, 1.0, 0.0], [0, 0, 1])
    assert mean == pytest.approx(2 / 3) and error == pytest.approx(math.sqrt(2 * ((2 - 4 / 3) ** 2 + (2 / 3) ** 2)) / 3)
    assert math.isnan(mean_and_error([1.0, 0.0], [5, 5])[1])
