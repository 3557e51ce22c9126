"""Threads per role when the roles of a sync PPO job take turns.

A CPU role's default thread count is its CPU share (placement.num_cpus, rounded down). In sync mode that share
idles most of the time: the engines generate, then the experience roles score, then the learners train, each
phase alone on the node. Giving every role its share as threads left a one-core policy training while the other
core waited. So in sync mode a CPU role that sets no `threads` gets the node's cores divided among the replicas
busy in each phase it works in (never fewer than its share): its process starts with the most of them, and a
learner that scores alongside other roles (old log-probs, values) before it trains alone scores on the fewer
(`PPOJob.scoring_threads`): a policy that trained on one core of two because it had scored beside the reference
now trains on both. Async mode overlaps generation with training, so it keeps the shares; GPU roles and explicit
`placement.threads` are left as they are."""

from __future__ import annotations

import logging
import math

from rlhf_ray.config.ppo_job import PPOJob

log = logging.getLogger(__name__)


def phases(job: PPOJob) -> dict[str, list[str]]:
    """The roles busy together in each phase of a sync iteration (a reward function is too cheap to count)."""
    experience = [role for role in ("reference", "teacher") if getattr(job, role) is not None] + \
        (["reward"] if job.reward.is_model else [])
    if job.critic is not None:
        experience.append("critic")  # values
    if job.policy_scores_rollouts:
        experience.append("policy")  # old log-probs
    return {"generation": ["generation"], "experience": experience,
            "train": ["policy"] + (["critic"] if job.critic is not None else [])}


def phase_threads(job: PPOJob, node_cpus: int) -> dict[str, dict[str, int]]:
    """Threads per replica of each CPU role without an explicit `threads`, in each phase it is busy in, for roles
    taking turns on nodes of `node_cpus` cores (empty in async mode)."""
    if job.ppo.mode != "sync":
        return {}
    roles = job.placement_roles()
    busy = {name: sum(roles[r].replicas for r in members) for name, members in phases(job).items()}
    out = {}
    for role, placement in roles.items():
        if placement.threads is not None or placement.num_gpus > 0:
            continue
        share = max(1, math.floor(placement.num_cpus))
        busy_in = [name for name, members in phases(job).items() if role in members]
        # a role in no phase (a reward function: too cheap to count) is never crowded
        out[role] = {name: max(share, node_cpus // busy[name]) for name in busy_in} or {"alone": max(share, node_cpus)}
    return out


def turn_threads(job: PPOJob, node_cpus: int) -> dict[str, int]:
    """Each such role's process threads: the most any of its phases gives it."""
    return {role: max(by_phase.values()) for role, by_phase in phase_threads(job, node_cpus).items()}


def with_turn_threads(job: PPOJob, node_cpus: int) -> PPOJob:
    """The job with `placement.threads` filled in from turn_threads, and `scoring_threads` for the learners that
    score in a more crowded phase than they train in."""
    by_phase = phase_threads(job, node_cpus)
    if not by_phase:
        return job
    threads = turn_threads(job, node_cpus)
    scoring = {role: p["experience"] for role, p in by_phase.items()
               if "experience" in p and p["experience"] < threads[role]}
    log.info("sync mode, roles take turns: threads per replica %s", ", ".join(
        f"{r} {n}" + (f" ({scoring[r]} while scoring)" if r in scoring else "") for r, n in threads.items()))
    job = job.model_copy(deep=True)
    for role, n in threads.items():
        section = job.generation if role == "generation" else getattr(job, role)
        section.placement = section.placement.model_copy(update={"threads": n})
    job.scoring_threads = scoring
    return job
