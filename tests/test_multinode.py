"""Nodes that join and leave a multi-node Ray: Ray's own test harness (`ray.cluster_utils.Cluster`) runs a head and
four worker raylets on this machine, on 127.0.0.1 (one cluster for both tests), and the roles of a PPO job land on
different nodes. An elastic generation pool takes engines on nodes that join and drops those whose nodes leave.
Removing the node of the engine, then of the reference, is survived by replacing the actor on its rescheduled
bundle; removing the policy's node makes the job restart every role from its last checkpoint by itself. Each
disturbed run ends with the numbers of an undisturbed run on the same cluster. ~2.5 min (four runs and a restart;
the SFT and reward models are the session's)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray

from tests.conftest import at_checkpoints, job_actor
from tests.test_ppo_job import ppo_job

pytestmark = pytest.mark.system

# Every bundle takes 0.75 of a 1-CPU node, so no two groups share a node: policy, critic (with the reward model),
# reference and engine each get a node of their own.
ONE_ROLE_PER_NODE = ["policy.placement.num_cpus=0.75", "critic.placement.num_cpus=0.5",
                     "reward.placement.num_cpus=0.25", "reference.placement.colocate_with=null",
                     "reference.placement.num_cpus=0.75", "generation.placement.num_cpus=0.75"]
RUN = ["ppo.iterations=5", "ppo.rollout_batch_size=16", "ppo.eval_prompts=8", "policy.micro_batch_size=16",
       "critic.micro_batch_size=16", "checkpoint.every_steps=1", "checkpoint.keep_last=10",
       "generation.engine=hf", "cluster.call_timeout_s=300", "cluster.startup_timeout_s=300"]
WORKERS = 4


@pytest.fixture(scope="module")
def three_plus_nodes():
    """A head (the driver's node, no CPU for actors) and WORKERS 1-CPU nodes, all on loopback, shared by the module's
    two tests (one cluster start less). Each test leaves WORKERS nodes alive: the elastic test adds two nodes and
    removes two; the lost-node test replaces each node it removes. Nodes are added and removed on the driver's
    thread, between two updates."""
    from ray.cluster_utils import Cluster

    from rlhf_ray import cluster as rcluster

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(rcluster.LOOPBACK_ENV, "0")
        with rcluster._loopback_mode():
            # a lost node is marked dead after 3 missed 1-s health checks (Ray's default: 5 of 3 s), so each removal
            # costs the job seconds of waiting, not 15
            fast_death = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                          "health_check_failure_threshold": 3}
            harness = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                                    "_system_config": fast_death})
            for _ in range(WORKERS):
                harness.add_node(num_cpus=1)
            harness.wait_for_nodes()
        try:
            yield harness
        finally:
            harness.shutdown()


def node_of(name: str, namespace: str, timeout: float = 300) -> str:
    """The node of the live actor `name`; while a lost one is being replaced by the job, its name may still point
    to the dead actor (or to none): ask again until the replacement answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            actor = job_actor(name, namespace)
            return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()),
                           timeout=60)
        except (ValueError, ray.exceptions.RayActorError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def remove_node_of(harness, name: str, namespace: str) -> str:
    """Kill every process of the node that hosts actor `name` (as a lost machine would), and add a fresh node in
    its place, as an autoscaler would."""
    from rlhf_ray import cluster as rcluster

    node_id = node_of(name, namespace)
    node = next(n for n in harness.worker_nodes if n.node_id == node_id)
    harness.remove_node(node, allow_graceful=False)
    with rcluster._loopback_mode():  # the new raylet on 127.0.0.1 too, where the others listen
        harness.add_node(num_cpus=1)
    return node_id


def answers(actor) -> bool:
    """Whether `actor` still answers a call (False once Ray reports it dead)."""
    try:
        ray.get(actor.__ray_call__.remote(lambda self: None), timeout=10)
        return True
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:
        return True


def step_logs(out: Path) -> list[dict]:
    return [m for m in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
            if "policy_version" in m]


def test_an_elastic_pool_grows_when_nodes_join_and_drops_engines_whose_nodes_leave(
        tmp_path, three_plus_nodes, sft_model, rm_model, monkeypatch):
    """generation.placement: 1 engine, up to 2. Every node is taken, so the second engine's placement group waits.
    After update 1 a node joins: the extra engine starts there, loaded with the current weights, before update 2's
    rollout. After update 2 the first engine's node goes: update 3's rollout finds it gone, and as the pool is
    above its minimum it is dropped (no restart spent) and the extra engine answers its share; its bundle of the
    job's placement group waits for a node. After update 3 a node joins, Ray places the bundle there, and an
    engine starts on it. After update 4 the extra engine's node goes: it is dropped the same way and its group is
    asked for again. The learners never restart, every update trains on experience of the current policy version,
    and the run ends with the numbers of one where no node came or went (the prompts are cut into max_replicas
    slices with their own seeds, whatever the engines present). Nodes are added and removed between updates (the
    pool's `grow`, on the driver's thread), so the test does not race the job's pace."""
    from rlhf_ray import cluster as rcluster
    from rlhf_ray.actors.pool import GenerationPool
    from rlhf_ray.jobs.ppo import run_ppo

    iterations = 5
    elastic = [*ONE_ROLE_PER_NODE, *RUN, f"ppo.iterations={iterations}", "generation.placement.max_replicas=2",
               f"cluster.address={three_plus_nodes.address}"]
    calm_job, job = (ppo_job(tmp_path / name, sft_model, rm_model, *elastic) for name in ("calm", "elastic"))
    calm_summary = run_ppo(calm_job)

    grow, seen = GenerationPool.grow, {"updates": 0}

    def add_node():
        with rcluster._loopback_mode():  # the new raylet on 127.0.0.1 too, where the others listen
            return three_plus_nodes.add_node(num_cpus=1)

    def remove_node(pool, engine: str) -> str:
        """The engine's node goes, and the next update starts once Ray knows it: the node dead, the engine's calls
        failing. The harness kills the node's raylet; an engine process it leaves running for a moment could still
        answer a call, and now that its samples travel in the reply (actors/payload.py) that would be an answer."""
        node_id = pool.base_nodes.get(engine) or pool.extra.nodes[engine]
        actor = pool.group.actors[pool.group.names.index(engine)]
        three_plus_nodes.remove_node(next(n for n in three_plus_nodes.worker_nodes if n.node_id == node_id),
                                     allow_graceful=False)
        deadline = time.monotonic() + 120
        while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()) or answers(actor):
            assert time.monotonic() < deadline, f"{engine} or its node still alive 120 s after the node's removal"
            time.sleep(0.2)
        return node_id

    def nodes_come_and_go(pool):
        seen["updates"] += 1
        if seen["updates"] == 1:
            seen["extra_node"] = add_node().node_id
            assert pool.extra.asked[0].wait(120), "the engine's placement group was not granted on the new node"
        if seen["updates"] == 3:
            seen["base_node"] = add_node().node_id
        joined = grow(pool)
        if seen["updates"] == 1:
            assert joined == ["generation-1"], joined
            assert pool.extra.nodes["generation-1"] == seen["extra_node"]  # it went to the node that joined
        if seen["updates"] == 2:
            remove_node(pool, "generation-0")
        if seen["updates"] == 3:
            deadline = time.monotonic() + 120
            while not joined and time.monotonic() < deadline:  # Ray places the vacant bundle on the new node
                time.sleep(0.5)
                joined = grow(pool)
            assert joined == ["generation-2"], joined
            assert pool.base_nodes["generation-2"] == seen["base_node"]
        if seen["updates"] == 4:
            assert remove_node(pool, "generation-1") == seen["extra_node"]
        return joined

    monkeypatch.setattr(GenerationPool, "grow", nodes_come_and_go)
    summary = run_ppo(job)

    steps = step_logs(Path(job.output_dir))
    assert summary["iterations"] == iterations and [m["step"] for m in steps] == list(range(1, iterations + 1))
    assert [m["generate/engines"] for m in steps] == [1, 2, 1, 2, 1]
    assert all(m["actors/learner_restarts"] == 0 and m["actors/restarts"] == 0 for m in steps)
    assert [m["policy_version"] for m in steps] == list(range(1, iterations + 1))
    assert all(m["experience/staleness"] == 0 for m in steps)
    calm = step_logs(Path(calm_job.output_dir))
    assert [m["generate/engines"] for m in calm] == [1] * iterations
    for key in ("reward_after", "task_accuracy_after", "sampled_reward_after"):
        assert summary[key] == pytest.approx(calm_summary[key], abs=1e-4), key
    for got, want in zip(steps, calm):
        assert got["policy/loss"] == pytest.approx(want["policy/loss"], abs=1e-4), got["step"]


