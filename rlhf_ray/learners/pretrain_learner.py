"""Continued-pretraining learner rank: the language-model loss on every token of plain text from mmap corpora, mixed
by weight (PretrainMix), with held-out perplexity per corpus."""

from __future__ import annotations

import math

from rlhf_ray.config.pretrain import PretrainDataSpec
from rlhf_ray.learners.causal_lm import CausalLMRank
from rlhf_ray.learners.pretrain_mix import PretrainMix


class PretrainLearner(CausalLMRank):
    def __init__(self, *, data: dict, global_batch_size: int, eval_batch_size: int, pad_token_id: int, **kwargs):
        """`data`: the job's PretrainDataSpec (dumped: actor arguments travel as plain data)."""
        super().__init__(**kwargs)
        spec = PretrainDataSpec.model_validate(data)
        self.mix = PretrainMix([c.path for c in spec.corpora], global_batch_size, self.seed, pad_token_id,
                               [c.weight for c in spec.corpora], (spec.heldout_fraction, spec.heldout_max_samples),
                               spec.max_seq_len)
        self.labels = [c.label for c in spec.corpora]
        self.eval_batch_size, self.pad_token_id = eval_batch_size, pad_token_id

    def train_step(self, step: int) -> dict:
        """Global batch `step` of the mix (a pure function of the step: resuming replays and skips nothing)."""
        return self.lm_step(self.mix.micro_batches(step, self.rank, self.world_size, self.micro_batch_size))

    def evaluate(self) -> dict:
        """Held-out loss and perplexity of each corpus (eval_perplexity/NAME), and over all held-out tokens."""
        out, loss, tokens = {}, 0.0, 0.0
        for corpus, label in enumerate(self.labels):
            rows = self.mix.heldout_rows(corpus)
            result = self.lm_eval(self.lm_eval_batches(rows, self.eval_batch_size, self.pad_token_id))
            out[f"eval_perplexity/{label}"] = result["eval_perplexity"]
            loss += result["eval_loss"] * result["eval_tokens"]
            tokens += result["eval_tokens"]
        mean = loss / max(tokens, 1.0)
        return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 50.0)), "eval_tokens": tokens, **out}
