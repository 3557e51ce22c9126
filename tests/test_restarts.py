"""Automatic restarts after a learner rank dies (rlhf_ray/jobs/restarts.py), without Ray: which errors end an
attempt, how many attempts run, what the final error says."""

from __future__ import annotations

import time

import pytest
import ray

from rlhf_ray.actors.group import ActorCallTimeout, ActorDiedError, RemoteCallError, results_lost
from rlhf_ray.jobs.checkpoints import Checkpoints
from rlhf_ray.actors.experience_worker import Assembled
from rlhf_ray.jobs.ppo.scoring import ResultsLost, Scored
from rlhf_ray.jobs.restarts import LearnerRankDied, learner_deaths_explained, with_learner_restarts
from tests.ppo_standins import Workers, experience_stats, feed, take


def test_a_dead_or_hung_rank_of_a_learner_group_is_named_with_the_checkpoint_to_resume_from(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep_last=2)
    (tmp_path / "checkpoints" / "step-00000003").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000003" / "trainer_state.json").write_text('{"step": 3}')
    with pytest.raises(LearnerRankDied, match=r"sft-learner-1 died.*resume from .*step-00000003"):
        with learner_deaths_explained(checkpoints, ("sft-learner",)):
            raise ActorDiedError("gone", "sft-learner-1")
    with pytest.raises(LearnerRankDied, match="critic-0 hangs"):
        with learner_deaths_explained(checkpoints, ("policy", "critic")):
            raise ActorCallTimeout("slow", [("critic-0", None)])
    with pytest.raises(ActorDiedError):  # a stateless role's death is the caller's to handle (it is replaced)
        with learner_deaths_explained(checkpoints, ("policy", "critic")):
            raise ActorDiedError("gone", "generation-0")


def test_restarts_are_bounded_and_counted(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep_last=2)
    seen = []

    def dies_twice(restarts: int) -> str:
        seen.append(restarts)
        if restarts < 2:
            raise LearnerRankDied("policy-0", "died", "run the job again with the same output_dir to resume",
                                  f"attempt {restarts}")
        return "done"

    assert with_learner_restarts(2, checkpoints, dies_twice) == "done" and seen == [0, 1, 2]
    seen.clear()
    with pytest.raises(LearnerRankDied, match="attempt 1") as stopped:
        with_learner_restarts(1, checkpoints, dies_twice)
    assert seen == [0, 1]
    assert str(stopped.value).splitlines()[0] == (
        "learner rank policy-0 died; a ZeRO group cannot continue without one of its ranks, so the job stops after 1 "
        "automatic restart (cluster.learner_restarts): run the job again with the same output_dir to resume.")
    seen.clear()
    with pytest.raises(ValueError):  # any other error ends the job at once
        with_learner_restarts(2, checkpoints, lambda restarts: seen.append(restarts) or int("x"))
    assert seen == [0]


def test_a_restart_is_announced_once_as_what_happens_not_as_a_stop(tmp_path, caplog):
    """The log line of an automatic restart says the job goes on by itself; the advice to run the job again is
    only given when it stops."""
    checkpoints = Checkpoints(tmp_path, keep_last=2)

    def dies_once(restarts: int) -> str:
        if restarts == 0:
            raise LearnerRankDied("critic-0", "died", "run the job again with the same output_dir to resume", "gone")
        return "done"

    with caplog.at_level("WARNING", logger="rlhf_ray.jobs.restarts"):
        assert with_learner_restarts(2, checkpoints, dies_once) == "done"
    assert [r.getMessage() for r in caplog.records] == [
        "learner rank critic-0 died; a ZeRO group cannot continue without one of its ranks: the job restarts every "
        "actor from the start by itself (automatic restart 1 of 2, cluster.learner_restarts)"]


def lost_with_node() -> RemoteCallError:
    """What a call reading an object owned by an actor of a dead node raises (RemoteCallError from gather)."""
    return RemoteCallError("experience-0 raised in `experience`: OwnerDiedError", "experience-0",
                           ray.exceptions.OwnerDiedError("00" * 28, b"", ""))


class ScoringLosesResults(Workers):
    """Role workers whose scoring fails `losses` times because a node took results with it."""

    def __init__(self, losses: int):
        super().__init__(capacity=4, max_staleness=4)
        self.losses, self.rollouts = losses, []

    def score(self, rollout):
        self.rollouts.append(rollout)
        if len(self.rollouts) <= self.losses:
            raise ResultsLost(str(lost_with_node()))
        return rollout

    def advantages(self, scores, scored_at: int) -> Scored:
        return Scored(Assembled(scores.index, scores.samples, experience_stats(1.0), [], {}), {})


def from_rollout(workers: Workers, index: int, redo_limit: int):
    rollouts = feed(workers, ahead=0, redo_limit=redo_limit)
    rollouts.resume_at(index)
    return rollouts


