"""SFT learner rank: next-token cross-entropy on answer tokens, averaged over every label token of the global
batch (not per micro-batch, so short and long samples weigh by their tokens and padding weighs nothing)."""

from __future__ import annotations

import math

import torch

from rlhf_ray.algorithms.losses import first_predicting_column, lm_loss_sum
from rlhf_ray.data.collate import collate_sft
from rlhf_ray.data.tokenized import IGNORE_INDEX
from rlhf_ray.learners.base import SupervisedRank
from rlhf_ray.models.loading import last_logits_only, load_causal_lm


def label_tokens(rows: list[dict]) -> int:
    """Tokens that carry a loss: labels after the one-position shift, excluding -100."""
    return sum(sum(1 for label in r["labels"][1:] if label != IGNORE_INDEX) for r in rows)


class SFTLearner(SupervisedRank):
    def build_model(self) -> torch.nn.Module:
        return load_causal_lm(self.model_spec)

    def _loss_sum(self, rows: list[dict]) -> torch.Tensor:
        batch = {k: v.to(self.engine.device) for k, v in collate_sft(rows, self.pad_token_id).items()}
        # Logits only where they predict an answer token: the vocabulary projection of the prompt is skipped.
        keep = batch["labels"].shape[1] - first_predicting_column(batch["labels"])
        logits = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             **last_logits_only(self.engine.module, keep)).logits
        return lm_loss_sum(logits, batch["labels"])

    def train_step(self, step: int) -> dict:
        micro = self.step_micro_batches(step)
        (tokens,) = self.all_reduce_sum([sum(label_tokens(rows) for rows in micro)])
        # DeepSpeed averages gradients over ranks and divides by accumulation steps; undo both so the gradient
        # is that of (sum of token losses) / (label tokens of the whole global batch).
        scale = self.world_size * self.engine.gradient_accumulation_steps() / max(tokens, 1.0)
        self.engine.train()
        loss_total = 0.0
        for rows in micro:
            loss_sum = self._loss_sum(rows)
            self.engine.backward(loss_sum * scale)
            self.optimizer_step()
            loss_total += loss_sum.item()
        (loss_total,) = self.all_reduce_sum([loss_total])
        return {"loss": loss_total / max(tokens, 1.0), "tokens": tokens, **self.step_info()}

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean token loss over the whole eval split; perplexity = exp(mean loss), all-reduced before exp."""
        self.engine.eval()
        loss, tokens = 0.0, 0
        for rows in self.eval_batches():
            loss += self._loss_sum(rows).item()
            tokens += label_tokens(rows)
        loss, tokens = self.all_reduce_sum([loss, float(tokens)])
        mean = loss / max(tokens, 1.0)
        return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 50.0)), "eval_tokens": tokens}
