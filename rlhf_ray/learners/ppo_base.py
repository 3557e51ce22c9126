"""What the policy and critic learners share: each rank's slice of a batch, and PPO epochs of mini-batches
whose loss is a mean over the whole global mini-batch (of its answer tokens, or of its answers: `loss_aggregation`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from rlhf_ray.algorithms.experience import pad_answer_columns, row_slices, trim_pad_columns
from rlhf_ray.algorithms.losses import LossAggregation, loss_units
from rlhf_ray.learners.base import LearnerRank

Batch = dict[str, torch.Tensor]
TokenLoss = Callable[[Batch], tuple[torch.Tensor, dict[str, float]]]


class PPOLearnerRank(LearnerRank):
    loss_aggregation: LossAggregation = "token_mean"
    """What `token_loss`'s sum is averaged over (algorithms/losses.aggregated_sum): the critic's is token_mean."""

    def __init__(self, *, temperature: float, **kwargs):
        super().__init__(**kwargs)
        self.temperature = temperature

    def rank_slice(self, n: int) -> slice:
        """Contiguous equal chunks: every rank runs the same number of forwards (ZeRO-3 gathers are collective)."""
        if n % self.world_size:
            raise ValueError(f"{n} samples do not split over {self.world_size} ranks")
        per = n // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)

    @torch.no_grad()
    def over_my_rows(self, batch: Batch, forward: Callable[[Batch], torch.Tensor]) -> torch.Tensor:
        """`forward` (per-token results of a micro-batch) over this rank's slice of the batch (rank order),
        micro-batch by micro-batch, in eval mode: [rows, A]."""
        self.engine.eval()
        rows = torch.arange(batch["sequences"].shape[0])[self.rank_slice(batch["sequences"].shape[0])]
        answer_len = batch["action_mask"].shape[1]
        return torch.cat([pad_answer_columns(forward(self.micro_batch(batch, rows[s])).cpu(), answer_len)
                          for s in row_slices(len(rows), self.micro_batch_size)])

    def micro_batch(self, batch: Batch, rows) -> Batch:
        """Rows of the batch on this rank's device, without the pad columns all of them share."""
        part = {k: v[rows] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        return {k: v.to(self.engine.device) for k, v in trim_pad_columns(part).items()}

    def fetch(self, plan) -> Batch:
        """The experience a TrainingPlan points to, from the object store."""
        import ray

        return ray.get(plan.refs[0])

    def auxiliary_losses(self, plan, step: int, micro_batches: int) -> list[Callable[[], tuple[torch.Tensor, dict]]]:
        """Extra loss terms for each micro-batch of mini-batch `step`, already normalised over the global batch
        (e.g. the policy's pretraining mix): one function per micro-batch returning (loss, stats), called right
        before that micro-batch's backward pass, so only one micro-batch's graph is alive at a time; [] for none."""
        return []

    def run_epochs(self, batch: Batch, plan, token_loss: TokenLoss) -> dict[str, float]:
        """`token_loss(micro_batch)` returns (its loss sum under `loss_aggregation`, stats summed over tokens).
        Gradients equal those of sum / (units of the global mini-batch: answer tokens, or answers for the sequence
        means), whatever the split over ranks and micro-batches; reported stats are token means per mini-batch
        (the loss: the aggregated mean), averaged over mini-batches. The mini-batches (rows of the
        experience, epoch after epoch) come from the replay buffer's plan. `steps_applied`: optimizer steps of
        this call that changed the weights (0: every one was skipped for a non-finite gradient)."""
        started = time.perf_counter()
        applied_before = self.step_counts["applied"]
        self.engine.train()
        totals: dict[str, float] = {}
        scale = self.world_size * self.engine.gradient_accumulation_steps()  # DeepSpeed divides by both
        for step, minibatch in enumerate(plan.minibatches):
            # in row order: the answers to one prompt are neighbours, so a micro-batch shares its prompts' forward
            # (models/shared_prompt.py); a mini-batch's gradient is the same sum whatever its rows' order
            rows = np.sort(np.asarray(minibatch))
            mine = rows[self.rank_slice(len(rows))]
            micro = [mine[s] for s in row_slices(len(mine), self.micro_batch_size)]
            mask = batch["action_mask"][mine]
            tokens, units = (max(n, 1.0) for n in self.all_reduce_sum(
                [float(mask.sum()), loss_units(mask, self.loss_aggregation)]))
            extras = self.auxiliary_losses(plan, step, len(micro)) or [None] * len(micro)
            for part, extra in zip(micro, extras):
                loss_sum, stats = token_loss(self.micro_batch(batch, torch.as_tensor(part)))
                loss = loss_sum / units
                stats = {"loss": loss_sum.item() / units, **{k: v / tokens for k, v in stats.items()}}
                if extra is not None:
                    extra_loss, extra_stats = extra()
                    loss = loss + extra_loss
                    stats |= extra_stats
                self.engine.backward(loss * scale)
                self.optimizer_step()
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
        reduced = self.all_reduce_sum(list(totals.values()))
        means = {k: v / max(len(plan.minibatches), 1) for k, v in zip(totals, reduced)}
        return means | self.step_info() | {"seconds": time.perf_counter() - started,
                                            "steps_applied": float(self.step_counts["applied"] - applied_before)}
