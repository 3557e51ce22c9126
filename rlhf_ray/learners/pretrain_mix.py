"""Plain text from mmap corpora for the language-model loss: the pretraining mix of PPO-ptx (InstructGPT's gamma term,
next to every PPO mini-batch) and the whole of a continued-pretraining job."""

from __future__ import annotations

from rlhf_ray.data.collate import collate_lm
from rlhf_ray.data.heldout import HeldOutSplit
from rlhf_ray.data.sampler import MixedCorpus, ProportionalSampler, shard


class PretrainMix:
    """Global batch k is a pure function of (seed, k): a resumed run continues the same sequence, and on another
    number of ranks (same global batch) the same samples are trained on, only dealt out differently. With
    `heldout` (fraction, max samples) a share of each corpus is kept out of every batch for evaluation."""

    def __init__(self, prefixes: list[str], global_batch_size: int, seed: int, pad_token_id: int,
                 weights: list[float] | None = None, heldout: tuple[float, int] | None = None,
                 max_seq_len: int | None = None):
        self.corpus = MixedCorpus.open(prefixes)
        self.splits = [HeldOutSplit(n, *heldout) for n in self.corpus.sizes] if heldout else None
        train_sizes = [s.num_train for s in self.splits] if self.splits else self.corpus.sizes
        self.sampler = ProportionalSampler(train_sizes, weights or [1.0] * len(prefixes), global_batch_size, seed)
        self.pad, self.max_seq_len = pad_token_id, max_seq_len

    def _rows(self, keys: list[tuple[int, int]]) -> list[dict]:
        """Rows for `collate_lm`: plain text, every token a label."""
        ids = [a[: self.max_seq_len].astype("int64").tolist() for a in self.corpus.fetch(keys)]
        return [{"input_ids": row, "labels": row} for row in ids]

    def rank_rows(self, k: int, rank: int, world_size: int) -> list[dict]:
        """This rank's contiguous share of global batch k."""
        mine = shard(self.sampler.batch(k), rank, world_size)
        if self.splits is not None:
            mine = [(j, int(self.splits[j].train_indices([t])[0])) for j, t in mine]
        return self._rows(mine)

    def micro_batches(self, k: int, rank: int, world_size: int, micro_batch_size: int) -> list[dict]:
        """This rank's share of global batch k in micro-batches, right-padded, every real token a label."""
        rows = self.rank_rows(k, rank, world_size)
        return [collate_lm(rows[s: s + micro_batch_size], self.pad) for s in range(0, len(rows), micro_batch_size)]

    def split(self, k: int, rank: int, world_size: int, parts: int) -> list[dict | None]:
        """This rank's share of global batch k in `parts` micro-batches of near-equal rows (None: no row left)."""
        rows = self.rank_rows(k, rank, world_size)
        bounds = [len(rows) * i // parts for i in range(parts + 1)]
        return [collate_lm(rows[a:b], self.pad) if b > a else None for a, b in zip(bounds, bounds[1:])]

    def heldout_rows(self, corpus: int) -> list[dict]:
        """One corpus' held-out samples (needs `heldout`)."""
        return self._rows([(corpus, int(i)) for i in self.splits[corpus].heldout_indices()])

