"""ppo.old_logprobs: engine takes the PPO ratio's old log-probs from the generation engine's samples, so the policy
runs no forward over the rollout (the end-to-end run: test_ppo_job.py's DAPO test)."""

import pytest
import torch

from rlhf_ray.config import ConfigError, load_job
from rlhf_ray.jobs.threads import phases, turn_threads
from tests.conftest import ROOT

RECIPE = ROOT / "configs/recipes/smollm2-grpo.yaml"


def test_with_engine_log_probs_the_policy_scores_nothing_and_the_reference_gets_both_cores():
    several_steps = ["ppo.train_batch_size=16"]  # 4 optimizer steps a rollout: old log-probs needed
    scored = load_job(RECIPE, several_steps)
    assert scored.policy_scores_rollouts and "policy" in phases(scored)["experience"]
    assert turn_threads(scored, 2)["reference"] == 1  # beside the policy's old-log-prob forward
    engine = load_job(RECIPE, [*several_steps, "ppo.old_logprobs=engine"])
    assert not engine.policy_scores_rollouts and not engine.old_logprobs_from_training
    assert phases(engine)["experience"] == ["reference"]
    assert turn_threads(engine, 2)["reference"] == 2  # alone in its phase
    one_step = load_job(RECIPE, ["ppo.old_logprobs=engine"])  # the engine's even where training's would serve
    assert not one_step.old_logprobs_from_training and not one_step.policy_scores_rollouts


def test_truncated_importance_weights_against_the_engine_are_refused():
    with pytest.raises(ConfigError) as info:
        load_job(RECIPE, ["ppo.old_logprobs=engine", "ppo.tis_cap=2"])
    (problem,) = info.value.problems
    assert "tis_cap" in problem and "old_logprobs: engine" in problem and problem.startswith("--set ppo.tis_cap=2")


def assembled(monkeypatch, source: str, learner_logp):
    """ExperienceWorker.experience on a two-answer GRPO group, the object store bypassed (refs are the values)."""
    import ray

    from rlhf_ray.actors.experience_worker import ExperienceWorker, RoleOutputs
    from rlhf_ray.algorithms.experience import pack_rollouts
    from rlhf_ray.config.ppo import PPOSpec

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    spec = PPOSpec(advantage_estimator="grpo", kl_coef=0.0, old_logprobs=source)
    worker = ExperienceWorker(ppo=spec.model_dump(), group_size=2, pad_token_id=0)
    batch = pack_rollouts([[5, 6], [5, 6]], [[7, 8, 9], [7, 3]], 0)
    engine_logp = torch.tensor([[-0.5, -1.0, -2.0], [-0.25, -3.0, 0.0]])
    batch.ended, batch.engine_logp = torch.tensor([True, True]), engine_logp
    batch.version, batch.token_version = torch.zeros(2, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)
    experience, out = worker.experience(batch, RoleOutputs(rewards=[torch.tensor([1.0, 0.0])], old_logp=learner_logp))
    return experience, out.stats.metrics(), engine_logp


def test_the_experience_carries_the_engine_log_probs_as_old_ones(monkeypatch):
    experience, metrics, engine_logp = assembled(monkeypatch, "engine", [])
    torch.testing.assert_close(experience.old_logp, engine_logp * experience.action_mask)
    assert "generate/mismatch_kl" not in metrics  # engine against itself: nothing to report
    learner = engine_logp + 0.1
    experience, metrics, _ = assembled(monkeypatch, "policy", [learner])
    torch.testing.assert_close(experience.old_logp, learner)  # the policy's forward, as before
    assert metrics["generate/logprob_gap"] == pytest.approx(0.1)


def test_kl_and_the_engine_gap_come_from_the_policys_training_forward_only_where_scoring_measured_none():
    """Without old log-probs from the policy (or with the KL in the loss) scoring measures neither; the policy's
    training forward does, and the line reports its values under the same names."""
    from rlhf_ray.actors.experience_worker import ExperienceStats, RolloutStats

    rollout = RolloutStats(0.5, 0.1, 12.0, 0.0, 1.0)
    policy = {"loss": 0.3, "kl": 0.02, "engine_logprob_gap": 0.1, "engine_mismatch_kl": 0.004}
    line = ExperienceStats(rollout, 0.0).measured_in_training(policy).metrics()
    assert (line["kl/mean"], line["generate/logprob_gap"], line["generate/mismatch_kl"]) == (0.02, 0.1, 0.004)
    line = ExperienceStats(rollout, 0.0, kl=0.5, logprob_gap=0.2, mismatch_kl=0.01).measured_in_training(policy).metrics()
    assert (line["kl/mean"], line["generate/logprob_gap"], line["generate/mismatch_kl"]) == (0.5, 0.2, 0.01)
    line = ExperienceStats(rollout, 0.0).measured_in_training(None).metrics()  # the critic's warm-up
    assert not {"kl/mean", "generate/logprob_gap", "generate/mismatch_kl", "loss"} & line.keys()
