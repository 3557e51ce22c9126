"""Experience assembly, in an actor of its own: rollouts and scores meet in the object store, not in the driver.
The driver passes references in and gets back a reference to the result plus a few numbers for its metrics.

An actor rather than Ray tasks: a task needs a worker process, and Ray retires idle workers within seconds, so
every iteration would pay for a new process importing torch (seconds, measured in bench_iteration)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import ray
import torch

from rlhf_ray.algorithms.batch import Experience, RolloutBatch
from rlhf_ray.algorithms.experience import logprob_gap, make_experience, mismatch_kl, pack_rollouts, unpack_rollouts
from rlhf_ray.algorithms.advantages import informative_groups_first
from rlhf_ray.algorithms.diagnostics import correlation
from rlhf_ray.algorithms.masked import masked_mean
from rlhf_ray.algorithms.rewards import overlong_penalty
from rlhf_ray.config.ppo import PPOSpec


@dataclass
class RolloutStats:
    """Reward and answer statistics of a rollout's rows (with dynamic sampling: of every answer sampled)."""

    reward_mean: float
    """The share right under a 0/1 rule."""
    reward_std: float
    answer_length: float
    """Mean answer tokens."""
    reward_length_correlation: float
    answer_ended: float
    """The share of answers that ended (not cut at the length limit)."""
    overlong_penalty: float | None = None
    """With ppo.overlong_buffer: the mean bonus added to the scores."""
    informative_groups: float | None = None
    """With dynamic sampling: groups whose scores differ, a share of rollout_batch_size."""
    sampled_groups: float | None = None
    """With dynamic sampling: groups sampled."""
    trained_groups: float | None = None
    """With dynamic sampling: groups kept for training."""

    def metrics(self) -> dict[str, float]:
        named = {"reward/mean": self.reward_mean, "reward/std": self.reward_std, "answer/length": self.answer_length,
                 "reward/length_correlation": self.reward_length_correlation, "answer/ended": self.answer_ended,
                 "answer/overlong_penalty": self.overlong_penalty,
                 "dynamic/informative_groups": self.informative_groups, "dynamic/sampled_groups": self.sampled_groups,
                 "dynamic/trained_groups": self.trained_groups}
        return {name: value for name, value in named.items() if value is not None}


@dataclass
class ExperienceStats:
    """What the driver reports of a rollout's experience. None: not measured at scoring (the policy measures KL and
    the engine gap in its training forward where it gave no old log-probs: `measured_in_training`)."""

    rollout: RolloutStats
    multi_version_answers: float
    """The share of answers a weight update reached mid-generation (partial rollouts)."""
    advantage: tuple[float, float, float, float] | None = None
    """Mean, std, min and max of the advantages over the answer tokens (None: no answer tokens)."""
    kl: float | None = None
    """Mean per-token KL to the reference in the shaped rewards (kl/mean)."""
    distill_reverse_kl: float | None = None
    """Distillation: the reverse KL(policy || teacher) per answer token."""
    logprob_gap: float | None = None
    """Mean |engine - learner| log-prob of the sampled tokens (generate/logprob_gap)."""
    mismatch_kl: float | None = None
    """KL(engine || learner) per answer token (generate/mismatch_kl)."""
    mismatch_kl_by_age: tuple[float | None, float | None, float | None] = (None, None, None)
    """mismatch_kl over the tokens sampled 0, 1, 2 or more policy versions before the scoring one."""

    def measured_in_training(self, policy_stats: dict[str, float] | None) -> "ExperienceStats":
        """With the KL and engine gap the policy measured in its training forward (its `kl`, `engine_logprob_gap`,
        `engine_mismatch_kl` statistics) where scoring measured none: the policy gave no old log-probs, or the
        KL is in the loss."""
        if not policy_stats:
            return self
        return dataclasses.replace(
            self, kl=policy_stats.get("kl") if self.kl is None else self.kl,
            logprob_gap=policy_stats.get("engine_logprob_gap") if self.logprob_gap is None else self.logprob_gap,
            mismatch_kl=policy_stats.get("engine_mismatch_kl") if self.mismatch_kl is None else self.mismatch_kl)

    def metrics(self) -> dict[str, float]:
        """The flat names metrics.jsonl, TensorBoard and the dashboards read."""
        named = {"kl/mean": self.kl, "distill/reverse_kl": self.distill_reverse_kl,
                 "generate/logprob_gap": self.logprob_gap, "generate/mismatch_kl": self.mismatch_kl,
                 "generate/multi_version_answers": self.multi_version_answers}
        named |= dict(zip(("generate/mismatch_kl_age_0", "generate/mismatch_kl_age_1", "generate/mismatch_kl_age_2plus"),
                          self.mismatch_kl_by_age))
        if self.advantage is not None:
            named |= dict(zip(("advantage/mean", "advantage/std", "advantage/min", "advantage/max"), self.advantage))
        return self.rollout.metrics() | {name: value for name, value in named.items() if value is not None}


