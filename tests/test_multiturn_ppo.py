"""Multi-turn GRPO end to end on a real local Ray: every sample is an episode with an environment (a wrong sort
gets "That is not right. Try again." and another turn), the engines continue from the exact ids, the reward is the
environment's, the policy trains on its own turns only."""

from __future__ import annotations

import json
import math

import pytest

from rlhf_ray.config import load_job
from rlhf_ray.jobs.ppo import run_ppo
from tests.conftest import ROOT

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("shared_ray")]  # one embedded Ray for the module


@pytest.mark.parametrize("engine,mode", [("hf", "async"), ("vllm", "sync")])
def test_multiturn_grpo_plays_episodes_and_trains_on_them(tmp_path, sft_model, engine, mode):
    job = load_job(ROOT / "configs/quickstart/ppo.yaml", [
        f"policy.model.path={sft_model}", f"output_dir={tmp_path}", "cluster.dashboard=false",
        "logging.progress=false", "critic=null", "reward.model.path=null",
        "reward.function=rlhf_ray.envs.episode:episode_reward", "reward.placement.colocate_with=policy",
        "ppo.advantage_estimator=grpo", "ppo.kl_in_loss=true", "ppo.kl_estimator=k3", f"ppo.mode={mode}",
        "generation.sampling.n_samples_per_prompt=4", "ppo.rollout_batch_size=4", "ppo.iterations=2",
        "ppo.eval_prompts=4", f"generation.engine={engine}", "generation.vllm.dtype=fp32",
        "generation.sampling.max_new_tokens=24", "policy.micro_batch_size=16",
        "generation.environment={path: rlhf_ray.envs.retry:RetryEnv, options: {rule: rlhf_ray.data.demo_sort:score},"
        " max_turns: 3, max_episode_tokens: 160, observation_role: user}"])
    summary = run_ppo(job)
    assert summary["iterations"] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rows if "env/turns_per_episode" in r]
    assert len(rollouts) == 2
    for r in rollouts:
        assert 1.0 <= r["env/turns_per_episode"] <= 3.0 and 0.0 <= r["env/episode_reward"] <= 1.0, r
        assert r["env/tool_calls_per_episode"] == 0.0 and math.isnan(r["env/tool_call_validity"])
        assert math.isfinite(r["policy/loss"]) and r["policy/steps_applied"] >= 1
    assert max(r["env/turns_per_episode"] for r in rollouts) > 1.0  # some sorts were wrong and tried again
    # evaluation plays episodes too: the greedy reward is the environment's, a share of solved episodes
    assert 0.0 <= summary["reward_before"] <= 1.0 and 0.0 <= summary["reward_after"] <= 1.0
    assert 1.0 <= summary["turns_per_episode_before"] <= 3.0 and summary["tool_calls_per_episode_after"] == 0.0
