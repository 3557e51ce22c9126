"""What the policy and critic learners share: each rank's slice of a batch, and PPO epochs of mini-batches
whose loss is a token mean over the whole global mini-batch."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from rlhf_ray.data.split import stable_seed
from rlhf_ray.learners.base import LearnerRank

Batch = dict[str, torch.Tensor]


class PPOLearnerRank(LearnerRank):
    def __init__(self, *, train_batch_size: int, ppo_epochs: int, temperature: float, **kwargs):
        super().__init__(**kwargs)
        self.train_batch_size, self.ppo_epochs, self.temperature = train_batch_size, ppo_epochs, temperature

    def rank_slice(self, n: int) -> slice:
        """Contiguous equal chunks: every rank runs the same number of forwards (ZeRO-3 gathers are collective)."""
        if n % self.world_size:
            raise ValueError(f"{n} samples do not split over {self.world_size} ranks")
        per = n // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)

    def micro_slices(self, n: int) -> list[slice]:
        return [slice(i, min(i + self.micro_batch_size, n)) for i in range(0, n, self.micro_batch_size)]

    def to_device(self, batch: Batch, rows) -> Batch:
        return {k: v[rows].to(self.engine.device) for k, v in batch.items() if v.dim() > 0}

    def run_epochs(self, batch: Batch, iteration: int,
                   token_loss: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]]) -> dict[str, float]:
        """`token_loss(micro_batch)` returns (sum of per-token losses, stats summed over tokens). Gradients equal
        those of sum / (answer tokens of the global mini-batch), whatever the split over ranks and micro-batches;
        reported numbers are token means per mini-batch, averaged over mini-batches."""
        n = batch["action_mask"].shape[0]
        self.engine.train()
        totals: dict[str, float] = {}
        steps = 0
        for epoch in range(self.ppo_epochs):
            order = np.random.default_rng(stable_seed(self.seed, "ppo", iteration, epoch)).permutation(n)
            for start in range(0, n, self.train_batch_size):
                minibatch = order[start: start + self.train_batch_size]
                mine = minibatch[self.rank_slice(len(minibatch))]
                micro = [mine[s] for s in self.micro_slices(len(mine))]
                (tokens,) = self.all_reduce_sum([float(batch["action_mask"][mine].sum())])
                scale = self.world_size * self.engine.gradient_accumulation_steps() / max(tokens, 1.0)
                for rows in micro:
                    loss_sum, stats = token_loss(self.to_device(batch, torch.as_tensor(rows)))
                    self.engine.backward(loss_sum * scale)
                    self.engine.step()
                    for key, value in {"loss": loss_sum.item(), **stats}.items():
                        totals[key] = totals.get(key, 0.0) + value / max(tokens, 1.0)
                steps += 1
        reduced = self.all_reduce_sum(list(totals.values()))
        info = self.step_info()
        return {k: v / max(steps, 1) for k, v in zip(totals, reduced)} | info