@dataclass
class KeptGroups:
    """What dynamic sampling kept of a rollout (ExperienceWorker.keep_informative), besides the kept rows' batch."""

    scores: torch.Tensor
    """[rows]: the reward of each kept row."""
    rows: int
    """Rows kept: whole groups."""
    sampled: RolloutStats
    """The sampled rollout's reward and answer statistics (every answer sampled, not the kept ones), with the
    groups informative, sampled and trained."""


@dataclass
class Assembled:
    """ExperienceWorker.experience's answer: where the experience is and what the driver reports of it."""

    ref: object
    """ObjectRef of the Experience batch, set by `gather` (the driver passes it on without holding it)."""
    rows: int
    """Its rows."""
    stats: ExperienceStats
    """Reward, answer, advantage, KL and engine/learner mismatch statistics."""
    samples: list[dict]
    """The first `keep_samples` rows: {prompt_ids, answer_ids, score, columns} (for samples.jsonl)."""
    token_versions: dict[int, int]
    """Answer tokens per policy version that sampled them."""
    assembly_seconds: float = 0.0
    """Packing the batch and assembling its experience (not the object store's reads and writes); logged as
    compute/assembly_seconds."""


@dataclass
class RoleOutputs:
    """What each scoring role gave for one batch: per role, the ObjectRefs of its replicas' parts, in row order
    (concatenated, one row per sample). A role that did not score has None."""

    rewards: list
    """The reward role's score of each answer."""
    old_logp: list | None = None
    """The policy's log-probs of the sampled tokens (None: its training forward, or the engine's, serve)."""
    ref_logp: list | None = None
    """The reference's (None: no KL term, no reference)."""
    values: list | None = None
    """The critic's values (estimators with a critic)."""
    teacher_logp: list | None = None
    """The teacher's log-probs of the sampled tokens (distillation)."""


