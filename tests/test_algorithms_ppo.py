"""Golden tests for the PPO math: every expected number is worked out by hand in the comments."""

import math

import pytest
import torch

from rlhf_ray.algorithms.advantages import (broadcast_to_tokens, distill_advantages, informative_groups_first, discounted_returns, gae, group_normalized,
                                            leave_one_out, reinforce_pp)
from rlhf_ray.algorithms.experience import make_experience, mismatch_kl, pack_rollouts, unpack_rollouts
from rlhf_ray.algorithms.logprobs import answer_logprobs, entropy, token_logprobs
from rlhf_ray.algorithms.losses import (aggregate, aggregated_sum, first_predicting_column, lm_loss_sum, loss_units,
                                       policy_loss, policy_token_loss, truncated_is_weights, value_loss)
from rlhf_ray.algorithms.masked import masked_mean, masked_whiten
from rlhf_ray.algorithms.rewards import kl_estimate, last_action_index, overlong_penalty, shaped_rewards
from rlhf_ray.config.ppo import PPOSpec

T = torch.tensor
MASK = T([[1.0, 1.0, 0.0]])  # a two-token answer, then padding


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.float(), torch.as_tensor(b, dtype=torch.float32), rtol=0, atol=tol)


def test_masked_mean_and_whiten_ignore_padding():
    close(masked_mean(T([[1.0, 3.0, 100.0]]), MASK), 2.0)
    close(masked_mean(T([[1.0, 3.0, 100.0]]), T([[0.0, 0.0, 0.0]])), 0.0)  # empty mask: 0, not nan
    # mean 2, unbiased variance 1
    close(masked_whiten(T([[1.0, 2.0, 3.0, 100.0]]), T([[1.0, 1.0, 1.0, 0.0]])), [[-1.0, 0.0, 1.0, 0.0]], 1e-4)


def test_logprobs_use_the_sampling_temperature_and_align_with_answer_tokens():
    logits = T([[[0.0, math.log(3.0)]]])  # p = [1/4, 3/4] at T=1
    close(token_logprobs(logits, T([[1]])), [[math.log(0.75)]])
    # at T=2 the logits halve: p = [1/(1+sqrt3), sqrt3/(1+sqrt3)]
    close(token_logprobs(logits, T([[1]]), temperature=2.0), [[math.log(math.sqrt(3) / (1 + math.sqrt(3)))]])
    seq = T([[5, 6, 7, 8]])
    logits = torch.zeros(1, 4, 10)
    logits[0, 1, 7] = 10.0  # position 1 predicts token 2 (= 7)
    logits[0, 2, 8] = 10.0
    lp = answer_logprobs(logits, seq, answer_len=2)
    assert lp.shape == (1, 2) and (lp > -1e-3).all()
    # a model that kept only the last A + 1 positions' logits (logits_to_keep) gives the same log-probs
    assert torch.equal(answer_logprobs(logits[:, -3:], seq, answer_len=2), lp)
    close(entropy(torch.zeros(1, 1, 4)), [[math.log(4.0)]])


def test_kl_estimators():
    logp, ref = T([0.5, -1.0]), T([0.0, 0.0])
    close(kl_estimate(logp, ref, "k1"), [0.5, -1.0])
    close(kl_estimate(logp, ref, "k2"), [0.125, 0.5])
    close(kl_estimate(logp, ref, "k3"), [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1])
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k9")


