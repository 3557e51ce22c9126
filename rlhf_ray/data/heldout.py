"""A corpus split into training and held-out samples without an index array: O(1) memory at any corpus size.

With h held-out samples out of n, the stride is s = n // h and the held-out samples are the last of each of the
first h blocks of s samples (indices s-1, 2s-1, ..., hs-1): spread over the whole corpus, not just its tail (a
corpus written document by document would otherwise hold out its last documents only). Training sample t is the
t-th of the remaining n - h, found by arithmetic."""

from __future__ import annotations

import math

import numpy as np


class HeldOutSplit:
    def __init__(self, num_samples: int, fraction: float, max_samples: int):
        if num_samples < 2:
            raise ValueError(f"a corpus of {num_samples} sample(s) cannot be split into training and held-out "
                             f"samples; it needs at least 2")
        self.num_samples = num_samples
        self.num_heldout = max(1, min(math.ceil(num_samples * fraction), max_samples, num_samples - 1))
        self.stride = num_samples // self.num_heldout  # >= 1; == 1 would hold out everything, excluded above
        if self.stride == 1:
            self.stride = 2
            self.num_heldout = num_samples // 2

    @property
    def num_train(self) -> int:
        return self.num_samples - self.num_heldout

    def heldout_indices(self) -> np.ndarray:
        return np.arange(1, self.num_heldout + 1, dtype=np.int64) * self.stride - 1

    def train_indices(self, t: np.ndarray | list[int]) -> np.ndarray:
        """Corpus indices of training samples t (0 <= t < num_train)."""
        t = np.asarray(t, dtype=np.int64)
        if t.size and (t.min() < 0 or t.max() >= self.num_train):
            raise IndexError(f"training sample out of range [0, {self.num_train})")
        per_block = self.stride - 1
        in_blocks = t < self.num_heldout * per_block
        block, within = np.divmod(t, per_block)
        return np.where(in_blocks, block * self.stride + within, t + self.num_heldout)
