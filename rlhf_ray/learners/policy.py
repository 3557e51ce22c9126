"""The policy learner: scores its own samples (old log-probs) and takes clipped PPO steps on them."""

from __future__ import annotations

import torch

from rlhf_ray.algorithms.logprobs import answer_logprobs
from rlhf_ray.algorithms.losses import policy_loss
from rlhf_ray.learners.ppo_base import Batch, PPOLearnerRank
from rlhf_ray.models.loading import load_causal_lm
from rlhf_ray.models.weight_buckets import pack


class PolicyLearner(PPOLearnerRank):
    def __init__(self, *, clip_ratio: float, dual_clip: float | None, **kwargs):
        super().__init__(**kwargs)
        self.clip_ratio, self.dual_clip = clip_ratio, dual_clip

    def build_model(self) -> torch.nn.Module:
        return load_causal_lm(self.model_spec)

    def _logprobs(self, batch: Batch) -> torch.Tensor:
        answer_len = batch["action_mask"].shape[1]
        logits = self.engine(input_ids=batch["sequences"], attention_mask=batch["attention_mask"]).logits
        return answer_logprobs(logits, batch["sequences"], answer_len, self.temperature) * batch["action_mask"]

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        """This rank's slice of the batch (rank order), at the sampling temperature."""
        self.engine.eval()
        mine = self.rank_slice(batch["sequences"].shape[0])
        rows = torch.arange(batch["sequences"].shape[0])[mine]
        return torch.cat([self._logprobs(self.to_device(batch, rows[s])).cpu()
                          for s in self.micro_slices(len(rows))])

    def train(self, batch: Batch, iteration: int) -> dict[str, float]:
        def token_loss(micro: Batch):
            logp = self._logprobs(micro)
            loss, stats = policy_loss(logp, micro["old_logp"], micro["advantages"], micro["action_mask"],
                                      self.clip_ratio, self.dual_clip)
            tokens = micro["action_mask"].sum()
            return loss * tokens, {k: v.item() * tokens.item() for k, v in stats.items()}

        return {f"policy/{k}": v for k, v in self.run_epochs(batch, iteration, token_loss).items()}

    def publish_weights(self, bucket_bytes: int) -> tuple[list, int] | None:
        """Rank 0 puts the full weights in the object store as buckets and returns (refs, bytes); the engines fetch
        them from there. A collective under ZeRO-3: every rank calls it, groups of parameters are gathered in turn."""
        import ray

        refs, total = [], 0
        for group in self.gathered_groups(bucket_bytes):
            for bucket in pack(group):
                refs.append(ray.put(bucket))
                total += bucket.nbytes
        return (refs, total) if self.rank == 0 else None
