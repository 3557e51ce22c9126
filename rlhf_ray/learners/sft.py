"""SFT learner rank: next-token cross-entropy on answer tokens (causal_lm.py), on the rows of the SFT phase."""

from __future__ import annotations

from rlhf_ray.data.collate import collate_lm
from rlhf_ray.learners.rank import SupervisedRank
from rlhf_ray.learners.causal_lm import CausalLMRank


class SFTLearner(SupervisedRank, CausalLMRank):
    def train_step(self, step: int) -> dict:
        return self.lm_step([collate_lm(rows, self.pad_token_id) for rows in self.step_micro_batches(step)])

    def evaluate(self) -> dict:
        return self.lm_eval(self.lm_eval_batches(self.eval_rows, self.eval_batch_size, self.pad_token_id))
