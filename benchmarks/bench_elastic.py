"""Elastic generation (issue 83): the quickstart GRPO job (SmolLM2-135M-Instruct, vLLM on CPU) with
`generation.placement: {replicas: 1, max_replicas: 2}` on Ray's multi-node harness: a head with no CPUs for actors,
a 2-CPU node for the policy (with the reference and the reward function), and a 1-CPU node for the first engine.
The second engine's placement group (1 CPU) has no room until, after update JOIN_AFTER, a 1-CPU node joins; after
update LEAVE_AFTER it leaves again. Measured in one run:

- samples per second with one engine and with two, of whole updates and of the generation phase (the rollout's
  wait), medians of the updates that ran with one and with two engines throughout: the first update (warm-up) and
  those whose time holds the join or the leave left out;
- from the node joining to its engine serving (Ray granting the group, the engine starting and loading the current
  weights, the wait for the end of the update in progress);
- from the node leaving to the pool settling (the next rollout finding the engine gone, Ray's verdict on the node,
  the engine's share answered by the other).

The harness's nodes share this machine's cores, so "two engines" means two engine processes on the same 2 cores:
the samples/s ratio says what a second engine gains when cores are free during generation (in sync mode the
learners wait while the engines generate), not what a second machine adds.

Run: python benchmarks/bench_elastic.py [--iterations N] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import ROOT, machine, publish, recipe_args, today, versions  # noqa: E402

SECTION = "## Elastic generation: a node joins, then leaves"
RECIPE = ROOT / "configs/quickstart/grpo.yaml"
JOIN_AFTER, LEAVE_AFTER = 3, 8


def main() -> int:
    args = recipe_args(__doc__, iterations=12)
    import json

    from ray.cluster_utils import Cluster

    from rlhf_ray import cluster as rcluster
    from rlhf_ray.actors.pool import GenerationPool
    from rlhf_ray.config import load_job
    from rlhf_ray.jobs.ppo import run_ppo

    os.environ[rcluster.LOOPBACK_ENV] = "0"  # every node and the driver on 127.0.0.1, as tests/test_multinode.py
    out = Path(tempfile.mkdtemp(prefix="bench-elastic-")) / "ppo"
    marks: dict[str, float] = {}
    grow, drop, updates = GenerationPool.grow, GenerationPool._drop, [0]

    def paced_grow(pool):
        updates[0] += 1
        if updates[0] == JOIN_AFTER:
            with rcluster._loopback_mode():
                marks["node"] = harness.add_node(num_cpus=1)
            marks["joined"] = time.time()
            if not pool.extra.asked[0].wait(300):
                raise TimeoutError("the second engine's placement group was not granted within 300 s")
            marks["granted"] = time.time()
        joined = grow(pool)
        if joined:
            marks["serving"] = time.time()  # loaded with the current weights; the next rollout is its first
        if updates[0] == LEAVE_AFTER:
            harness.remove_node(marks["node"], allow_graceful=False)
            marks["left"] = time.time()
        return joined

    def timed_drop(pool, name):
        marks["dropped"] = time.time()
        return drop(pool, name)

    GenerationPool.grow, GenerationPool._drop = paced_grow, timed_drop
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the pool's joins and drops
    with rcluster._loopback_mode():
        harness = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False,
            "_system_config": {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                               "health_check_failure_threshold": 3}})
        harness.add_node(num_cpus=2)  # policy 1 + reference 0.25 + reward 0.25
        harness.add_node(num_cpus=1)  # the first engine
        harness.wait_for_nodes()
    try:
        job = load_job(RECIPE, [f"output_dir={out}", f"ppo.iterations={args.iterations}", "ppo.eval_prompts=0",
                                "checkpoint.every_steps=0", "logging.progress=false", "logging.tensorboard=false",
                                "cluster.dashboard=false", f"cluster.address={harness.address}",
                                "generation.placement.num_cpus=1", "generation.placement.max_replicas=2"])
        run_ppo(job)
    finally:
        harness.shutdown()
    rows = [m for m in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
            if "policy_version" in m]
    events = {1, JOIN_AFTER, LEAVE_AFTER, LEAVE_AFTER + 1}  # warm-up; the join and the leave (in `grow`); the drop
    served = {n: [m for m in rows if m["generate/engines"] == n and m["step"] not in events] for n in (1, 2)}

    def median_rate(n: int, key: str) -> float:
        return statistics.median(job.samples_per_iteration / m[key] for m in served[n])

    whole = {n: median_rate(n, "time/iteration") for n in (1, 2)}
    generation = {n: median_rate(n, "time/generate_wait") for n in (1, 2)}
    steps = {n: ", ".join(str(m["step"]) for m in served[n]) for n in (1, 2)}
    settled = next(m["time"] for m in rows if m["step"] == LEAVE_AFTER + 1)
    engines = ", ".join(f"{m['step']}: {m['generate/engines']:g}" for m in rows)
    text = f"""{SECTION}

Measured {today()} on {machine()} by `python benchmarks/bench_elastic.py --iterations {args.iterations}`;
{versions("torch", "ray", "vllm")}.

The quickstart GRPO job (SmolLM2-135M-Instruct, vLLM on CPU, 32 samples per update) with
`generation.placement: {{replicas: 1, max_replicas: 2, num_cpus: 1}}` on Ray's multi-node harness: a 2-CPU node
for the policy, reference and reward function, a 1-CPU node for the first engine; after update {JOIN_AFTER} a
1-CPU node joins, after update {LEAVE_AFTER} it leaves. The nodes share this machine's 2 cores (see the script's
docstring for what the ratio does and does not say). In sync mode the learners wait while the engines generate, so
the second engine shortens only the generation phase; the update's scoring, training and weight sync (now to two
engines) stay.

| | one engine (updates {steps[1]}) | two engines (updates {steps[2]}) | two / one |
|---|---:|---:|---:|
| samples/s, whole update | {whole[1]:.2f} | {whole[2]:.2f} | {whole[2] / whole[1]:.2f} |
| samples/s, generation phase (the rollout's wait) | {generation[1]:.1f} | {generation[2]:.1f} | {generation[2] / generation[1]:.2f} |

| event | time |
|---|---:|
| node joined -> its placement group granted | {marks['granted'] - marks['joined']:.1f} s |
| granted -> the engine started and loaded with the current weights | {marks['serving'] - marks['granted']:.1f} s |
| node left -> the pool dropped its engine (next rollout, Ray's verdict) | {marks['dropped'] - marks['left']:.1f} s |
| node left -> the next update, its rollout answered by one engine, done (settled) | {settled - marks['left']:.1f} s |

Engines per update (`generate/engines`): {engines}.
"""
    return publish(text, args.write, SECTION)


if __name__ == "__main__":
    raise SystemExit(main())
