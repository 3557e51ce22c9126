"""Rollouts + scores -> the tensors a PPO update needs. Pure: the driver calls it on numbers it gathered."""

from __future__ import annotations

import torch

from rlhf_ray.algorithms.batch import PPOTargets, RolloutBatch
from rlhf_ray.algorithms.advantages import AdvantageInputs, estimate
from rlhf_ray.algorithms.masked import masked_mean, masked_whiten, zero_masked
from rlhf_ray.algorithms.rewards import kl_estimate, overlong_penalty, sequence_scores, shaped_rewards
from rlhf_ray.config.ppo import PPOSpec


def pack_rollouts(prompts: list[list[int]], answers: list[list[int]], pad_id: int,
                  answer_masks: list[list[int] | None] | None = None) -> RolloutBatch:
    """[left-padded prompt | right-padded answer]: every answer starts at column P, so answer tensors are
    [B, A] slices of the same layout for policy, reference, critic and reward. The action mask is 1 on every
    answer token, or, for a multi-turn episode, its `answer_masks` row: 1 on the tokens the policy sampled, 0 on
    the observation tokens between its turns (context that carries no log-prob, KL, value or advantage)."""
    width_p = max(len(p) for p in prompts)
    width_a = max(max(len(a) for a in answers), 1)
    seq = torch.full((len(prompts), width_p + width_a), pad_id, dtype=torch.long)
    mask = torch.zeros_like(seq)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        seq[i, width_p - len(p): width_p] = torch.tensor(p, dtype=torch.long)
        mask[i, width_p - len(p): width_p] = 1
        if a:
            seq[i, width_p: width_p + len(a)] = torch.tensor(a, dtype=torch.long)
            mask[i, width_p: width_p + len(a)] = 1
    action_mask = mask[:, width_p:].float()
    for i, row in enumerate(answer_masks or []):
        if row is not None:
            if len(row) != len(answers[i]):
                raise ValueError(f"answer {i}: its mask has {len(row)} entries for {len(answers[i])} tokens")
            action_mask[i, : len(row)] = torch.tensor(row, dtype=torch.float)
    return RolloutBatch(sequences=seq, attention_mask=mask, action_mask=action_mask, prompt_width=width_p)


def unpack_rollouts(batch: RolloutBatch, lo: int = 0, hi: int | None = None) -> list[tuple[list[int], list[int]]]:
    """The inverse of pack_rollouts for rows [lo, hi): each row's (prompt ids, answer ids), padding dropped."""
    width = batch.prompt_width
    rows = []
    for ids, mask in zip(batch.sequences[lo:hi], batch.attention_mask[lo:hi].bool()):
        rows.append((ids[:width][mask[:width]].tolist(), ids[width:][mask[width:]].tolist()))
    return rows


def row_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """k contiguous, balanced [lo, hi) ranges over n rows: each replica's share of a batch."""
    cuts = [round(i * n / k) for i in range(k + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def row_slices(n: int, size: int) -> list[slice]:
    """Consecutive slices of at most `size` rows covering rows [0, n): a batch's micro-batches."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def pad_answer_columns(values: torch.Tensor, answer_len: int) -> torch.Tensor:
    """[b, a] per-token results of a trimmed micro-batch back to the batch's answer width (zeros: padding)."""
    return torch.nn.functional.pad(values, (0, answer_len - values.shape[1]))


def logprob_gap(engine_logp: torch.Tensor, learner_logp: torch.Tensor, action_mask: torch.Tensor) -> float:
    """Mean |engine log-prob - learner log-prob| over answer tokens: how far the distribution that sampled the
    rollout (the generation engine, possibly in lower precision) is from the one PPO trains (0 when they agree)."""
    return masked_mean((engine_logp - learner_logp).abs(), action_mask).item()


def mismatch_kl(engine_logp: torch.Tensor, learner_logp: torch.Tensor, action_mask: torch.Tensor) -> float:
    """KL(engine || learner) per answer token, estimated on the engine's own samples (k3, non-negative): the
    train/inference mismatch an off-policy correction (ppo.tis_cap) compensates; 0 when the two agree."""
    log_ratio = zero_masked(learner_logp - engine_logp, action_mask)
    return masked_mean(torch.exp(log_ratio) - 1 - log_ratio, action_mask).item()


def make_experience(scores: torch.Tensor, logp: torch.Tensor | None, ref_logp: torch.Tensor | None,
                    values: torch.Tensor | None, action_mask: torch.Tensor, ended: torch.Tensor, spec: PPOSpec,
                    group_size: int, max_answer_tokens: int | None = None,
                    teacher_logp: torch.Tensor | None = None) -> PPOTargets:
    """Advantages and returns by the configured estimator, plus what the metrics report. `logp` (the policy's old
    log-probs) may be None when the reward carries no KL term: the learner then uses its training forward's.
    `ref_logp` (the reference's) is None when the run has no reference, which only a run without a KL term may do.
    `max_answer_tokens` (generation's max_new_tokens) is what `spec.overlong_buffer` counts back from.
    `teacher_logp` (estimator distill): the teacher's log-prob of each sampled token."""
    reward_kl_coef = 0.0 if spec.kl_in_loss else spec.kl_coef
    if (logp is None or ref_logp is None) and reward_kl_coef:
        raise ValueError("the KL-shaped reward needs the policy's old log-probs and the reference's")
    kl = None if logp is None or ref_logp is None else \
        kl_estimate(logp, ref_logp, spec.kl_estimator, action_mask) * action_mask
    bonus = None
    if spec.overlong_buffer:
        if max_answer_tokens is None:
            raise ValueError("ppo.overlong_buffer needs the answers' maximum length (max_new_tokens)")
        bonus = overlong_penalty(action_mask.sum(-1), max_answer_tokens, spec.overlong_buffer, spec.overlong_penalty)
    rewards = shaped_rewards(scores, ref_logp if logp is None else logp, ref_logp, action_mask, reward_kl_coef,
                             spec.clip_reward, spec.kl_estimator, ended, spec.eos_penalty, bonus)
    penalty = reward_kl_coef * kl if reward_kl_coef else None
    sequence_rewards = sequence_scores(scores, spec.clip_reward, ended, spec.eos_penalty, bonus=bonus)
    if penalty is not None:
        sequence_rewards = sequence_rewards - penalty.sum(-1)
    estimator = spec.estimator
    advantages, returns = estimate(estimator, AdvantageInputs(
        rewards=rewards, sequence_rewards=sequence_rewards, action_mask=action_mask, group_size=group_size,
        gamma=spec.gamma, lam=spec.lam, values=values, logp=logp, teacher_logp=teacher_logp, kl_penalty=penalty))
    if spec.whiten_advantages and "whiten_advantages" in estimator.reads:
        advantages = masked_whiten(advantages, action_mask)
    return PPOTargets(advantages=advantages, ref_logp=ref_logp, rewards=rewards, old_logp=logp,
                      kl=None if kl is None else masked_mean(kl, action_mask, dim=-1),
                      values=values if returns is not None else None, returns=returns)
