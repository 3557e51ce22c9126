"""Golden values for the reward-model losses, computed by hand."""

import math

import torch

from rlhf_ray.algorithms.reward_loss import divergence_window_loss, end_scores, pairwise_loss


def test_end_scores_read_the_last_real_token_right_and_left_padded():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    assert end_scores(values, right).tolist() == [2.0, 8.0]
    assert end_scores(values, left).tolist() == [3.0, 8.0]


def test_pairwise_loss_golden():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    expected = (math.log(1 + math.exp(-2.0)) + math.log(2.0)) / 2
    assert math.isclose(pairwise_loss(chosen, rejected).item(), expected, rel_tol=1e-6)
    # stable where -log(sigmoid(x)) overflows
    assert math.isclose(pairwise_loss(torch.tensor([0.0]), torch.tensor([200.0])).item(), 200.0, rel_tol=1e-6)


def test_divergence_window_loss_golden():
    pad = 0
    chosen_ids = torch.tensor([[5, 6, 7, 8, pad]])
    rejected_ids = torch.tensor([[5, 6, 9, pad, pad]])
    c_mask, r_mask = (chosen_ids != pad).long(), (rejected_ids != pad).long()
    c_val = torch.tensor([[0.0, 0.0, 1.0, 2.0, 9.0]])
    r_val = torch.tensor([[0.0, 0.0, 0.0, 1.0, 9.0]])
    # differ from position 2, the longer sequence ends at 4: positions 2 and 3, margins 1 and 1
    expected = math.log(1 + math.exp(-1.0))
    got = divergence_window_loss(c_val, r_val, chosen_ids, rejected_ids, c_mask, r_mask)
    assert math.isclose(got.item(), expected, rel_tol=1e-6)
    same = divergence_window_loss(c_val, c_val, chosen_ids, chosen_ids, c_mask, c_mask)
    assert math.isclose(same.item(), math.log(2.0), rel_tol=1e-6)
