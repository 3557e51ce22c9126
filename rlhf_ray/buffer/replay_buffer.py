"""The shared replay buffer (a Ray actor): experience as object references with metadata, never the tensors.

The PPO loop `put`s a reference to each rollout's experience, with the policy version that sampled it, as soon as
the rollout is scored; it `take`s one entry per update, on its own schedule (in async mode with several rollouts in
flight, several may be put before one is taken). A take gets the oldest entry still fresh enough and, with it, the
mini-batch order of every PPO epoch, so the policy and critic groups walk the same mini-batches. Entries more than
`max_staleness` versions behind the learner are refused, on the way in and on the way out; a full buffer evicts its
oldest entry; both are counted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from rlhf_ray.data.split import stable_seed


@dataclass
class ExperienceMeta:
    version: int
    """Policy version of the engines that sampled it."""
    samples: int
    """Rows in the experience batch."""
    rollout_index: int
    """Index of the rollout it was scored from (its prompts and sampling seed; the PPO iteration in sync mode)."""
    prompt_indices: list[int] = field(default_factory=list)
    """Dataset indices of its prompts."""
    created: float = field(default_factory=time.time)


@dataclass
class Minibatches:
    """What a learner group trains on: one experience reference and the row indices of each mini-batch, epoch
    after epoch (identical for every group that gets them: policy and critic walk the same mini-batches)."""

    refs: list
    """[ObjectRef] of the Experience (wrapped in a list so Ray passes the reference, not the payload)."""
    rows: list[list[int]]
    """The experience rows of each mini-batch, epoch after epoch."""
    meta: ExperienceMeta
    staleness: int
    entries: int = 0
    """Entries the buffer holds after this take (saves the trainer a round trip)."""
    stats: dict[str, float] = field(default_factory=dict)
    """The buffer's metrics after this take, for the log."""


@dataclass(frozen=True)
class PutResult:
    """The buffer's answer to a put: whether it kept the entry, and how many it holds now."""

    accepted: bool
    entries: int

    def __bool__(self) -> bool:
        return self.accepted


class ReplayBuffer:
    def __init__(self, *, rank: int = 0, world_size: int = 1, capacity: int, max_staleness: int):
        self.capacity, self.max_staleness = capacity, max_staleness
        self.entries: deque[tuple[list, ExperienceMeta]] = deque()
        self.learner_version = 0
        self.counts = {"put": 0, "taken": 0, "refused_stale": 0, "evicted": 0}
        self.last_staleness = 0

    def _stale(self, meta: ExperienceMeta) -> bool:
        return self.learner_version - meta.version > self.max_staleness

    def put(self, refs: list, meta: dict, learner_version: int) -> PutResult:
        """Add one experience reference, unless it is already too stale to ever be used (then it is dropped). A full
        buffer drops its oldest entry to make room."""
        self.learner_version = max(self.learner_version, learner_version)
        entry = ExperienceMeta(**meta)
        if self._stale(entry):
            self.counts["refused_stale"] += 1
            return PutResult(False, len(self.entries))
        if len(self.entries) >= self.capacity:
            self.entries.popleft()
            self.counts["evicted"] += 1
        self.entries.append((refs, entry))
        self.counts["put"] += 1
        return PutResult(True, len(self.entries))

    def take(self, learner_version: int, train_batch_size: int, epochs: int, seed: int,
             group_size: int = 1) -> Minibatches | None:
        """The oldest entry within `max_staleness` versions of `learner_version`, with its mini-batches (whole
        groups of `group_size` rows where they fit: `minibatch_rows`). Older entries met on the way are dropped and
        counted; None when none is left (put more)."""
        self.learner_version = max(self.learner_version, learner_version)
        while self.entries:
            refs, meta = self.entries.popleft()
            if self._stale(meta):
                self.counts["refused_stale"] += 1
                continue
            self.counts["taken"] += 1
            self.last_staleness = self.learner_version - meta.version
            rows = minibatch_rows(meta.samples, train_batch_size, epochs, stable_seed(seed, "ppo", meta.rollout_index),
                                  group_size)
            return Minibatches(refs, rows, meta, self.last_staleness, len(self.entries), self.stats())
        return None

    def stats(self) -> dict[str, float]:
        now = time.time()
        ages = [now - meta.created for _, meta in self.entries]
        return {"buffer/entries": len(self.entries), "buffer/samples": sum(m.samples for _, m in self.entries),
                "buffer/oldest_age_s": max(ages, default=0.0), "buffer/staleness": self.last_staleness,
                **{f"buffer/{k}": v for k, v in self.counts.items()}}

    def metas(self) -> list[dict]:
        return [asdict(meta) for _, meta in self.entries]


def minibatch_rows(n: int, train_batch_size: int, epochs: int, seed: int, group_size: int = 1) -> list[list[int]]:
    """Each epoch a fresh seeded permutation of the n rows, cut into consecutive mini-batches. Rows come in groups
    of `group_size` consecutive answers to one prompt: where the groups tile both the rows and a mini-batch, the
    groups are permuted instead, whole, so a mini-batch holds every answer of its prompts and the learners run
    each prompt's forward once for all of them (models/shared_prompt.py; a permutation of rows would put 16
    answers of up to 16 prompts in a mini-batch of 16: 1.48x the training time of whole groups, benchmarks/HISTORY.md
    "Mini-batches of whole answer groups")."""
    rng = np.random.default_rng(seed)
    whole = group_size > 1 and n % group_size == 0 and train_batch_size % group_size == 0
    rows = []
    for _ in range(epochs):
        if whole:
            order = (rng.permutation(n // group_size)[:, None] * group_size + np.arange(group_size)).reshape(-1)
        else:
            order = rng.permutation(n)
        rows += [order[i: i + train_batch_size].tolist() for i in range(0, n, train_batch_size)]
    return rows
