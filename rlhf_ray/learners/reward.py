"""Reward-model learner rank: a scalar head on a causal-LM backbone, trained on (chosen, rejected) pairs."""

from __future__ import annotations

import torch

from rlhf_ray.algorithms.reward_loss import divergence_window_loss, end_scores, pairwise_loss
from rlhf_ray.data.collate import collate_pairs
from rlhf_ray.learners.rank import SupervisedRank
from rlhf_ray.models.loading import load_scalar_model, token_values


class RewardLearner(SupervisedRank):
    def __init__(self, *, loss: str, **kwargs):
        super().__init__(**kwargs)
        self.loss_kind = loss

    def build_model(self) -> torch.nn.Module:
        return load_scalar_model(self.model_spec, self.pad_token_id)

    def _forward(self, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, chosen end scores, rejected end scores) of a micro-batch of pairs."""
        batch = {k: v.to(self.deepspeed.device) for k, v in collate_pairs(rows, self.pad_token_id).items()}
        values = token_values(self.deepspeed.module, batch["input_ids"], batch["attention_mask"],
                              forward=self.deepspeed)
        scores = end_scores(values, batch["attention_mask"])
        n = len(rows)
        chosen, rejected = scores[:n], scores[n:]
        if self.loss_kind == "divergence_window":
            ids, mask = batch["input_ids"], batch["attention_mask"]
            loss = divergence_window_loss(values[:n], values[n:], ids[:n], ids[n:], mask[:n], mask[n:])
        else:
            loss = pairwise_loss(chosen, rejected)
        return loss, chosen.detach(), rejected.detach()

    def train_step(self, step: int) -> dict:
        self.deepspeed.train()
        loss_total, correct, pairs = 0.0, 0.0, 0
        for rows in self.step_micro_batches(step):
            loss, chosen, rejected = self._forward(rows)
            self.deepspeed.backward(loss)
            self.optimizer_step()
            loss_total += loss.item() * len(rows)
            correct += (chosen > rejected).float().sum().item()
            pairs += len(rows)
        loss_total, correct, pairs = self.all_reduce_sum([loss_total, correct, float(pairs)])
        return {"loss": loss_total / pairs, "accuracy": correct / pairs, **self.step_info()}

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Pair accuracy (chosen scored above rejected) and mean end scores over the whole eval split."""
        self.deepspeed.eval()
        loss, correct, chosen_sum, rejected_sum, count = 0.0, 0.0, 0.0, 0.0, 0
        for indices, counted in self.eval_batches():
            batch_loss, chosen, rejected = self._forward([self.eval_rows[i] for i in indices])
            if not counted:
                continue
            count += len(indices)
            loss += batch_loss.item() * len(indices)
            correct += (chosen > rejected).float().sum().item()
            chosen_sum += chosen.sum().item()
            rejected_sum += rejected.sum().item()
        loss, correct, chosen_sum, rejected_sum, n = self.all_reduce_sum(
            [loss, correct, chosen_sum, rejected_sum, float(count)])
        n = max(n, 1.0)
        return {"eval_loss": loss / n, "eval_accuracy": correct / n, "eval_chosen_mean": chosen_sum / n,
                "eval_rejected_mean": rejected_sum / n, "eval_pairs": n}
