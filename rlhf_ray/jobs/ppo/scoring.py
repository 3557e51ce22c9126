"""Scoring a rollout on every role at once (`Scorer.score`): the reward, the reference's and the teacher's log-probs,
the policy's old log-probs where the loss needs them, the critic's values; then (`Scorer.advantages`) the assembler
turns what they gave (RoleOutputs) into experience: KL-shaped rewards, advantages and returns by the job's estimator
(algorithms/advantages.py). The roles' actors are RoleWorkers' (jobs/ppo/workers.py), which starts and kills them."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import ray
import torch

from rlhf_ray.actors.experience_worker import Assembled, RoleOutputs, RolloutStats
from rlhf_ray.actors.group import ActorGroup, RemoteCallError, resilient_gather, results_lost
from rlhf_ray.actors.pool import Rollout
from rlhf_ray.algorithms.experience import row_bounds
from rlhf_ray.config.ppo_job import PPOJob


class ResultsLost(RuntimeError):
    """A rollout or its scores died with a node before its experience was assembled (nothing changed yet): generate
    and score it again."""


@dataclass
class Scores:
    """What every role gave for a rollout, not yet experience."""

    batch: object
    """The packed batch's object reference: the rollout's rows, or with dynamic sampling the kept groups' rows."""
    outputs: RoleOutputs
    sampled: RolloutStats | None
    """With dynamic sampling: the rollout statistics over every sampled answer, reported instead of the kept
    rows'."""
    role_seconds: dict[str, float]
    """Compute seconds of each role (reference, reward, policy, critic, teacher), the slowest replica's."""


@dataclass
class Scored:
    """A rollout scored into experience by every role."""

    experience: Assembled
    """The experience worker's answer: the batch's reference, its rows (the rollout's samples; fewer with dynamic
    sampling), its metrics, its first `logging.samples_per_iteration` rows and its tokens per sampling version."""
    role_seconds: dict[str, float]
    """Compute seconds of each role (reference, reward, policy, critic, teacher), the slowest replica's."""


class Scorer:
    """Scores rollouts with the groups of `roles` (a RoleWorkers: read at each call, so a replaced actor is used).
    Both steps raise ResultsLost when a node took results they needed (nothing changed yet: generate it again)."""

    def __init__(self, job: PPOJob, roles):
        self.job, self.roles = job, roles

    def score(self, rollout: Rollout) -> Scores:
        """Every role scores the rollout at once (the policy's old log-probs: with its current weights). With
        dynamic sampling the reward scores first and the others score only the groups kept (veRL's DAPO filters
        before its old-log-prob and reference passes too): half the rows at `oversample: 2`."""
        with lost_results():
            return self._score(rollout)

    def advantages(self, scores: Scores, scored_at: int) -> Scored:
        """The assembler turns the roles' outputs into experience: KL-shaped rewards, then advantages and returns by
        the job's estimator (config/estimators.py names it, algorithms/advantages.py computes it). `scored_at`: the
        policy version whose old log-probs came with the scores (the engine/learner mismatch by age)."""
        (assembler,) = self.roles.assembler.actors
        with lost_results():
            (out,) = self.roles.assembler.gather([assembler.experience.remote(
                scores.batch, scores.outputs, scored_at, self.job.logging.samples_per_iteration,
                scores.sampled)], "experience")
        return Scored(out, scores.role_seconds)

    def reward_scores(self, batch_ref, rows: int) -> torch.Tensor:
        """The reward role's score of each row of a packed batch (evaluation's answers, a test's rollout)."""
        parts = self.gather(self.roles.reward, "score", self.submit(self.roles.reward, "score", batch_ref, rows))
        return torch.cat(ray.get([p.ref for p in parts]))

    def submit(self, group: ActorGroup, method: str, batch_ref, rows: int) -> tuple[list, list]:
        """Replica i scores its contiguous share of the rows; returns (per-replica args, call refs) in row order."""
        args = [(batch_ref, lo, hi) for lo, hi in row_bounds(rows, len(group))]
        return args, [getattr(actor, method).remote(*a) for actor, a in zip(group.actors, args)]

    def gather(self, group: ActorGroup, method: str, submitted: tuple[list, list]) -> list:
        """Results of `submit`; a replica that died is replaced and its rows scored again (unless it holds a shard
        of a sharded model: then the group cannot go on, as a learner group cannot)."""
        if group.role in self.roles.sharded:
            return group.gather(submitted[1], method)
        return resilient_gather(group, method, submitted[0], submitted[1], self.roles.restarts)

    def _score(self, rollout: Rollout) -> Scores:
        roles = self.roles
        (assembler,) = roles.assembler.actors
        batch, rows = assembler.batch.remote(rollout.refs), rollout.samples
        split = {"reward": (roles.reward, "score"), "ref_logp": (roles.reference, "logprobs"),
                 "teacher_logp": (roles.teacher, "logprobs")}  # RoleOutputs field: (group, method); rows split
        split = {field: (group, method) for field, (group, method) in split.items() if group is not None}
        results, kept = {}, None
        if self.job.ppo.dynamic_sampling.enabled:  # the reward first: the other roles score only the kept groups
            group, method = split.pop("reward")
            results["reward"] = self.gather(group, method, self.submit(group, method, batch, rows))
            batch, kept_ref = assembler.keep_informative.remote(batch, [r.ref for r in results["reward"]])
            (kept,) = roles.assembler.gather([kept_ref], "keep_informative")
            rows = kept.rows
        calls = {field: self.submit(group, method, batch, rows) for field, (group, method) in split.items()}
        whole = {}  # learner groups: every rank sees the whole batch
        if self.job.policy_scores_rollouts:
            whole["old_logp"] = (roles.policy, "logprobs", roles.policy.submit("logprobs", batch))
        if roles.critic is not None:
            whole["values"] = (roles.critic, "values", roles.critic.submit("values", batch))
        results |= {field: self.gather(group, method, calls[field]) for field, (group, method) in split.items()}
        results |= {field: group.gather(refs, method) for field, (group, method, refs) in whole.items()}
        parts = {field: [r.ref for r in out] for field, out in results.items()}
        outputs = RoleOutputs(rewards=[ray.put(kept.scores)] if kept is not None else parts["reward"],
                              old_logp=parts.get("old_logp"), ref_logp=parts.get("ref_logp"),
                              values=parts.get("values"), teacher_logp=parts.get("teacher_logp"))
        # with dynamic sampling the rollout's reward and answer metrics are every sampled answer's, not the kept ones'
        return Scores(batch, outputs, kept.sampled if kept is not None else None,
                      {ROLE_OF[field]: max(r.seconds for r in part) for field, part in results.items()})


ROLE_OF = {"reward": "reward", "ref_logp": "reference", "teacher_logp": "teacher", "old_logp": "policy",
           "values": "critic"}
"""The role that gives each RoleOutputs field (Scores.role_seconds is by role: the time/<role> metrics)."""


@contextmanager
def lost_results():
    """A RemoteCallError whose results died with a node becomes ResultsLost (the loop generates the rollout again);
    any other failure is the job's."""
    try:
        yield
    except RemoteCallError as err:
        if results_lost(err):
            raise ResultsLost(str(err)) from err
        raise