def test_shaped_rewards_put_the_clipped_score_on_the_last_real_token():
    logp, ref = T([[-1.0, -2.0, -3.0]]), T([[-1.5, -1.0, -3.0]])
    # k1 KL = [0.5, -1, (pad)]; -0.1 * KL = [-0.05, 0.1, 0]; score 7 clipped to 5 on token 1
    rewards = shaped_rewards(T([7.0]), logp, ref, MASK, kl_coef=0.1, clip_reward=5.0)
    close(rewards, [[-0.05, 5.1, 0.0]])
    # an answer cut off before end-of-text pays the penalty
    rewards = shaped_rewards(T([7.0]), logp, ref, MASK, 0.1, 5.0, ended=T([False]), eos_penalty=-1.0)
    close(rewards, [[-0.05, 4.1, 0.0]])
    assert last_action_index(T([[1, 1, 0], [1, 1, 1], [0, 0, 0]])).tolist() == [1, 2, 0]
    assert last_action_index(T([[1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0]])).tolist() == [4, 1]  # multi-turn masks
    # a multi-turn row: the score on the last token of the last turn, KL only on the policy's tokens
    turns = T([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    shaped = shaped_rewards(T([2.0]), T([[0.5, 9.0, 9.0, 0.0, 0.25, 9.0]]), torch.zeros(1, 6), turns, 0.1, 5.0)
    close(shaped, [[-0.05, 0.0, 0.0, 0.0, 2.0 - 0.025, 0.0]])
    empty = shaped_rewards(T([3.0]), logp, ref, T([[0.0, 0.0, 0.0]]), 0.1, 5.0)
    close(empty, [[0.0, 0.0, 0.0]])  # an empty answer gets nothing, not a score on padding


def test_gae_stops_at_the_end_of_each_answer():
    rewards, values = T([[0.5, 1.0, 9.0]]), T([[0.2, 0.4, 7.0]])  # position 2 is padding: its 9 and 7 must not leak
    adv, ret = gae(rewards, values, MASK, gamma=1.0, lam=0.95)
    # t=1: delta = 1.0 + 0 - 0.4 = 0.6; t=0: delta = 0.5 + 0.4 - 0.2 = 0.7, adv = 0.7 + 0.95 * 0.6 = 1.27
    close(adv, [[1.27, 0.6, 0.0]])
    close(ret, [[1.47, 1.0, 0.0]])
    adv, _ = gae(rewards, values, MASK, gamma=0.5, lam=1.0)
    # t=1: delta = 1.0 - 0.4 = 0.6; t=0: delta = 0.5 + 0.5*0.4 - 0.2 = 0.5, adv = 0.5 + 0.5*0.6 = 0.8
    close(adv, [[0.8, 0.6, 0.0]])


def test_gae_and_returns_skip_masked_spans_between_policy_tokens():
    """Multi-turn masks: observation tokens (mask 0) between the policy's turns are context, not time steps. GAE and
    reward-to-go over the interleaved row equal them over the policy tokens laid end to end, scattered back, with
    0 on the observation tokens and the padding; the first turn sees the episode's final reward."""
    torch.manual_seed(0)
    mask = T([[1, 1, 0, 0, 0, 1, 1, 1, 0, 0],
              [1, 0, 1, 0, 1, 1, 0, 1, 0, 0],
              [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    rewards, values = torch.randn(3, 10), torch.randn(3, 10)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    togo = discounted_returns(rewards, mask, gamma=0.9)
    for row in range(3):
        kept = mask[row].bool()
        n = int(kept.sum())
        compact = lambda x: x[row][kept].unsqueeze(0)  # noqa: E731
        want_adv, want_ret = gae(compact(rewards), compact(values), torch.ones(1, n), gamma=0.9, lam=0.8)
        close(adv[row][kept], want_adv[0], 1e-6)
        close(ret[row][kept], want_ret[0], 1e-6)
        close(togo[row][kept], discounted_returns(compact(rewards), torch.ones(1, n), gamma=0.9)[0], 1e-6)
        assert (adv[row][~kept] == 0).all() and (ret[row][~kept] == 0).all() and (togo[row][~kept] == 0).all()
    # a reward on the last policy token reaches the first turn through the observation span
    final = torch.zeros(1, 10)
    final[0, 7] = 1.0
    close(discounted_returns(final, mask[:1], gamma=1.0), [[1, 1, 0, 0, 0, 1, 1, 1, 0, 0]])
    adv, _ = gae(final, torch.zeros(1, 10), mask[:1], gamma=1.0, lam=1.0)
    close(adv, [[1, 1, 0, 0, 0, 1, 1, 1, 0, 0]])


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_losses_over_an_interleaved_mask_equal_them_over_the_policy_tokens_alone(aggregation):
    """Observation tokens of a multi-turn episode (mask 0, whatever their log-probs or values) change no loss: the
    policy, value and KL terms equal those of the policy tokens laid end to end (padded at the end)."""
    torch.manual_seed(1)
    mask = T([[1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0]])
    logp, old, adv, ref = (torch.randn(2, 6) for _ in range(4))
    values, old_values, returns = (torch.randn(2, 6) for _ in range(3))
    compact_mask = T([[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]])

    def compact(x):
        return torch.stack([torch.cat([row[m.bool()], torch.full((6 - int(m.sum()),), 99.0)])
                            for row, m in zip(x, mask)])

    loss, _ = policy_loss(logp, old, adv, mask, clip_ratio=0.2, aggregation=aggregation)
    want, _ = policy_loss(compact(logp), compact(old), compact(adv), compact_mask, clip_ratio=0.2,
                          aggregation=aggregation)
    close(loss, want, 1e-6)
    close(value_loss(values, old_values, returns, mask, 0.2),
          value_loss(compact(values), compact(old_values), compact(returns), compact_mask, 0.2), 1e-6)
    close(masked_mean(kl_estimate(logp, ref, "k3", mask), mask),
          masked_mean(kl_estimate(compact(logp), compact(ref), "k3", compact_mask), compact_mask), 1e-6)


def test_critic_free_estimators():
    scores = T([1.0, 0.0, 1.0, 1.0])  # two prompts, two samples each
    s = 1 / math.sqrt(2)  # group [1, 0]: mean 0.5, unbiased std sqrt(0.5)
    close(group_normalized(scores, 2), [s, -s, 0.0, 0.0], 1e-4)
    close(leave_one_out(scores, 2), [1.0, -1.0, 0.0, 0.0])
    close(broadcast_to_tokens(T([2.0]), MASK), [[2.0, 2.0, 0.0]])
    close(discounted_returns(T([[1.0, 2.0, 5.0]]), MASK, gamma=0.5), [[2.0, 2.0, 0.0]])
    # returns [[3, 2, pad]] and [[1, 1, pad]] -> values 3, 2, 1, 1: mean 1.75, unbiased std sqrt(11/12)
    out = reinforce_pp(T([[1.0, 2.0, 0.0], [0.0, 1.0, 0.0]]), T([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]))
    sd = math.sqrt((1.25**2 + 0.25**2 + 0.75**2 + 0.75**2) / 3)
    close(out, [[1.25 / sd, 0.25 / sd, 0.0], [-0.75 / sd, -0.75 / sd, 0.0]], 1e-4)


def test_distillation_credits_each_token_with_its_teacher_student_log_ratio():
    """estimator distill: a sampled token's advantage is log p_teacher - log p_student of that token, nothing
    summed over later tokens and nothing normalised; padding gets 0; the rule's score does not enter it."""
    logp = T([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]])
    teacher = T([[-0.5, -4.0, -9.0], [-0.2, -1.0, -7.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    spec = PPOSpec(advantage_estimator="distill", kl_coef=0.0)
    for scores in (T([1.0, 0.0]), T([0.0, 5.0])):
        out = make_experience(scores, logp, logp.clone(), None, mask, T([1.0, 1.0]).bool(), spec, 1,
                              teacher_logp=teacher)
        close(out.advantages, [[0.5, -2.0, 0.0], [0.0, 2.0, -6.0]])
        assert out.returns is None and out.values is None
    # a KL-to-reference penalty in the reward is charged to each token too
    ref = logp - T([[0.1, 0.1, 0.1], [0.0, 0.2, 0.0]])
    penalised = make_experience(T([0.0, 0.0]), logp, ref, None, mask, T([1.0, 1.0]).bool(),
                                PPOSpec(advantage_estimator="distill", kl_coef=1.0, kl_estimator="k1"), 1,
                                teacher_logp=teacher)
    close(penalised.advantages, [[0.4, -2.1, 0.0], [0.0, 1.8, -6.0]], 1e-5)
    close(distill_advantages(teacher, logp, mask), [[0.5, -2.0, 0.0], [0.0, 2.0, -6.0]])
    with pytest.raises(ValueError, match="teacher"):
        make_experience(T([0.0, 0.0]), logp, logp, None, mask, T([1.0, 1.0]).bool(), spec, 1)


def test_without_a_reference_the_advantages_are_the_same_and_no_kl_is_reported():
    """A run with no KL term may run no reference (reference: null): its experience carries no reference log-probs
    and no KL, and the advantages equal those computed beside a reference; a KL-shaped reward without one is
    refused."""
    logp = T([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0], [-0.4, -0.1, -2.0], [-1.5, -0.3, -0.2]])
    ref = logp - 0.3
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    ended = T([1.0, 1.0, 1.0, 0.0]).bool()
    for spec, teacher in ((PPOSpec(advantage_estimator="distill", kl_coef=0.0), logp - 0.5),
                          (PPOSpec(advantage_estimator="grpo", kl_coef=0.0), None)):
        beside = make_experience(T([1.0, 0.0, 0.0, 1.0]), logp, ref, None, mask, ended, spec, 2, teacher_logp=teacher)
        alone = make_experience(T([1.0, 0.0, 0.0, 1.0]), logp, None, None, mask, ended, spec, 2, teacher_logp=teacher)
        close(alone.advantages, beside.advantages.tolist())
        close(alone.rewards, beside.rewards.tolist())
        assert beside.kl is not None and alone.kl is None and alone.ref_logp is None
    with pytest.raises(ValueError, match="reference"):
        make_experience(T([1.0, 0.0, 0.0, 1.0]), logp, None, None, mask, ended,
                        PPOSpec(advantage_estimator="grpo", kl_coef=0.1), 2)


def test_policy_loss_clips_and_dual_clips():
    old = T([[0.0, 0.0, 0.0]])
    logp = T([[math.log(1.5), math.log(0.5), 3.0]])
    adv = T([[2.0, -1.0, 50.0]])
    loss, stats = policy_loss(logp, old, adv, MASK, clip_ratio=0.2)
    # token 0: max(-3, -2.4) = -2.4; token 1: max(0.5, 0.8) = 0.8; mean -0.8 (token 2 is padding)
    close(loss, -0.8)
    close(stats["clip_fraction"], 1.0)
    logp = T([[math.log(5.0), 0.0, 0.0]])
    adv = T([[-1.0, 1.0, 0.0]])
    # token 0: max(5, 1.2) = 5, dual clip c=3 caps it at 3; token 1: ratio 1 -> -1
    close(policy_loss(logp, old, adv, MASK, 0.2)[0], (5.0 - 1.0) / 2)
    close(policy_loss(logp, old, adv, MASK, 0.2, dual_clip=3.0)[0], (3.0 - 1.0) / 2)


def test_clip_higher_lets_a_positive_advantage_token_grow_further_than_it_may_shrink():
    """DAPO's clip-higher: ratio 1.3 on A > 0 is cut at 1 + 0.2 symmetrically, at 1.3 with clip_ratio_high 0.28
    only up to 1.28; the lower bound stays 1 - 0.2 (ratio 0.7 on A < 0 is cut at 0.8 either way)."""
    old, adv = T([[0.0, 0.0, 0.0]]), T([[1.0, -1.0, 0.0]])
    logp = T([[math.log(1.3), math.log(0.7), 0.0]])
    close(policy_loss(logp, old, adv, MASK, 0.2)[0], (-1.2 + 0.8) / 2)
    close(policy_loss(logp, old, adv, MASK, 0.2, clip_ratio_high=0.28)[0], (-1.28 + 0.8) / 2)
    close(policy_loss(logp, old, adv, MASK, 0.2, clip_ratio_high=0.5)[0], (-1.3 + 0.8) / 2)  # inside: unclipped
    assert policy_loss(logp, old, adv, MASK, 0.2, clip_ratio_high=0.5)[1]["clip_fraction"] == 0.5  # token 1 only


def test_loss_aggregations_weigh_tokens_or_answers():
    """Two answers of 1 and 3 tokens, per-token losses [4 | 1 1 1]: token_mean 7/4 (the long answer weighs 3x),
    seq_mean_token_mean (4 + 1)/2 (each answer once), seq_mean_token_sum (4 + 3)/2. Split into micro-batches,
    the sums add up to the whole batch's (the learner divides by the mini-batch's units)."""
    per_token = T([[4.0, 9.0, 9.0], [1.0, 1.0, 1.0]])  # 9: padding, never counted
    mask = T([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    close(aggregate(per_token, mask, "token_mean"), 7 / 4)
    close(aggregate(per_token, mask, "seq_mean_token_mean"), (4 + 1) / 2)
    close(aggregate(per_token, mask, "seq_mean_token_sum"), (4 + 3) / 2)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        parts = sum(aggregated_sum(per_token[i:i + 1], mask[i:i + 1], mode) for i in range(2))
        units = sum(loss_units(mask[i:i + 1], mode) for i in range(2))
        close(parts / units, aggregate(per_token, mask, mode))
    assert loss_units(T([[0.0, 0.0]]), "seq_mean_token_mean") == 0  # an empty answer is no answer
    close(aggregate(T([[1.0, 1.0]]), T([[0.0, 0.0]]), "seq_mean_token_mean"), 0.0)


def test_truncated_importance_weights_correct_for_the_engine_and_stop_at_the_cap():
    """pi_learner / pi_engine per token: 0.5 / 0.25 = 2 is capped at 1.5, 0.3 / 0.6 = 0.5 kept; padding 0 even
    when its log-probs are garbage; no gradient through the weights."""
    learner = T([[math.log(0.5), math.log(0.3), 1e4]], requires_grad=True)
    engine = T([[math.log(0.25), math.log(0.6), -1e4]])
    weights = truncated_is_weights(learner, engine, MASK, cap=1.5)
    close(weights, [[1.5, 0.5, 0.0]])
    assert not weights.requires_grad
    close(truncated_is_weights(learner, engine, MASK, cap=3.0), [[2.0, 0.5, 0.0]])


def test_the_decoupled_loss_weights_each_token_by_its_own_sampling_policy():
    """Golden, as the policy learner composes it (policy_token_loss x truncated_is_weights, token mean): an answer
    whose first two tokens were drawn by version 0 and the last two by version 1 after a mid-answer update (partial
    rollouts); each token's weight is min(pi_old / pi_behaviour, cap) with its own behaviour log-prob, then the
    clipped ratio against the learner's old log-probs. Worked by hand for clip 0.2, cap 2, advantage 1."""
    old = T([[math.log(0.5), math.log(0.5), math.log(0.4), math.log(0.2)]])
    behaviour = T([[math.log(0.25), math.log(0.5), math.log(0.4), math.log(0.8)]])  # v0, v0 | v1, v1
    new = T([[math.log(0.6), math.log(0.5), math.log(0.6), math.log(0.2)]], requires_grad=True)
    mask, advantages = torch.ones(1, 4), torch.ones(1, 4)
    loss, _ = policy_token_loss(new, old, advantages, mask, clip_ratio=0.2)
    weighted = loss * truncated_is_weights(old, behaviour, mask, cap=2.0)
    # ratios 1.2, 1, 1.5 (clipped to 1.2), 1 -> -min(r, clip(r)) = -1.2, -1, -1.2, -1
    # weights 0.5/0.25 = 2 (the cap), 1, 1, 0.2/0.8 = 0.25
    close(weighted, [[-2.4, -1.0, -1.2, -0.25]])
    close(aggregate(weighted, mask, "token_mean"), (-2.4 - 1.0 - 1.2 - 0.25) / 4)
    aggregate(weighted, mask, "token_mean").backward()
    assert new.grad[0, 2] == 0 and new.grad[0, 0] != 0  # the clipped token carries no gradient


def test_mismatch_kl_is_zero_when_engine_and_learner_agree():
    engine, learner = T([[math.log(0.5), math.log(0.2), 0.0]]), T([[math.log(0.25), math.log(0.2), 7.0]])
    assert mismatch_kl(engine, engine, MASK) == 0.0
    # token 0: r = 0.25 / 0.5 = 0.5 -> 0.5 - 1 - log 0.5; token 1: r = 1 -> 0; padding ignored
    close(torch.tensor(mismatch_kl(engine, learner, MASK)), (0.5 - 1 - math.log(0.5)) / 2)


def test_dynamic_sampling_keeps_groups_whose_scores_differ_first():
    """Groups of 2: [1 1] equal, [0 1] differ, [0 0] equal, [1 0] differ. Two groups: both that differ; three:
    the first equal one fills (without fill: the two that differ); one: the first that differs."""
    scores = T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert informative_groups_first(scores, 2, 2) == ([2, 3, 6, 7], 2)
    assert informative_groups_first(scores, 2, 3) == ([0, 1, 2, 3, 6, 7], 2)
    assert informative_groups_first(scores, 2, 1) == ([2, 3], 1)
    assert informative_groups_first(T([1.0, 1.0, 0.0, 0.0]), 2, 1) == ([0, 1], 0)  # none differ: fill
    # without fill only the groups that differ train; when none does, one equal group (never an empty batch)
    assert informative_groups_first(scores, 2, 3, fill=False) == ([2, 3, 6, 7], 2)
    assert informative_groups_first(scores, 2, 1, fill=False) == ([2, 3], 1)
    assert informative_groups_first(T([1.0, 1.0, 0.0, 0.0]), 2, 2, fill=False) == ([0, 1], 0)


def test_value_loss_clips_around_the_old_values():
    values, old, returns = T([[1.0, 2.0, 9.0]]), T([[0.5, 2.0, 0.0]]), T([[2.0, 1.0, 0.0]])
    # token 0: clipped value 0.7 -> max(1, 1.69) = 1.69; token 1: 1; 0.5 * mean = 0.6725
    close(value_loss(values, old, returns, MASK, clip_value=0.2), 0.6725)


def test_lm_loss_sums_next_token_cross_entropy_and_skips_ignored_labels():
    # vocab 2; position t predicts label t+1. Logits [0, 0] give log 2 per token; [ln 3, 0] gives p(0) = 3/4.
    logits = T([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0]]])
    labels = T([[7, 1, 0]])  # label 0 is never predicted (nothing before it): 7 is not even checked
    close(lm_loss_sum(logits, labels), math.log(2.0) + -math.log(0.75))  # -log p(1)=ln2 at t=0, -log p(0) at t=1
    close(lm_loss_sum(logits, T([[7, -100, 0]])), -math.log(0.75))  # an ignored label carries no loss
    close(lm_loss_sum(logits, T([[7, -100, -100]])), 0.0)


def test_kl_in_the_loss_is_the_token_mean_estimate_and_pulls_towards_the_reference():
    logp, ref = T([[0.5, -1.0, 4.0]], requires_grad=True), T([[0.0, 0.0, 0.0]])
    loss = aggregate(kl_estimate(logp, ref, "k3", MASK), MASK)
    close(loss, ((math.exp(-0.5) - 1 + 0.5) + (math.exp(1.0) - 1 - 1)) / 2)  # padding token 2 carries nothing
    loss.backward()
    # d/dx (e^-x - 1 + x) / 2 = (1 - e^-x) / 2: a step against the gradient moves each log-prob towards ref
    close(logp.grad, [[(1 - math.exp(-0.5)) / 2, (1 - math.exp(1.0)) / 2, 0.0]])


def test_pack_rollouts_aligns_every_answer_at_the_same_column():
    batch = pack_rollouts([[5, 6], [7]], [[8], [9, 10, 11]], pad_id=0)
    assert batch.sequences.tolist() == [[5, 6, 8, 0, 0], [0, 7, 9, 10, 11]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert batch.action_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert batch.prompt_width == 2
    # and back: what reward functions decode, what samples.jsonl logs
    assert unpack_rollouts(batch) == [([5, 6], [8]), ([7], [9, 10, 11])]
    assert unpack_rollouts(batch, 1, 2) == [([7], [9, 10, 11])]
    assert unpack_rollouts(pack_rollouts([[5]], [[]], pad_id=0)) == [([5], [])]
    # a multi-turn episode: the observation tokens (12, 13) between the policy's turns are context, not actions
    turns = pack_rollouts([[5, 6], [7]], [[8, 12, 13, 9], [9, 10]], pad_id=0, answer_masks=[[1, 0, 0, 1], None])
    assert turns.action_mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    assert turns.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]  # all of it is attended to
    assert unpack_rollouts(turns)[0] == ([5, 6], [8, 12, 13, 9])
    with pytest.raises(ValueError, match="answer 0: its mask has 2 entries for 4 tokens"):
        pack_rollouts([[5]], [[8, 12, 13, 9]], pad_id=0, answer_masks=[[1, 0]])


def test_make_experience_grpo_kl_in_reward_or_in_loss():
    scores, mask, ended = T([1.0, 0.0, 0.0]), T([[1.0], [1.0], [1.0]]), T([True, True, True])  # one prompt, 3 answers
    logp, ref = T([[-1.0], [0.0], [-2.0]]), T([[-1.0], [-1.0], [-2.0]])  # k1 KL per answer: [0, 1, 0]
    spec = PPOSpec(advantage_estimator="grpo", kl_coef=0.5)
    out = make_experience(scores, logp, ref, None, mask, ended, spec, group_size=3)
    # sequence rewards [1, -0.5, 0]: mean 1/6, unbiased std sqrt(7/12)
    close(out.advantages, [[5 / 6 / math.sqrt(7 / 12)], [-2 / 3 / math.sqrt(7 / 12)], [-1 / 6 / math.sqrt(7 / 12)]],
          1e-4)
    close(out.kl, [0.0, 1.0, 0.0])
    assert out.old_logp is logp
    # KL in the loss: the reward is the score alone ([1, 0, 0]: mean 1/3, std sqrt(1/3)), and the old log-probs
    # may be left to the learner
    spec = PPOSpec(advantage_estimator="grpo", kl_coef=0.5, kl_in_loss=True)
    out = make_experience(scores, None, ref, None, mask, ended, spec, group_size=3)
    third = math.sqrt(1 / 3)
    close(out.advantages, [[2 / 3 / third], [-1 / 3 / third], [-1 / 3 / third]], 1e-4)
    assert out.old_logp is None and out.kl is None and out.ref_logp is ref
    with pytest.raises(ValueError, match="old log-probs"):
        make_experience(scores, None, ref, None, mask, ended, PPOSpec(advantage_estimator="grpo"), 3)


def test_eos_penalty_reaches_critic_free_advantages():
    # one prompt, two answers with equal scores: the first ended with end-of-text, the second was cut off
    scores, mask, ended, ref = T([1.0, 1.0]), T([[1.0], [1.0]]), T([True, False]), T([[0.0], [0.0]])
    for estimator, want in (("grpo", [1 / math.sqrt(2), -1 / math.sqrt(2)]), ("rloo", [1.0, -1.0])):
        # sequence rewards [1, 1 - 1] = [1, 0]: GRPO mean 0.5, unbiased std sqrt(0.5); RLOO 1 - 0 and 0 - 1
        options = {"whiten_advantages": False} if estimator == "rloo" else {}
        spec = PPOSpec(advantage_estimator=estimator, kl_in_loss=True, eos_penalty=-1.0, **options)
        out = make_experience(scores, None, ref, None, mask, ended, spec, group_size=2)
        close(out.advantages, [[w] for w in want], 1e-4)
        # without the penalty the two answers are indistinguishable
        spec = PPOSpec(advantage_estimator=estimator, kl_in_loss=True, **options)
        close(make_experience(scores, None, ref, None, mask, ended, spec, group_size=2).advantages, [[0.0], [0.0]])


def test_overlong_penalty_is_soft_and_reaches_every_estimator():
    """DAPO's soft overlong punishment with max 16 tokens and a buffer of 4: nothing up to 12 tokens, then -1/4
    per token, -1 at 16; added after the score is clipped."""
    close(overlong_penalty(T([3, 12, 13, 14, 16, 40]), 16, 4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_penalty(T([14]), 16, 4, penalty=0.5), [-0.25])
    # two answers to one prompt, same score 9 (clipped to 5): 8 and 16 tokens
    mask = torch.zeros(2, 16)
    mask[0, :8], mask[1, :] = 1.0, 1.0
    scores, ended, ref = T([9.0, 9.0]), T([True, True]), torch.zeros(2, 16)
    spec = PPOSpec(advantage_estimator="grpo", kl_in_loss=True, overlong_buffer=4)
    out = make_experience(scores, None, ref, None, mask, ended, spec, group_size=2, max_answer_tokens=16)
    # sequence rewards [5, 5 - 1]: GRPO mean 4.5, unbiased std sqrt(0.5)
    close(out.advantages[:, 0], [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)], 1e-4)
    gae_spec = PPOSpec(kl_coef=0.0, whiten_advantages=False, overlong_buffer=4)
    out = make_experience(scores, torch.zeros(2, 16), ref, torch.zeros(2, 16), mask, ended, gae_spec, 1, 16)
    close(out.rewards.sum(-1), [5.0, 4.0])  # on each answer's last token
    with pytest.raises(ValueError, match="overlong_buffer needs the answers' maximum length"):
        make_experience(scores, None, ref, None, mask, ended, spec, group_size=2)


def test_make_experience_gae_shapes_rewards_before_the_critic():
    spec = PPOSpec(kl_coef=0.1, whiten_advantages=False, lam=1.0)
    logp, ref, values = T([[-1.0, -2.0, -3.0]]), T([[-1.5, -1.0, -3.0]]), T([[0.2, 0.4, 7.0]])
    out = make_experience(T([7.0]), logp, ref, values, MASK, T([True]), spec, group_size=1)
    # rewards [-0.05, 5.1, pad] (as in the shaped-rewards test); lam 1, gamma 1: returns are reward-to-go
    close(out.rewards, [[-0.05, 5.1, 0.0]])
    close(out.returns, [[5.05, 5.1, 0.0]])
    close(out.advantages, [[5.05 - 0.2, 5.1 - 0.4, 0.0]])


def test_garbage_on_padding_never_reaches_losses_or_rewards():
    """A masked token may hold anything (an old log-prob of -inf, a stale 1e4): the math masks before it
    exponentiates, so values and gradients stay finite and equal to the clean case."""
    old, ref = T([[0.0, 0.0, -1e4]]), T([[0.0, 0.0, float("-inf")]])
    logp = T([[math.log(1.5), math.log(0.5), 1e4]], requires_grad=True)
    adv = T([[2.0, -1.0, 50.0]])
    loss, stats = policy_loss(logp, old, adv, MASK, clip_ratio=0.2)
    close(loss, -0.8)  # as in test_policy_loss_clips_and_dual_clips: padding carries nothing
    close(stats["approx_kl"], (0.5 * math.log(1.5) ** 2 + 0.5 * math.log(0.5) ** 2) / 2)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0
    close(aggregate(kl_estimate(logp.detach(), ref, "k3", MASK), MASK), ((1 / 1.5 - 1 + math.log(1.5)) + (2 - 1 + math.log(0.5))) / 2)
    rewards = shaped_rewards(T([1.0]), logp.detach(), ref, MASK, 0.1, 5.0, estimator="k3")
    assert torch.isfinite(rewards).all() and rewards[0, 2] == 0
    assert masked_mean(T([[1.0, 3.0, float("nan")]]), MASK) == 2.0


def test_shaped_rewards_accept_float64():
    logp, ref = T([[-1.0, -2.0, -3.0]], dtype=torch.float64), T([[-1.5, -1.0, -3.0]], dtype=torch.float64)
    rewards = shaped_rewards(T([7.0]), logp, ref, MASK.double(), kl_coef=0.1, clip_reward=5.0,
                             ended=T([False]), eos_penalty=-1.0)
    assert rewards.dtype == torch.float64
    close(rewards, [[-0.05, 4.1, 0.0]])


def test_lm_loss_of_the_last_columns_equals_the_full_loss_from_the_first_predicting_column():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 3)
    labels = T([[7, -100, -100, 1, 2], [7, -100, 0, 1, -100]]).long()
    assert first_predicting_column(labels) == 1  # row 2's first label (column 2) is predicted by column 1
    close(lm_loss_sum(logits[:, 1:], labels), lm_loss_sum(logits, labels).item())
    assert lm_loss_sum(logits[:, 2:], labels) < lm_loss_sum(logits, labels)  # one column too few drops a label
    no_labels = torch.full((1, 4), -100)
    assert first_predicting_column(no_labels) == 3 and lm_loss_sum(logits[:1, -1:], no_labels) == 0


def _saved_bytes_beyond(fn, logits: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for fn's backward pass, not counting the logits' own storage."""
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr != logits.untyped_storage().data_ptr():
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(logits)
    return sum(storages.values()), out


def test_token_logprobs_keep_no_vocabulary_sized_copy_and_match_log_softmax_with_gradients():
    torch.manual_seed(0)
    logits = torch.randn(4, 16, 1000, requires_grad=True)
    tokens = torch.randint(0, 1000, (4, 16))
    weights = torch.randn(4, 16)

    for temperature in (1.0, 0.7):
        def reference(x):  # the textbook form: a [B, L, V] log-softmax kept for the backward pass
            return torch.log_softmax(x / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

        ref_bytes, ref = _saved_bytes_beyond(reference, logits)
        lean_bytes, lean = _saved_bytes_beyond(lambda x: token_logprobs(x, tokens, temperature), logits)
        torch.testing.assert_close(lean, ref, rtol=0, atol=1e-5)
        (ref_grad,) = torch.autograd.grad((ref * weights).sum(), logits)
        (lean_grad,) = torch.autograd.grad((lean * weights).sum(), logits)
        torch.testing.assert_close(lean_grad, ref_grad, rtol=0, atol=1e-6)
        assert ref_bytes >= logits.numel() * 4  # the textbook form keeps a second vocabulary-sized tensor
        if temperature == 1.0:  # (learners divide the logits by T in place first, then call it at 1)
            assert lean_bytes < logits.numel() * 4 / 100, lean_bytes  # only per-position sums beyond the logits
    expected = -(torch.softmax(logits / 0.7, -1) * torch.log_softmax(logits / 0.7, -1)).sum(-1)
    torch.testing.assert_close(entropy(logits, 0.7), expected, rtol=0, atol=1e-5)


def test_trimmed_drops_only_the_columns_no_row_uses():
    from rlhf_ray.algorithms.batch import Experience, PPOTargets
    from rlhf_ray.algorithms.experience import pack_rollouts, pad_answer_columns

    batch = pack_rollouts([[1, 2, 3, 4], [5, 6], [7, 8, 9]], [[10], [11, 12], []], pad_id=0)  # 4 + 2 wide
    experience = Experience.of(batch, PPOTargets(advantages=torch.arange(6.0).reshape(3, 2), ref_logp=torch.zeros(3, 2),
                                                 rewards=torch.zeros(3, 2),
                                                 kl=torch.tensor([0.1, 0.2, 0.3])))  # one value per row: passes through
    rows = experience.select(slice(1, 3))  # rows 1-2: prompts of 2 and 3, answers 2, 0
    trimmed = rows.trimmed()
    assert trimmed.sequences.tolist() == [[0, 5, 6, 11, 12], [7, 8, 9, 0, 0]]
    assert trimmed.attention_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert trimmed.action_mask.tolist() == [[1, 1], [0, 0]]
    assert torch.equal(trimmed.kl, rows.kl) and trimmed.prompt_width == 3  # answers still start at prompt_width
    one = experience.select([2]).trimmed()  # one row, an empty answer
    assert one.sequences.tolist() == [[7, 8, 9, 0]] and one.advantages.tolist() == [[4.0]]  # one column stays
    assert pad_answer_columns(one.advantages, 2).tolist() == [[4.0, 0.0]]
    full = experience.select(slice(0, 2))  # nothing to drop: the same tensors
    assert full.trimmed().sequences is full.sequences
    # the pad tokens a forward computes: 6 of the whole layout's 18, 3 of the trimmed rows' 10
    assert experience.padding() == (6, 18) and trimmed.padding() == (10 - 7, 10) and one.padding() == (1, 4)


def test_projected_logprobs_equal_the_logits_path_with_exact_gradients():
    from rlhf_ray.algorithms.logprobs import projected_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 50, (3, 5))
    logp, ent = projected_logprobs(hidden, weight, tokens, 0.7, chunk=4)  # 15 positions: chunks of 4, 4, 4, 3
    logits = hidden @ weight.T
    torch.testing.assert_close(logp, token_logprobs(logits, tokens, 0.7).double(), rtol=0, atol=1e-5)  # fp32 path
    torch.testing.assert_close(ent, entropy(logits, 0.7).double(), rtol=0, atol=1e-5)  # entropy() is fp32
    assert not ent.requires_grad
    assert torch.autograd.gradcheck(lambda h, w: projected_logprobs(h, w, tokens, 0.7, 4)[0], (hidden, weight))
