"""Recompute the DPO golden values of tests/test_algorithms_dpo.py with TRL's own expressions.

    pip install --target /tmp/trl --no-deps "trl>=1.16"
    PYTHONPATH=/tmp/trl .venv/bin/python scripts/golden_dpo_from_trl.py

Checks that TRL's DPOTrainer._compute_loss still computes the sigmoid and IPO losses with the expressions below
(their source lines must be present), then evaluates them on the test's inputs (mean over pairs, float32)."""

import inspect

import torch
import torch.nn.functional as F
from trl.trainer import dpo_trainer

source = inspect.getsource(dpo_trainer.DPOTrainer._compute_loss)
assert "per_sequence_loss = -F.logsigmoid(self.beta * delta_score)" in source
assert "per_sequence_loss = (ipo_delta - 1 / (2 * self.beta)) ** 2" in source
assert "chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)" in source

chosen, rejected = torch.tensor([-5.0, -7.5, -3.0]), torch.tensor([-6.0, -7.0, -9.0])
ref_chosen, ref_rejected = torch.tensor([-5.5, -7.0, -4.0]), torch.tensor([-5.0, -7.2, -8.0])
chosen_tokens, rejected_tokens = torch.tensor([4.0, 6.0, 2.0]), torch.tensor([5.0, 3.0, 8.0])
beta = 0.1
delta_score = (chosen - ref_chosen) - (rejected - ref_rejected)
print("sigmoid", (-F.logsigmoid(beta * delta_score)).mean().item())
ipo_delta = (chosen - ref_chosen) / chosen_tokens - (rejected - ref_rejected) / rejected_tokens
print("ipo", ((ipo_delta - 1 / (2 * beta)) ** 2).mean().item())