def test_an_iteration_whose_results_died_with_a_node_is_generated_and_scored_again():
    assert results_lost(lost_with_node())
    assert not results_lost(RemoteCallError("reward-0 raised in `score`: ValueError", "reward-0", ValueError()))
    workers = ScoringLosesResults(losses=2)
    taken = take(from_rollout(workers, 4, redo_limit=3), workers, updates_left=1)
    assert taken.put.index == 4 and taken.put.scored.experience.stats.metrics()["reward/mean"] == 1.0
    assert workers.events == ["start 4", "start 4", "start 4"]  # generated, then generated again twice
    assert len(workers.rollouts) == 3 and taken.put.rollout is workers.rollouts[-1]
    slow = ScoringLosesResults(losses=1)  # each collection takes 0.2 s: the wait is the first one's, the redo's is
    collect = slow.pool.collect           # the experience's time (counted once)
    slow.pool.collect = lambda pending: (time.sleep(0.2), collect(pending))[1]
    taken = take(from_rollout(slow, 4, redo_limit=1), slow, updates_left=1)
    assert 0.2 <= taken.wait_seconds < 0.35 and taken.put.seconds >= 0.2
    losing = ScoringLosesResults(losses=5)
    with pytest.raises(ResultsLost, match="OwnerDiedError"):  # bounded: a node that keeps taking results
        take(from_rollout(losing, 4, redo_limit=2), losing, updates_left=1)
    assert losing.events == ["start 4"] * 3

    class RewardFails(Workers):
        def score(self, rollout):
            raise RemoteCallError("reward-0 raised in `score`: ValueError", "reward-0", ValueError())

    failing = RewardFails(capacity=4, max_staleness=4)
    with pytest.raises(RemoteCallError, match="ValueError"):  # any other failure is the job's, not retried
        take(from_rollout(failing, 4, redo_limit=2), failing, updates_left=1)
    assert failing.events == ["start 4"]  # nothing was generated again


NODE_DIED = ("The actor died because its node has died. Node Id: 300bbe81\n\tthe actor's node was terminated "
             "unexpectedly: health check failed due to missing too many heartbeats")  # Ray 2.60's words


def test_actors_started_on_a_dying_node_are_placed_again_without_spending_a_restart(tmp_path):
    checkpoints, seen = Checkpoints(tmp_path, keep_last=2), []

    def placed_on_the_lost_node_twice(restarts: int) -> str:
        seen.append(restarts)
        if len(seen) <= 2:
            raise ActorDiedError(f"policy-0 died during `PolicyLearner.__init__`: {NODE_DIED}", "policy-0",
                                 "PolicyLearner.__init__")
        return "done"

    assert with_learner_restarts(0, checkpoints, placed_on_the_lost_node_twice) == "done" and seen == [0, 0, 0]
    for during, message in (("train", NODE_DIED), ("PolicyLearner.__init__", "CUDA out of memory")):
        def dies(restarts: int, during=during, message=message) -> str:
            raise ActorDiedError(message, "policy-0", during)

        with pytest.raises(ActorDiedError):  # a death in training, or at start for another reason, is not retried
            with_learner_restarts(2, checkpoints, dies)


def test_a_restart_of_a_fresh_run_resumes_from_its_own_checkpoints_not_an_earlier_runs(tmp_path):
    """checkpoint.resume: false with an earlier run's step-5 in the folder: the run starts afresh, and after an
    automatic restart it goes on from the checkpoint it sealed itself (before: from step 0 again)."""
    earlier = Checkpoints(tmp_path, keep_last=5)
    earlier.commit(earlier.staging(5), 5, {})
    checkpoints = Checkpoints(tmp_path, keep_last=5)
    assert checkpoints.resumable(resume=False) is None  # the fresh start
    assert checkpoints.resumable(resume=True).name == "step-00000005"
    checkpoints.commit(checkpoints.staging(2), 2, {})
    assert checkpoints.resumable(resume=False).name == "step-00000002"  # the restart: its own newest
    assert checkpoints.latest().name == "step-00000005"


def test_a_fresh_run_keeps_its_own_checkpoints_before_an_earlier_runs_later_ones(tmp_path):
    """keep_last 2 in a folder where an earlier run left steps 50 and 60: the fresh run's step 1 and 2 are kept and
    the earlier run's go (before: sorted by step, the fresh run pruned its own new checkpoints at once)."""
    earlier = Checkpoints(tmp_path, keep_last=2)
    for step in (50, 60):
        earlier.commit(earlier.staging(step), step, {})
    fresh = Checkpoints(tmp_path, keep_last=2)
    fresh.commit(fresh.staging(1), 1, {})
    assert [p.name for p in fresh.complete()] == ["step-00000001", "step-00000060"]
    fresh.commit(fresh.staging(2), 2, {})
    assert [p.name for p in fresh.complete()] == ["step-00000001", "step-00000002"]
    fresh.commit(fresh.staging(3), 3, {})
    assert [p.name for p in fresh.complete()] == ["step-00000002", "step-00000003"]
    assert fresh.resumable(resume=False).name == "step-00000003"


