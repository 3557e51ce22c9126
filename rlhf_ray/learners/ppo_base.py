"""What the policy and critic learners share: each rank's slice of a batch, and PPO epochs of mini-batches
whose loss is a mean over the whole global mini-batch (of its answer tokens, or of its answers: `loss_aggregation`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rlhf_ray.algorithms.batch import Experience, RolloutBatch
from rlhf_ray.algorithms.experience import pad_answer_columns, row_slices
from rlhf_ray.algorithms.losses import LossAggregation, loss_units
from rlhf_ray.algorithms.micro_batches import by_token_budget, prompt_groups, row_lengths, split_to
from rlhf_ray.distributed import torch_threads
from rlhf_ray.learners.rank import LearnerRank
from rlhf_ray.models import packing

TokenLoss = Callable[[Experience], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class TrainReport:
    """One learner rank's answer to `train`, one PPO update: what the driver acts on, typed, beside the statistics
    it only logs (whose names depend on the loss)."""

    role: str
    """"policy" or "critic": the prefix of its metric names."""
    stats: dict[str, float]
    """The loss's statistics, token means over the update's mini-batches (loss, clip_fraction, kl, entropy, ...), and
    the optimizer's state after it (lr, grad_norm, applied, steps_skipped, peak_memory_gib)."""
    seconds: float
    """The whole call on this rank: fetching the experience, the epochs, the policy's EMA."""
    steps_applied: int
    """Optimizer steps of this update that changed the weights (0: each was skipped for a non-finite gradient)."""
    padding_fraction: float
    """The share of the training forwards' tokens that were padding."""
    ema_seconds: float | None = None
    """The policy's: averaging its weights into the EMA (0.0 without one); None for the critic."""

    def metrics(self) -> dict[str, float]:
        """The flat names every run logs: `policy/loss`, `critic/seconds`, ..."""
        typed = {"seconds": self.seconds, "steps_applied": float(self.steps_applied),
                 "padding_fraction": self.padding_fraction}
        if self.ema_seconds is not None:
            typed["ema_seconds"] = self.ema_seconds
        return {f"{self.role}/{k}": v for k, v in (self.stats | typed).items()}


