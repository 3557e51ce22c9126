"""Phase split and blending: deterministic by seed, disjoint across phases, exact sizes."""

from __future__ import annotations

from rlhf_ray.data.raw import RawDataset, RawSample
from rlhf_ray.data.split import PHASES, blend, partition_sizes, phase_split, split_indices


def _raw(n: int, n_eval: int | None = None) -> RawDataset:
    train = [RawSample(f" Human: q{i} Assistant:", f" a{i}", f" b{i}") for i in range(n)]
    evaluation = None if n_eval is None else [RawSample(f" Human: e{i} Assistant:", " x", " y") for i in range(n_eval)]
    return RawDataset("toy", train, evaluation)


def test_partition_sizes_sum_exactly_and_never_drift_more_than_one():
    for n in range(0, 50):
        sizes = partition_sizes(n, (2, 4, 4))
        assert sum(sizes) == n
        assert all(abs(s - n * w / 10) < 1 for s, w in zip(sizes, (2, 4, 4)))
    assert partition_sizes(10, (2, 4, 4)) == [2, 4, 4]
    assert partition_sizes(7, (2, 4, 4)) == [1, 3, 3]
    assert partition_sizes(5, (10, 0, 0)) == [5, 0, 0]


def test_split_indices_are_a_seeded_disjoint_cover():
    parts = split_indices(100, (2, 4, 4), seed=3)
    flat = sorted(int(i) for p in parts for i in p)
    assert flat == list(range(100))
    again = split_indices(100, (2, 4, 4), seed=3)
    assert all((a == b).all() for a, b in zip(parts, again))
    other = split_indices(100, (2, 4, 4), seed=4)
    assert any((a != b).any() for a, b in zip(parts, other))


def test_phases_are_disjoint_and_carve_eval_when_missing():
    raw = _raw(200)
    seen_train, seen_eval = set(), set()
    for phase in PHASES:
        train, evaluation = phase_split(raw, (2, 4, 4), phase, seed=1, eval_fraction=0.1)
        prompts = {s.prompt for s in train}
        evals = {s.prompt for s in evaluation}
        assert not prompts & evals
        assert not prompts & (seen_train | seen_eval) and not evals & (seen_train | seen_eval)
        seen_train |= prompts
        seen_eval |= evals
    assert len(seen_train) == 180 and len(seen_eval) == 20  # every row used once


def test_existing_eval_split_is_split_by_the_same_shares():
    raw = _raw(100, n_eval=50)
    train, evaluation = phase_split(raw, (2, 4, 4), "sft", seed=0, eval_fraction=0.1)
    assert (len(train), len(evaluation)) == (20, 10)
    assert all(s.prompt.startswith(" Human: e") for s in evaluation)


def test_same_seed_same_split_and_order():
    raw = _raw(100)
    a = phase_split(raw, (2, 4, 4), "rm", seed=7, eval_fraction=0.1)
    b = phase_split(raw, (2, 4, 4), "rm", seed=7, eval_fraction=0.1)
    c = phase_split(raw, (2, 4, 4), "rm", seed=8, eval_fraction=0.1)
    assert a == b and a != c


def test_blend_weights_multiply_each_dataset():
    one = [RawSample(f"a{i}") for i in range(10)]
    two = [RawSample(f"b{i}") for i in range(10)]
    mixed = blend([(one, 1.0), (two, 1.0)], seed=0)
    assert sorted(s.prompt for s in mixed) == sorted(s.prompt for s in one + two)
    mixed = blend([(one, 2.0), (two, 0.5)], seed=0)
    assert sum(s.prompt.startswith("a") for s in mixed) == 20
    halves = [s for s in mixed if s.prompt.startswith("b")]
    assert len(halves) == 5 and len(set(halves)) == 5
    assert blend([(one, 2.0), (two, 0.5)], seed=0) == mixed
