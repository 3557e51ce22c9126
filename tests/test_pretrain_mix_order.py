"""PPO-ptx: each pretraining-mix micro-batch is run right before its PPO micro-batch's backward pass, so one
micro-batch's graph is alive at a time (before: every mix forward of a mini-batch ran first, all graphs alive)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlhf_ray.algorithms.batch import RolloutBatch
from rlhf_ray.learners.policy import PolicyLearner
from rlhf_ray.learners.ppo_base import PPOLearnerRank


class RecordingEngine:
    """Stands in for the DeepSpeed engine: a one-weight 'model' whose calls are logged."""

    device = torch.device("cpu")

    def __init__(self, events: list[str]):
        self.events, self.weight = events, torch.nn.Parameter(torch.zeros(5))
        self.boundaries: list[bool] = []

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.boundaries.append(is_boundary)

    def __call__(self, input_ids, attention_mask):
        self.events.append("mix forward")
        return SimpleNamespace(logits=self.weight.expand(*input_ids.shape, 5))

    def backward(self, loss):
        self.events.append("backward")

    def train(self):
        pass

    def gradient_accumulation_steps(self):
        return 2


def test_each_mix_micro_batch_runs_with_its_ppo_micro_batch():
    events: list[str] = []
    mix = SimpleNamespace(micro_batches=lambda k, rank, ws, mbs: [
        {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long),
         "labels": torch.ones(2, 3, dtype=torch.long)} for _ in range(2)])
    rank = SimpleNamespace(deepspeed=RecordingEngine(events), mix=mix, rank=0, world_size=1, micro_batch_size=2,
                           ptx_coef=0.5, all_reduce_sum=lambda values: values, optimizer_step=lambda: None,
                           step_info=lambda: {}, loss_aggregation="token_mean",
                           step_counts={"applied": 0, "skipped": 0}, max_tokens=None, packed=False,
                           role="policy")
    rank.micro_rows = lambda batch, rows: PPOLearnerRank.micro_rows(rank, batch, rows)
    rank.rank_slice = lambda n: PPOLearnerRank.rank_slice(rank, n)
    rank.micro_batch = lambda batch, rows: PPOLearnerRank.micro_batch(rank, batch, rows)
    rank.auxiliary_losses = lambda minibatches, step, n: PolicyLearner.auxiliary_losses(rank, minibatches, step, n)
    minibatches = SimpleNamespace(rows=[[0, 1, 2, 3]], meta=SimpleNamespace(rollout_index=0))
    batch = RolloutBatch(sequences=torch.ones(4, 5, dtype=torch.long), attention_mask=torch.ones(4, 5, dtype=torch.long),
                         action_mask=torch.ones(4, 2), prompt_width=3)

    def token_loss(micro):
        events.append("ppo forward")
        return rank.deepspeed.weight.sum() * 0 + micro.action_mask.sum(), {}

    report = PPOLearnerRank.run_epochs(rank, minibatches, token_loss, batch)
    assert events == ["ppo forward", "mix forward", "backward"] * 2
    assert rank.deepspeed.boundaries == [False, True]  # the optimizer steps after the mini-batch's last one
    assert report.stats["ptx_loss"] > 0 and report.metrics()["policy/ptx_loss"] == report.stats["ptx_loss"]