class PPOLearnerRank(LearnerRank):
    role: str = ""
    """The role's name in metrics: "policy", "critic"."""
    loss_aggregation: LossAggregation = "token_mean"
    """What `token_loss`'s sum is averaged over (algorithms/losses.aggregated_sum): the critic's is token_mean."""

    def __init__(self, *, temperature: float, max_tokens_per_micro_batch: int | None = None,
                 pack_sequences: bool | None = None, scoring_threads: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.temperature = temperature
        self.scoring_threads = scoring_threads
        """Threads for over_my_rows (None: the process's): fewer where other roles score at the same time
        (jobs/threads.py)."""
        self.max_tokens, self.packed = max_tokens_per_micro_batch, pack_sequences

    def setup(self, master_addr: str, master_port: int, total_steps: int, collective_timeout_s: float = 1800.0) -> dict:
        info = super().setup(master_addr, master_port, total_steps, collective_timeout_s)
        requested = False if self.model_spec.gradient_checkpointing and self.packed is None else self.packed
        self.packed = packing.enable_if(self.deepspeed.module, requested)
        return info

    def rank_slice(self, n: int) -> slice:
        """Contiguous equal chunks: every rank runs the same number of forwards (ZeRO-3 gathers are collective)."""
        if n % self.world_size:
            raise ValueError(f"{n} samples do not split over {self.world_size} ranks")
        per = n // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)

    @torch.no_grad()
    def over_my_rows(self, batch: RolloutBatch, forward: Callable[[RolloutBatch], torch.Tensor]) -> torch.Tensor:
        """`forward` (per-token results of a micro-batch) over this rank's slice of the batch (rank order),
        micro-batch by micro-batch, in eval mode, on `scoring_threads`: [rows, A]."""
        self.deepspeed.eval()
        rows = np.arange(len(batch))[self.rank_slice(len(batch))]
        out = None
        with torch_threads(self.scoring_threads):
            for part in self.micro_rows(batch, rows):
                values = pad_answer_columns(forward(self.micro_batch(batch, torch.as_tensor(part))).cpu(),
                                            batch.answer_width)
                if out is None:
                    out = values.new_zeros(len(rows), batch.answer_width)
                out[torch.as_tensor(part - rows[0])] = values
        return out

    def micro_rows(self, batch: RolloutBatch, rows: np.ndarray) -> list[np.ndarray]:
        """This rank's `rows` of the batch in micro-batches: every `micro_batch_size` rows in their order, or, with a
        token budget (`max_tokens_per_micro_batch`), sorted by length and cut by it (algorithms/micro_batches.py),
        as many micro-batches on every rank (packed rows: cut by their tokens)."""
        if self.max_tokens is None:
            return [rows[s] for s in row_slices(len(rows), self.micro_batch_size)]
        prompt, answer = row_lengths(batch.attention_mask[rows], batch.action_mask[rows])
        parts = by_token_budget(prompt, answer, self.max_tokens, prompt_groups(batch.sequences[rows], batch.answer_width),
                                packed=self.packed)
        (count,) = self.all_reduce_max([len(parts)])
        return [rows[p] for p in split_to(parts, prompt, answer, int(count))]

    def micro_batch(self, batch: RolloutBatch, rows):
        """Rows of the batch (or experience) on this rank's device, without the pad columns all of them share."""
        return batch.select(rows).trimmed().to(self.deepspeed.device)

    def fetch(self, minibatches) -> Experience:
        """The experience a Minibatches points to, from the object store."""
        import ray

        return ray.get(minibatches.refs[0])

    def auxiliary_losses(self, minibatches, step: int, micro_batches: int
                         ) -> list[Callable[[], tuple[torch.Tensor, dict]]]:
        """Extra loss terms for each micro-batch of mini-batch `step`, already normalised over the global batch
        (e.g. the policy's pretraining mix): one function per micro-batch returning (loss, stats), called right
        before that micro-batch's backward pass, so only one micro-batch's graph is alive at a time; [] for none."""
        return []

    def run_epochs(self, minibatches, token_loss: TokenLoss, batch: Experience | None = None) -> TrainReport:
        """PPO epochs on the experience `minibatches` points to (`batch`: that experience, already fetched).
        `token_loss(micro_batch)` returns (its loss sum under `loss_aggregation`, stats summed over tokens).
        Gradients equal those of sum / (units of the global mini-batch: answer tokens, or answers for the sequence
        means), whatever the split over ranks and micro-batches; reported stats are token means per mini-batch
        (the loss: the aggregated mean), averaged over mini-batches. The mini-batches (rows of the
        experience, epoch after epoch) come from the replay buffer (Minibatches)."""
        started = time.perf_counter()
        batch = self.fetch(minibatches) if batch is None else batch
        applied_before = self.step_counts["applied"]
        self.deepspeed.train()
        totals: dict[str, float] = {}
        padding = [0.0, 0.0]  # pad tokens, tokens of every training forward
        scale = self.world_size * self.deepspeed.gradient_accumulation_steps()  # DeepSpeed divides by both
        for step, minibatch in enumerate(minibatches.rows):
            # in row order: the answers to one prompt are neighbours, so a micro-batch shares its prompts' forward
            # (models/shared_prompt.py); a mini-batch's gradient is the same sum whatever its rows' order
            rows = np.sort(np.asarray(minibatch))
            mine = rows[self.rank_slice(len(rows))]
            micro = self.micro_rows(batch, mine)
            mask = batch.action_mask[mine]
            tokens, units = (max(n, 1.0) for n in self.all_reduce_sum(
                [float(mask.sum()), loss_units(mask, self.loss_aggregation)]))
            extras = self.auxiliary_losses(minibatches, step, len(micro)) or [None] * len(micro)
            for i, (part, extra) in enumerate(zip(micro, extras)):
                # the last micro-batch of the mini-batch steps the optimizer, however many there were
                self.deepspeed.set_gradient_accumulation_boundary(i == len(micro) - 1)
                micro_batch = self.micro_batch(batch, torch.as_tensor(part))
                padding = [total + n for total, n in zip(padding, micro_batch.padding(self.packed))]
                loss_sum, stats = token_loss(micro_batch)
                loss = loss_sum / units
                stats = {"loss": loss_sum.item() / units, **{k: v / tokens for k, v in stats.items()}}
                if extra is not None:
                    extra_loss, extra_stats = extra()
                    loss = loss + extra_loss
                    stats |= extra_stats
                self.deepspeed.backward(loss * scale)
                self.optimizer_step()
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
        *reduced, pads, tokens = self.all_reduce_sum([*totals.values(), *padding])
        means = {k: v / max(len(minibatches.rows), 1) for k, v in zip(totals, reduced)}
        return TrainReport(self.role, means | self.step_info(), seconds=time.perf_counter() - started,
                           steps_applied=self.step_counts["applied"] - applied_before,
                           padding_fraction=pads / max(tokens, 1.0))
