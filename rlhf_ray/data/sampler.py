"""Proportional multi-corpus sampling: every global batch holds a fixed number of samples from each corpus.

Why this design (against the KnowLM sampler it replaces):

* The per-batch counts come from weights, not hand-written quotas: ``weights x global_batch_size`` rounded by
  largest remainder, so they always sum to the batch size and are the same for every batch.
* No corpus is padded or truncated to match the others ("drop_mode"): each corpus is simply an endless
  sequence of epochs, each epoch a fresh seeded permutation of its samples. A small corpus with a big share is
  repeated more often, a big one with a small share is not finished as soon; an epoch of a corpus covers every
  sample exactly once.
* Draw ``p`` of corpus ``j`` (counting from 0 over the whole run) is sample ``perm(seed, j, p // n_j)[p % n_j]``,
  and batch ``k`` takes draws ``k*c_j .. (k+1)*c_j - 1``. So any batch is computed directly from its number:
  resuming at batch ``k`` replays nothing and gives exactly the batches of an uninterrupted run.
* The corpora are interleaved evenly inside a batch (not laid out corpus by corpus), so when the batch is cut
  into contiguous per-rank slices (``shard``) every rank sees every corpus in about the configured ratio.

Torch-free; a permutation costs 4 bytes per sample of a corpus while that corpus' epoch is in use.
"""

from __future__ import annotations

import os
from fractions import Fraction
from typing import Iterator, Sequence

import numpy as np

from rlhf_ray.config.pretrain import batch_counts
from rlhf_ray.data.mmap_corpus import MMapCorpus

Batch = list[tuple[int, int]]


def interleave(counts: Sequence[int]) -> list[int]:
    """The corpus of each slot of a batch, spreading every corpus evenly: the t-th item of corpus j sits at key
    (t + 1/2) / c_j; slots are sorted by key (ties: lower corpus index). Any contiguous run of w slots holds
    about ``c_j * w / B`` items of corpus j (off by less than 2)."""
    keys = [(Fraction(2 * t + 1, 2 * c), j) for j, c in enumerate(counts) for t in range(c)]
    return [j for _, j in sorted(keys)]


def shard(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's contiguous slice of a global batch (the batch size must divide evenly)."""
    if world_size < 1 or not 0 <= rank < world_size or len(batch) % world_size:
        raise ValueError(f"cannot split a batch of {len(batch)} into {world_size} equal shards (rank {rank})")
    per = len(batch) // world_size
    return batch[rank * per:(rank + 1) * per]


class ProportionalSampler:
    """Infinite deterministic stream of global batches, each a list of ``(corpus_index, sample_index)``.

    ``batch(k)`` is pure (any k, any order); iterating yields ``batch(position)`` and advances ``position``
    (the number of batches consumed), which is all ``state_dict()`` has to remember."""

    def __init__(self, corpus_sizes: Sequence[int], weights: Sequence[float], global_batch_size: int, seed: int):
        if len(corpus_sizes) != len(weights) or not corpus_sizes:
            raise ValueError(f"need one weight per corpus: {len(corpus_sizes)} sizes, {len(weights)} weights")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.corpus_sizes = [int(n) for n in corpus_sizes]
        self.weights = [float(w) for w in weights]
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.counts = batch_counts(self.weights, self.global_batch_size)
        for j, (n, c, w) in enumerate(zip(self.corpus_sizes, self.counts, self.weights)):
            if c and n < 1:
                raise ValueError(f"corpus {j} is empty but has {c} samples per batch")
            if w > 0 and c == 0:
                raise ValueError(f"corpus {j} has weight {w} but gets 0 of {self.global_batch_size} samples per "
                                 f"batch after rounding; raise the batch size or its weight, or set it to 0")
        self._slots = interleave(self.counts)
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self.position = 0

    def permutation(self, corpus: int, epoch: int) -> np.ndarray:
        """Order of corpus ``corpus`` in ``epoch``; seeded by (seed, corpus, epoch), so reshuffled every epoch.
        Only this epoch and its neighbours stay cached per corpus (a batch can straddle an epoch boundary)."""
        key = (corpus, epoch)
        perm = self._perms.get(key)
        if perm is None:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, corpus, epoch])))
            n = self.corpus_sizes[corpus]
            perm = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
            rng.shuffle(perm)
            for old in [k for k in self._perms if k[0] == corpus and k[1] not in (epoch - 1, epoch + 1)]:
                del self._perms[old]
            self._perms[key] = perm
        return perm

    def draws(self, corpus: int, start: int, count: int) -> np.ndarray:
        """Sample indices of draws ``start .. start + count - 1`` of one corpus."""
        n = self.corpus_sizes[corpus]
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            epoch, offset = divmod(start + done, n)
            take = min(count - done, n - offset)
            out[done:done + take] = self.permutation(corpus, epoch)[offset:offset + take]
            done += take
        return out

    def batch(self, k: int) -> Batch:
        """Global batch number ``k`` (0-based), computed directly."""
        if k < 0:
            raise ValueError(f"batch number must be >= 0, got {k}")
        picks = [iter(self.draws(j, k * c, c).tolist()) if c else iter(()) for j, c in enumerate(self.counts)]
        return [(j, next(picks[j])) for j in self._slots]

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        out = self.batch(self.position)
        self.position += 1
        return out

    def epochs_done(self) -> list[float]:
        """How many passes over each corpus the consumed batches amount to (for logging)."""
        return [self.position * c / n if n else 0.0 for c, n in zip(self.counts, self.corpus_sizes)]

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "corpus_sizes": list(self.corpus_sizes),
                "counts": list(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state['position']``. Refuses a state from a different mix, whose positions would mean
        different samples (KnowLM's resume silently required the same batch and ratios)."""
        for key in ("seed", "corpus_sizes", "counts"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state does not match this sampler: {key} was {state[key]}, "
                                 f"now {getattr(self, key)}")
        position = int(state["position"])
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        self.position = position


class MixedCorpus:
    """Several MMapCorpus opened side by side, addressed by ``(corpus_index, sample_index)``; torch-free."""

    def __init__(self, corpora: Sequence[MMapCorpus]):
        self.corpora = list(corpora)

    @classmethod
    def open(cls, prefixes: Sequence[str | os.PathLike]) -> "MixedCorpus":
        return cls([MMapCorpus(p) for p in prefixes])

    @property
    def sizes(self) -> list[int]:
        """Samples per corpus, in the order a ProportionalSampler expects."""
        return [len(c) for c in self.corpora]

    def __len__(self) -> int:
        return len(self.corpora)

    def __getitem__(self, key: tuple[int, int]) -> np.ndarray:
        corpus, index = key
        return self.corpora[corpus][index]

    def fetch(self, batch: Batch) -> list[np.ndarray]:
        """Token arrays of a (global or sharded) batch, in batch order."""
        return [self.corpora[j][i] for j, i in batch]
