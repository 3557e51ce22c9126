"""DPO losses (rlhf_ray/algorithms/dpo_loss.py) against golden values.

The sigmoid and IPO values were computed once (2026-11-25) with TRL 1.16's expressions from
trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss (loss_type "sigmoid": -F.logsigmoid(beta * delta_score);
"ipo": (ipo_delta - 1 / (2 * beta)) ** 2 with per-token-averaged log-ratios; f_divergence_type reverse_kl, the mean
over pairs), on the inputs below; scripts/golden_dpo_from_trl.py checks those lines are in TRL's source and
evaluates them in float32. Conservative DPO (label smoothing) is the sigmoid loss of TRL's earlier versions and of Mitchell (2023)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ray.algorithms.dpo_loss import dpo_loss

T = torch.tensor
CHOSEN, REJECTED = T([-5.0, -7.5, -3.0]), T([-6.0, -7.0, -9.0])
REF_CHOSEN, REF_REJECTED = T([-5.5, -7.0, -4.0]), T([-5.0, -7.2, -8.0])
CHOSEN_TOKENS, REJECTED_TOKENS = T([4.0, 6.0, 2.0]), T([5.0, 3.0, 8.0])


def test_sigmoid_and_ipo_equal_trl():
    loss, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1)
    assert loss.item() == pytest.approx(0.6492851376533508, abs=1e-6)
    loss, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1, loss_type="ipo",
                       chosen_tokens=CHOSEN_TOKENS, rejected_tokens=REJECTED_TOKENS)
    assert loss.item() == pytest.approx(22.506250381469727, abs=1e-5)
    with pytest.raises(ValueError, match="token count"):
        dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1, loss_type="ipo")


def test_conservative_dpo_mixes_the_flipped_label():
    # pair 0: h = (0.5) - (-1.0) = 1.5; with eps = 0.1: -(0.9) log s(0.15) - 0.1 log s(-0.15)
    loss, _ = dpo_loss(CHOSEN[:1], REJECTED[:1], REF_CHOSEN[:1], REF_REJECTED[:1], beta=0.1, label_smoothing=0.1)

    def log_sigmoid(x):
        return -math.log1p(math.exp(-x))

    assert loss.item() == pytest.approx(-0.9 * log_sigmoid(0.15) - 0.1 * log_sigmoid(-0.15), abs=1e-6)


def test_implicit_rewards_margin_and_accuracy():
    _, metrics = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1)
    # beta x log-ratios: chosen [0.05, -0.05, 0.1], rejected [-0.1, 0.02, -0.1]
    assert metrics["rewards/chosen"].item() == pytest.approx(0.1 / 3, abs=1e-6)
    assert metrics["rewards/rejected"].item() == pytest.approx(-0.18 / 3, abs=1e-6)
    assert metrics["rewards/margin"].item() == pytest.approx((0.15 - 0.07 + 0.2) / 3, abs=1e-6)
    assert metrics["rewards/accuracy"].item() == pytest.approx(2 / 3)


def test_the_loss_pushes_chosen_up_and_rejected_down():
    chosen, rejected = CHOSEN.clone().requires_grad_(), REJECTED.clone().requires_grad_()
    dpo_loss(chosen, rejected, REF_CHOSEN, REF_REJECTED, beta=0.1)[0].backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # descent raises chosen, lowers rejected


def test_pairs_are_packed_chosen_first_after_their_shared_prompt():
    from rlhf_ray.algorithms.dpo_loss import pack_pairs, pair_sequence_logps

    pairs = [{"chosen_ids": [1, 2, 3, 4], "rejected_ids": [1, 2, 3, 5, 6], "prompt_len": 3},
             {"chosen_ids": [7, 8, 9], "rejected_ids": [7, 10], "prompt_len": 1}]
    batch = pack_pairs(pairs, pad_id=0)
    assert batch.sequences.tolist() == [[1, 2, 3, 4, 0], [0, 0, 7, 8, 9], [1, 2, 3, 5, 6], [0, 0, 7, 10, 0]]
    assert batch.action_mask.tolist() == [[1, 0], [1, 1], [1, 1], [1, 0]]
    token_logps = T([[-1.0, -9.0], [-2.0, -3.0], [-4.0, -0.5], [-6.0, -9.0]])
    sums = pair_sequence_logps(token_logps, batch.action_mask)  # padding never counts
    assert sums["chosen"].tolist() == [-1.0, -5.0] and sums["rejected"].tolist() == [-4.5, -6.0]
    assert sums["chosen_tokens"].tolist() == [1.0, 2.0] and sums["rejected_tokens"].tolist() == [2.0, 1.0]


def test_rpo_adds_the_chosen_answers_negative_log_likelihood_per_token():
    plain, _ = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1)
    loss, metrics = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1, chosen_tokens=CHOSEN_TOKENS,
                             rpo_alpha=0.5)
    nll = (5.0 + 7.5 + 3.0) / (4.0 + 6.0 + 2.0)  # -(sum of chosen log-probs) / chosen tokens
    assert metrics["nll_loss"].item() == pytest.approx(nll)
    assert loss.item() == pytest.approx(plain.item() + 0.5 * nll, abs=1e-6)
    with pytest.raises(ValueError, match="chosen_tokens"):
        dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1, rpo_alpha=0.5)
