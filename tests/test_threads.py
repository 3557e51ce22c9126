"""Threads per role in sync PPO: roles that take turns share the node's cores by phase, not by reservation."""

from pathlib import Path
from types import SimpleNamespace

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
    assert threads["policy"] == threads["critic"] == 4  # 2 roles train together: 4 threads each
    assert threads["generation"] == 8
    assert with_turn_threads(job, 8).scoring_threads == {"policy": 2, "critic": 2}  # scoring beside 2 other roles
    assert turn_threads(job, 2)["critic"] == 1  # never below one, never below the share
    assert with_turn_threads(job, 2).scoring_threads == {}  # 1 thread in both phases: nothing to change


def test_a_policy_that_scores_beside_the_reference_still_trains_on_every_core():
    """GRPO with several optimizer steps per rollout needs old log-probs: the policy scores in the experience phase
    beside the reference (one core each on two), then trains alone. Before, it kept one thread for both phases
    (the crowd of its most crowded phase), so it trained on one core of two."""
    job = load_job(ROOT / "configs/recipes/smollm2-grpo.yaml", ["ppo.train_batch_size=16"])
    assert not job.old_logprobs_from_training
    assert turn_threads(job, 2) == {"policy": 2, "reference": 1, "reward": 2, "generation": 2}
    placed = with_turn_threads(job, 2)
    assert placed.policy.placement.threads == 2 and placed.scoring_threads == {"policy": 1}
    assert job.scoring_threads == {}  # the loaded job is not changed
    assert with_turn_threads(load_job(ROOT / "configs/recipes/smollm2-grpo.yaml"), 2).scoring_threads == {}


def test_a_learner_scores_on_its_scoring_threads_and_keeps_its_own_for_training(monkeypatch):
    import torch

    from rlhf_ray.algorithms.batch import RolloutBatch
    from rlhf_ray.algorithms.losses import PolicyLoss
    from rlhf_ray.learners.policy import PolicyLearner

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the learner's process threads, as its actor is started with
    try:
        learner = PolicyLearner(rank=0, world_size=1, model={"path": "unused"}, optim={}, deepspeed={},
                                micro_batch_size=2, seed=0, temperature=1.0, pad_token_id=0,
                                loss=PolicyLoss(), train_batch_size=4, scoring_threads=1)
        learner.deepspeed = SimpleNamespace(eval=lambda: None, device=torch.device("cpu"))  # no model needed here
        batch = RolloutBatch(sequences=torch.ones(4, 5, dtype=torch.long), attention_mask=torch.ones(4, 5),
                             action_mask=torch.ones(4, 3), prompt_width=2)
        seen = []

        def forward(micro):
            seen.append(torch.get_num_threads())
            return torch.zeros(len(micro), micro.answer_width)

        assert learner.over_my_rows(batch, forward).shape == (4, 3)
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_async_gpu_and_explicit_threads_are_left_alone():
    job = load_job(ROOT / "configs/recipes/smollm2-grpo.yaml", ["ppo.mode=async"])
    assert turn_threads(job, 2) == {}
    job = load_job(ROOT / "configs/recipes/smollm2-grpo.yaml", ["policy.placement.threads=1",
                                                                 "generation.placement.num_gpus=1"])
    assert "policy" not in (threads := turn_threads(job, 2)) and "generation" not in threads
