"""Threads per role in sync PPO: roles that take turns share the node's cores by phase, not by reservation."""

from pathlib import Path

from rlhf_ray.config.loader import load_job
from rlhf_ray.jobs.threads import turn_threads, with_turn_threads

ROOT = Path(__file__).resolve().parents[1]


def test_grpo_roles_each_get_both_cores_of_a_two_core_node():
    job = load_job(ROOT / "configs/recipes/smollm2-grpo.yaml")
    assert job.policy.placement.num_cpus == 1  # its share: one thread before
    assert turn_threads(job, 2) == {"policy": 2, "reference": 2, "reward": 2, "generation": 2}
    placed = with_turn_threads(job, 2)
    assert placed.policy.placement.threads == 2 and placed.generation.placement.threads == 2
    assert job.policy.placement.threads is None  # the loaded job is not changed


def test_roles_busy_together_split_the_node():
    job = load_job(ROOT / "configs/quickstart/ppo.yaml")  # reference, RM, critic and old log-probs score together
    threads = turn_threads(job, 8)
    assert threads["reference"] == threads["reward"] == 2  # 4 roles in the experience phase
    assert threads["policy"] == threads["critic"] == 2  # crowded most in the experience phase
    assert threads["generation"] == 8
    assert turn_threads(job, 2)["critic"] == 1  # never below one, never below the share


def test_async_gpu_and_explicit_threads_are_left_alone():
    job = load_job(ROOT / "configs/recipes/smollm2-grpo.yaml", ["ppo.mode=async"])
    assert turn_threads(job, 2) == {}
    job = load_job(ROOT / "configs/recipes/smollm2-grpo.yaml", ["policy.placement.threads=1",
                                                                 "generation.placement.num_gpus=1"])
    assert "policy" not in (threads := turn_threads(job, 2)) and "generation" not in threads