def test_weights_lost_with_the_policy_node_during_a_sync_end_the_attempt_as_that_ranks_death(tmp_path):
    """Object-store sync: the node of policy rank 0 dies after it published the buckets and before every engine
    loaded them. The engines' error (the buckets' owner died) names the engine; the attempt must end as the policy
    rank's death, which restarts the job from its checkpoint (test_multinode.py hit this once in CI: the job
    stopped on `generation-0 raised in load_weights: OwnerDiedError`)."""
    from types import SimpleNamespace

    from rlhf_ray.jobs.ppo.weight_sync import WeightSync
    from rlhf_ray.learners.policy import SentWeights

    class Pool:
        def broadcast(self, refs, version):
            raise lost_with_node()

    policy = SimpleNamespace(names=["policy-0"], call=lambda method, *a: [SentWeights(1, 0.0)])
    weights = object.__new__(WeightSync)
    weights.workers = SimpleNamespace(policy=policy, pool=Pool())
    weights.version, weights.transport, weights.bucket_bytes, weights.adapters_only = 0, "object_store", 2**20, False
    with pytest.raises(LearnerRankDied, match="policy-0 died during `publish_weights`"):
        with learner_deaths_explained(Checkpoints(tmp_path, keep_last=1), ("policy", "critic")):
            weights.sync()


def test_an_engine_replaced_after_the_policy_node_died_ends_the_attempt_as_that_ranks_death(tmp_path):
    """Object-store sync, the node holding policy rank 0 and an engine dies: the engine is replaced first, and its
    re-sync reads the last published buckets, whose owner (policy rank 0) died with the node. That too is the
    policy rank's death, so the job restarts from its checkpoint (tests/test_hosts.py's lost host stopped on
    `generation-0 failed in load_weights`, OwnerDiedError, when policy rank 0 was placed on the lost host)."""
    from types import SimpleNamespace

    from rlhf_ray.jobs.ppo.weight_sync import WeightSync

    class Pool:
        on_replaced = None

        def resync(self, rank):
            raise lost_with_node()

    weights = object.__new__(WeightSync)
    weights.workers = SimpleNamespace(policy=SimpleNamespace(names=["policy-0"]), pool=Pool())
    with pytest.raises(LearnerRankDied, match="policy-0 died after `publish_weights`"):  # not during: it had ended
        with learner_deaths_explained(Checkpoints(tmp_path, keep_last=1), ("policy", "critic")):
            weights._resync_published(0)


def test_the_end_of_a_job_kills_engines_that_cannot_shut_down():
    """GenerationPool.close: the engines are asked to release what they hold outside their processes; a hung or dead
    one fails the call, and every engine is killed all the same."""
    from rlhf_ray.actors.group import RestartBudget
    from rlhf_ray.actors.pool import GenerationPool

    calls = []

    class Engines:
        def call(self, method, timeout=None):
            calls.append((method, timeout))
            raise ActorCallTimeout("slow", [("generation-1", None)])

        def kill(self):
            calls.append("kill")

    GenerationPool(Engines(), "vllm", RestartBudget(0)).close(timeout_s=3)
    assert calls == [("close", 3), "kill"]


def test_a_placement_after_a_lost_node_waits_for_a_node_to_join_then_gives_up_naming_the_wait():
    """A restart after a lost node used to meet the cluster before the replacement node joined and stop with
    ClusterTooSmall (seen in CI's multi-node test); now it waits for room, up to cluster.startup_timeout_s."""
    from rlhf_ray.cluster import ClusterTooSmall, nodes_with_room
    from rlhf_ray.config.placement import PlacementSpec
    from rlhf_ray.plan import ResourcePlan

    plan = ResourcePlan.from_roles({"policy": PlacementSpec(num_cpus=0.75), "generation": PlacementSpec(num_cpus=0.75)})
    one, two = [{"CPU": 1.0}], [{"CPU": 1.0}, {"CPU": 1.0}]
    answers = [one, one, two]
    assert nodes_with_room(plan, lambda: answers.pop(0), timeout_s=30, poll_s=0.01) == two and answers == []
    assert nodes_with_room(plan, lambda: two, timeout_s=0.01) == two  # room at once: no wait
    with pytest.raises(ClusterTooSmall, match=r"(?s)needs 1.5 CPUs.*no node that would make room joined within 0.05 s"):
        nodes_with_room(plan, lambda: one, timeout_s=0.05, poll_s=0.01)
