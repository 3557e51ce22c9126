"""The language-model loss of a learner rank, shared by SFT (answer tokens) and continued pretraining (every token):
next-token cross-entropy averaged over every loss-carrying token of the global batch, not per micro-batch, so short
and long samples weigh by their tokens and padding weighs nothing."""

from __future__ import annotations

import math

import torch

from rlhf_ray.algorithms.losses import first_predicting_column, lm_loss_sum, loss_tokens
from rlhf_ray.data.collate import collate_lm
from rlhf_ray.data.tokenized import IGNORE_INDEX
from rlhf_ray.learners.rank import LearnerRank
from rlhf_ray.learners.schedule import eval_share
from rlhf_ray.models.loading import last_logits_only, load_causal_lm

Batch = dict[str, torch.Tensor]


class CausalLMRank(LearnerRank):
    def build_model(self) -> torch.nn.Module:
        return load_causal_lm(self.model_spec)

    def lm_loss_sum(self, batch: Batch) -> torch.Tensor:
        """Summed token loss of one collated batch (input_ids / attention_mask / labels). Logits only where they
        predict a label: the vocabulary projection of columns no row needs (SFT's prompt) is skipped."""
        batch = {k: v.to(self.deepspeed.device) for k, v in batch.items()}
        keep = batch["labels"].shape[1] - first_predicting_column(batch["labels"])
        logits = self.deepspeed(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             **last_logits_only(self.deepspeed.module, keep)).logits
        return lm_loss_sum(logits, batch["labels"])

    def lm_step(self, micro_batches: list[Batch]) -> dict:
        """One optimizer step over this rank's collated micro-batches."""
        (tokens,) = self.all_reduce_sum([float(sum(loss_tokens(b["labels"]) for b in micro_batches))])
        # DeepSpeed averages gradients over ranks and divides by accumulation steps; undo both so the gradient
        # is that of (sum of token losses) / (loss tokens of the whole global batch).
        scale = self.world_size * self.deepspeed.gradient_accumulation_steps() / max(tokens, 1.0)
        self.deepspeed.train()
        loss_total = 0.0
        for batch in micro_batches:
            loss_sum = self.lm_loss_sum(batch)
            self.deepspeed.backward(loss_sum * scale)
            self.optimizer_step()
            loss_total += loss_sum.item()
        seen = float(sum(int(b["attention_mask"].sum()) for b in micro_batches))
        loss_total, seen = self.all_reduce_sum([loss_total, seen])
        return {"loss": loss_total / max(tokens, 1.0), "tokens": tokens, "input_tokens": seen, **self.step_info()}

    def lm_eval_batches(self, rows: list[dict], batch_size: int, pad_id: int) -> list[Batch]:
        """This rank's share of evaluation `rows` (input_ids / labels), collated in batches; padded with loss-free
        copies of a row so that every rank runs as many forwards (see eval_share)."""
        mine, fill = eval_share(len(rows), self.rank, self.world_size)
        share = [rows[i] for i in mine] + [{**rows[0], "labels": [IGNORE_INDEX] * len(rows[0]["labels"])}] * fill
        return [collate_lm(share[i: i + batch_size], pad_id) for i in range(0, len(share), batch_size)]

    @torch.no_grad()
    def lm_eval(self, batches: list[Batch]) -> dict:
        """Mean token loss over every rank's `batches`; perplexity = exp(mean loss), all-reduced before exp. Under
        ZeRO-3 every rank must pass the same number of batches (each forward gathers parameters collectively)."""
        self.deepspeed.eval()
        loss, tokens = 0.0, 0.0
        for batch in batches:
            loss += self.lm_loss_sum(batch).item()
            tokens += loss_tokens(batch["labels"])
        loss, tokens = self.all_reduce_sum([loss, tokens])
        mean = loss / max(tokens, 1.0)
        return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 50.0)), "eval_tokens": tokens}