def test_lost_nodes_are_survived_and_a_lost_learner_node_resumes_to_the_same_numbers(tmp_path, three_plus_nodes,
                                                                                      sft_model, rm_model,
                                                                                      monkeypatch):
    """After checkpoint 1 the engine's node goes, after 2 the reference's, after 3 the policy's, each replaced by a
    fresh node, on the job's own thread between two updates (its iterations take about a second: a removal from a
    thread watching the checkpoints once landed after the job's end)."""
    from rlhf_ray.jobs.ppo import run_ppo

    address = three_plus_nodes.address
    calm = ppo_job(tmp_path / "calm", sft_model, rm_model, *ONE_ROLE_PER_NODE, *RUN, f"cluster.address={address}")
    calm_summary = run_ppo(calm)

    job = ppo_job(tmp_path / "faults", sft_model, rm_model, *ONE_ROLE_PER_NODE, *RUN, f"cluster.address={address}")
    out, ns = Path(job.output_dir), job.cluster.namespace
    removed = []

    def lose_the_node_of(role: str):
        def now() -> None:
            nodes = {r: node_of(r, ns) for r in ("policy-0", "critic-0", "reference-0", "generation-0")}
            assert len(set(nodes.values())) == 4, f"roles share a node: {nodes}"
            removed.append((role, remove_node_of(three_plus_nodes, role, ns)))
        return now

    at_checkpoints(monkeypatch, *map(lose_the_node_of, ("generation-0", "reference-0", "policy-0")))
    summary = run_ppo(job)
    assert [role for role, _ in removed] == ["generation-0", "reference-0", "policy-0"]

    steps = step_logs(out)
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]  # redone steps logged once
    assert steps[-1]["actors/learner_restarts"] == 1  # the policy's node: every role restarted once, by itself
    assert summary["iterations"] == 5
    for key in ("reward_after", "task_accuracy_after", "sampled_reward_after"):
        assert summary[key] == pytest.approx(calm_summary[key], abs=1e-4), key
    calm_steps = step_logs(Path(calm.output_dir))
    for got, want in zip(steps, calm_steps):
        assert got["policy/loss"] == pytest.approx(want["policy/loss"], abs=1e-4), got["step"]
