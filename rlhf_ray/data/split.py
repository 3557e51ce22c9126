"""Deterministic phase split (DeepSpeed-Chat's "2,4,4") and weighted blending of several datasets."""

from __future__ import annotations

import hashlib

import numpy as np

from rlhf_ray.data.raw import RawDataset, RawSample

PHASES = ("sft", "rm", "ppo")


def stable_seed(*parts: object) -> int:
    """A seed from the job seed and names, stable across processes and Python versions (unlike hash())."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


def partition_sizes(n: int, shares: tuple[float, ...]) -> list[int]:
    """Sizes proportional to shares that add up to exactly n (largest remainder: no share drifts by more than
    one sample, unlike shifting every boundary by the rounding error)."""
    total = float(sum(shares))
    exact = [n * s / total for s in shares]
    sizes = [int(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (exact[i] - sizes[i], -i), reverse=True)
    for i in by_remainder[: n - sum(sizes)]:
        sizes[i] += 1
    return sizes


def split_indices(n: int, shares: tuple[float, ...], seed: int) -> list[np.ndarray]:
    """Shuffle range(n) with `seed`, then cut it into consecutive parts of the share sizes: disjoint, covering."""
    order = np.random.default_rng(seed).permutation(n)
    bounds = np.cumsum([0] + partition_sizes(n, shares))
    return [order[bounds[i]: bounds[i + 1]] for i in range(len(shares))]


def phase_split(raw: RawDataset, shares: tuple[float, float, float], phase: str, seed: int,
                eval_fraction: float) -> tuple[list[RawSample], list[RawSample]]:
    """This phase's (train, eval) samples of one dataset. A dataset without an eval split first gives up
    `eval_fraction` of its train rows as eval; both pools are then split by the same shares, so the three phases
    never share a sample."""
    p = PHASES.index(phase)
    train, evaluation = raw.train, raw.eval
    if evaluation is None:
        keep, held = split_indices(len(train), (1.0 - eval_fraction, eval_fraction), stable_seed(seed, raw.name, "eval"))
        train, evaluation = [train[i] for i in keep], [train[i] for i in held]
    train_part = split_indices(len(train), shares, stable_seed(seed, raw.name, "train"))[p]
    eval_part = split_indices(len(evaluation), shares, stable_seed(seed, raw.name, "evalsplit"))[p]
    return [train[i] for i in sorted(train_part)], [evaluation[i] for i in sorted(eval_part)]


def blend(parts: list[tuple[list[RawSample], float]], seed: int) -> list[RawSample]:
    """Mix datasets. A weight multiplies a dataset's own size: 1 keeps every sample once (DeepSpeed-Chat's
    concatenation), 2 repeats it twice, 0.5 keeps a random half. The result is shuffled with `seed`."""
    rng = np.random.default_rng(seed)
    mixed: list[RawSample] = []
    for samples, weight in parts:
        want = int(round(len(samples) * weight))
        whole, rest = divmod(want, len(samples)) if samples else (0, 0)
        mixed += samples * whole
        mixed += [samples[i] for i in sorted(rng.choice(len(samples), size=rest, replace=False))] if rest else []
    return [mixed[i] for i in rng.permutation(len(mixed))]
