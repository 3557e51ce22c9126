"""One update's metrics line (metrics.jsonl, TensorBoard, the Ray dashboard), built here and nowhere else: the
experience it trained on (from when that was scored), the update, the weight sync, and where the iteration's time
went."""

from __future__ import annotations

from rlhf_ray.envs.episode import episode_metrics
from rlhf_ray.jobs.ppo.rollouts import Taken
from rlhf_ray.jobs.ppo.weight_sync import SyncResult
from rlhf_ray.jobs.ppo.workers import Trained


def iteration_metrics(taken: Taken, trained: Trained, synced: SyncResult, elapsed: float, engines: int,
                      restarts: int, learner_restarts: int) -> dict[str, float]:
    """`elapsed`: the iteration's wall time; `engines`: generation replicas; `restarts`: actors replaced so far;
    `learner_restarts`: times the job restarted every role after a learner rank died."""
    put, minibatches = taken.put, taken.minibatches
    rollout, assembled = put.rollout, put.scored.experience
    # without old log-probs in the experience, the policy measured KL and the engine gap in its training forward
    experience = assembled.stats.measured_in_training(trained.policy.stats if trained.policy is not None else None)
    roles = {f"compute/{role}_seconds": seconds for role, seconds in put.scored.role_seconds.items()}
    experience_compute = max(roles.values()) + assembled.assembly_seconds  # the roles run at once
    line = {**experience.metrics(), "compute/assembly_seconds": assembled.assembly_seconds, **roles,
            **episode_metrics(rollout.episodes, rollout.samples), **trained.metrics(), **minibatches.stats,
            "compute/experience_seconds": experience_compute, "time/experience": put.seconds,
            "time/engine_generate": rollout.engine_seconds, "time/engine_busy": rollout.engine_busy_seconds,
            "generate/tokens": rollout.tokens,
            "generate/streamed_groups": rollout.streamed_groups / max(1, len(rollout.prompt_keys)),
            "generate/restarted_answers": rollout.restarted_answers, "generate/engines": rollout.engines,
            "time/train": trained.wall, "time/sync": synced.seconds, "compute/train_seconds": trained.seconds,
            "compute/sync_seconds": synced.learner_gather_seconds + synced.engine_load_seconds,
            "sync/bytes": synced.bytes, "sync/gather_seconds": synced.gather_seconds,
            "sync/load_seconds": synced.load_seconds, "policy_version": synced.version,
            "experience/staleness": minibatches.staleness, "actors/restarts": restarts,
            "actors/learner_restarts": learner_restarts}
    line |= token_staleness(assembled.token_versions, minibatches.meta.version + minibatches.staleness)
    compute = rollout.engine_seconds + experience_compute + trained.seconds + line["compute/sync_seconds"]
    return line | {"time/generate_wait": taken.wait_seconds, "time/iteration": elapsed,
                   "time/orchestration_fraction": max(0.0, elapsed - compute) / elapsed,
                   "generate/tokens_per_s": rollout.tokens / max(rollout.engine_seconds, 1e-9),
                   "generate/engine_utilisation": rollout.engine_busy_seconds / (engines * elapsed)}


def token_staleness(token_versions: dict[int, int], trained_at: int) -> dict[str, float]:
    """Shares of the answer tokens an update trained on by how many versions older than the policy they were
    sampled: 0, 1, 2 or more (partial rollouts mix versions within an answer)."""
    total = sum(token_versions.values()) or 1
    by_age = [0, 0, 0]
    for version, count in token_versions.items():
        by_age[min(2, trained_at - version)] += count
    return {"experience/tokens_staleness_0": by_age[0] / total, "experience/tokens_staleness_1": by_age[1] / total,
            "experience/tokens_staleness_2plus": by_age[2] / total}
