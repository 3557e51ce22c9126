"""The critic learner: a value head on every answer token, trained toward the GAE returns with a clipped loss."""

from __future__ import annotations

import torch

from rlhf_ray.actors.payload import by_reference
from rlhf_ray.algorithms.losses import value_loss
from rlhf_ray.algorithms.batch import Experience, RolloutBatch
from rlhf_ray.learners.ppo_base import PPOLearnerRank, TrainReport
from rlhf_ray.models.loading import load_scalar_model, token_values
from rlhf_ray.models.packing import pack, packed_values


class CriticLearner(PPOLearnerRank):
    role = "critic"

    def __init__(self, *, clip_value: float, pad_token_id: int, **kwargs):
        super().__init__(**kwargs)
        self.clip_value, self.pad_token_id = clip_value, pad_token_id

    def build_model(self) -> torch.nn.Module:
        return load_scalar_model(self.model_spec, self.pad_token_id)

    def _values(self, batch: RolloutBatch) -> torch.Tensor:
        """V(state before answer token t) = the head at position P - 1 + t (packed: where token t is predicted)."""
        answer_len = batch.answer_width
        if self.packed:
            rows = pack(batch.sequences, batch.attention_mask, answer_len, share_prompts=True)
            return packed_values(self.deepspeed.module, rows, self.deepspeed)[rows.answer_index] * batch.action_mask
        start = batch.sequences.shape[1] - answer_len - 1
        values = token_values(self.deepspeed.module, batch.sequences, batch.attention_mask, forward=self.deepspeed)
        return values[:, start: start + answer_len] * batch.action_mask

    @by_reference
    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """Values of this rank's slice of the batch (rank order)."""
        return self.over_my_rows(batch, self._values)

    def train(self, minibatches) -> TrainReport:
        def token_loss(micro: Experience):
            loss = value_loss(self._values(micro), micro.values, micro.returns, micro.action_mask, self.clip_value)
            return loss * micro.action_mask.sum(), {}

        return self.run_epochs(minibatches, token_loss)