class ExperienceWorker:
    def __init__(self, *, rank: int = 0, world_size: int = 1, ppo: dict, group_size: int, pad_token_id: int,
                 max_answer_tokens: int | None = None):
        torch.set_num_threads(1)
        self.spec, self.group_size, self.pad = PPOSpec.model_validate(ppo), group_size, pad_token_id
        self.max_answer_tokens = max_answer_tokens
        self.packing_seconds = 0.0
        """The last `batch` call's packing time (counted with the experience assembled from that batch)."""

    def batch(self, sample_refs: list) -> RolloutBatch:
        """Engine outputs (one list of samples per engine, in engine order) -> the padded rollout batch."""
        samples = [s for part in ray.get(sample_refs) for s in part]
        start = time.perf_counter()
        batch = pack_rollouts([s["prompt_ids"] for s in samples], [s["answer_ids"] for s in samples], self.pad,
                              [s.get("answer_mask") for s in samples])
        engine_logp = torch.zeros(batch.action_mask.shape)
        token_version = torch.zeros(batch.action_mask.shape, dtype=torch.long)
        for row, s in enumerate(samples):
            engine_logp[row, :len(s["logprobs"])] = torch.tensor(s["logprobs"])
            token_version[row, :len(s["versions"])] = torch.tensor(s["versions"], dtype=torch.long)
        batch = dataclasses.replace(batch, ended=torch.tensor([s["finished"] for s in samples]),
                                    columns=[s.get("columns", {}) for s in samples], engine_logp=engine_logp,
                                    version=torch.tensor([s["version"] for s in samples]), token_version=token_version)
        self.packing_seconds = time.perf_counter() - start
        return batch

    @ray.method(num_returns=2)
    def keep_informative(self, batch: RolloutBatch, score_refs: list) -> tuple[RolloutBatch, KeptGroups]:
        """Dynamic sampling, between the reward and the other roles: the rows of `rollout_batch_size` groups, those
        whose scores differ first (algorithms.advantages.informative_groups_first; without `fill` only those), so
        the reference, the policy's old log-probs and the critic score only the rows that train. Returns the kept
        rows' batch (a second object-store result, never through the driver) and their KeptGroups."""
        scores = torch.cat(ray.get(score_refs))
        rows, informative = informative_groups_first(scores, self.group_size, self.spec.rollout_batch_size,
                                                     self.spec.dynamic_sampling.fill)
        sampled = dataclasses.replace(self.rollout_stats(scores, batch),
                                      informative_groups=informative / self.spec.rollout_batch_size,
                                      sampled_groups=len(scores) / self.group_size,
                                      trained_groups=len(rows) / self.group_size)
        return batch.select(rows), KeptGroups(scores[rows], len(rows), sampled)

    def rollout_stats(self, scores: torch.Tensor, batch: RolloutBatch) -> RolloutStats:
        """Reward and answer statistics of a rollout's rows."""
        lengths = batch.action_mask.sum(-1)
        penalty = None
        if self.spec.overlong_buffer:
            penalty = overlong_penalty(lengths, self.max_answer_tokens, self.spec.overlong_buffer,
                                       self.spec.overlong_penalty).mean().item()
        return RolloutStats(scores.float().mean().item(), scores.float().std().item(), lengths.float().mean().item(),
                            correlation(scores, lengths), batch.ended.float().mean().item(), penalty)

    @ray.method(num_returns=2)
    def experience(self, batch: RolloutBatch, roles: RoleOutputs, scored_at: int = 0, keep_samples: int = 0,
                   sampled: RolloutStats | None = None) -> tuple[Experience, Assembled]:
        """What the roles gave -> the experience. `scored_at`: the policy version whose old log-probs came with the batch; the engine/learner
        mismatch is also reported by how many versions older a token's sampler was (generate/mismatch_kl_age_*).
        `sampled`: the rollout statistics dynamic sampling took over every sampled answer (KeptGroups.sampled),
        reported instead of the kept rows' own."""

        def cat(refs):
            return torch.cat(ray.get(refs)) if refs else None

        scores, old_logp, ref_logp = cat(roles.rewards), cat(roles.old_logp), cat(roles.ref_logp)
        values, teacher_logp = cat(roles.values), cat(roles.teacher_logp)
        learner_logp = old_logp  # the policy's own forward, when it ran one
        if self.spec.old_logprobs == "engine":
            old_logp = batch.engine_logp
        start = time.perf_counter()
        targets = make_experience(scores, old_logp, ref_logp, values, batch.action_mask, batch.ended, self.spec,
                                  self.group_size, self.max_answer_tokens, teacher_logp)
        assembled = Experience.of(batch, targets)
        stats = ExperienceStats(
            sampled if sampled is not None else self.rollout_stats(scores, batch),
            multi_version_answers=(  # answers a weight update reached mid-generation
                (batch.token_version.masked_fill(batch.action_mask == 0, -1).amax(-1) > batch.version).float().mean()
                .item()),
            advantage=advantage_stats(targets.advantages, batch.action_mask),
            kl=targets.kl.mean().item() if targets.kl is not None else None)  # else the policy's, from training
        if teacher_logp is not None:  # the reverse KL(policy || teacher) per answer token, on the policy's samples
            stats.distill_reverse_kl = masked_mean(old_logp - teacher_logp, batch.action_mask).item()
        if learner_logp is not None:  # else the policy measures it in its training forward, or nobody (engine's)
            stats.logprob_gap = logprob_gap(batch.engine_logp, learner_logp, batch.action_mask)
            stats.mismatch_kl = mismatch_kl(batch.engine_logp, learner_logp, batch.action_mask)
            stats.mismatch_kl_by_age = mismatch_by_age(batch, learner_logp, scored_at)
        samples = sample_rows(batch, scores, keep_samples)
        versions = batch.token_version[batch.action_mask.bool()]
        return assembled, Assembled(None, len(assembled), stats, samples,
                         {int(v): int(n) for v, n in zip(*versions.unique(return_counts=True))},
                         assembly_seconds=self.packing_seconds + time.perf_counter() - start)


def mismatch_by_age(batch: RolloutBatch, learner_logp: torch.Tensor,
                    scored_at: int) -> tuple[float | None, float | None, float | None]:
    """The engine/learner mismatch over the answer tokens sampled 0, 1, 2 or more policy versions before the
    learner's `scored_at` (the drift of older weights adds to the engines' numeric gap; None: no tokens of that
    age)."""
    age = (scored_at - batch.token_version).clamp(min=0, max=2)
    out = []
    for older in (0, 1, 2):
        mask = batch.action_mask * (age == older)
        out.append(mismatch_kl(batch.engine_logp, learner_logp, mask) if mask.sum() > 0 else None)
    return tuple(out)


def sample_rows(batch: RolloutBatch, scores: torch.Tensor, n: int) -> list[dict]:
    """The first n rows of a rollout batch as {prompt_ids, answer_ids, score, columns} (padding dropped)."""
    n = min(n, len(scores))
    return [{"prompt_ids": prompt, "answer_ids": answer, "score": scores[i].item(), "columns": batch.columns[i]}
            for i, (prompt, answer) in enumerate(unpack_rollouts(batch, 0, n))]


def advantage_stats(advantages: torch.Tensor, action_mask: torch.Tensor) -> tuple[float, float, float, float] | None:
    """Mean, std, min and max over the answer tokens: what the estimator gave the policy to climb (a std near 0
    means it learns nothing from this rollout; GRPO's groups of equal scores give exact zeros)."""
    taken = advantages[action_mask.bool()].float()
    if taken.numel() == 0:
        return None
    return (taken.mean().item(), taken.std().item() if taken.numel() > 1 else 0.0, taken.min().item(),
            taken.max().item())
