"""Updates that leave the policy's weights as they were: one whose policy optimizer skipped every step (non-finite
gradients; the learners' side is tested on real DeepSpeed engines in test_learner_engine.py), and the critic's
warm-up: PPOTrainer.iterate keeps the policy version and sends no weights. The
actors are stand-ins (tests/ppo_standins.py) returning what the real ones return; the buffer, the rollout feed, the
weight sync and the metrics line are the real ones."""

from __future__ import annotations

from types import SimpleNamespace

from rlhf_ray.jobs.ppo.trainer import PPOTrainer
from rlhf_ray.jobs.ppo.weight_sync import WeightSync
from rlhf_ray.learners.policy import SentWeights
from rlhf_ray.jobs.ppo.workers import Trained
from rlhf_ray.learners.ppo_base import TrainReport
from tests.ppo_standins import Group, Workers, feed


class Policy:
    def publish_weights(self, bucket_bytes: int, adapters_only: bool) -> SentWeights:
        return SentWeights(8, 0.0)


def report(role: str, steps_applied: int = 1) -> TrainReport:
    """A learner's answer to `train` with these steps applied."""
    return TrainReport(role, {"loss": 0.1} | ({"kl": 0.0} if role == "policy" else {}), seconds=0.01,
                       steps_applied=steps_applied, padding_fraction=0.0)


def trainer_with(workers: Workers, train, critic_warmup: int = 0) -> PPOTrainer:
    workers.policy = Group(Policy(), "policy")
    workers.train = train
    weights = object.__new__(WeightSync)
    weights.workers, weights.version, weights.transport = workers, 0, "object_store"
    weights.bucket_bytes, weights.adapters_only = 2**20, False
    trainer = object.__new__(PPOTrainer)
    trainer.job = SimpleNamespace(ppo=SimpleNamespace(critic_warmup=critic_warmup))
    trainer.workers, trainer.weights, trainer.rollouts = workers, weights, feed(workers, ahead=0)
    trainer.end, trainer.learner_restarts = 3, 0
    return trainer


def test_an_update_whose_policy_steps_were_all_skipped_keeps_the_version_and_sends_nothing(caplog):
    workers = Workers(capacity=4, max_staleness=4)
    applied = iter([1, 0, 2])
    trainer = trainer_with(workers, lambda minibatches, policy: Trained(
        report("policy", steps_applied=next(applied)), None, seconds=0.01, wall=0.01))
    versions, bytes_sent = [], []
    for step in range(3):
        _, metrics = trainer.iterate(step)
        versions.append(metrics["policy_version"])
        bytes_sent.append(metrics["sync/bytes"])
    assert versions == [1, 1, 2] and workers.pool.loaded == [1, 2]  # the second update changed nothing: no sync
    assert bytes_sent == [8.0, 0.0, 8.0]
    assert "every policy optimizer step was skipped" in caplog.text


def test_the_critics_warm_up_trains_the_critic_alone_and_sends_no_weights(caplog):
    """`ppo.critic_warmup: 2`: iterations 1 and 2 call the learners with the policy left out; the policy stays at
    version 0 with nothing sent (and no warning of skipped steps); iteration 3 trains both and syncs."""
    workers = Workers(capacity=4, max_staleness=4)
    asked = []

    def train(minibatches, policy):
        asked.append(policy)
        return Trained(report("policy", steps_applied=1) if policy else None, report("critic"), seconds=0.01,
                       wall=0.01)

    trainer = trainer_with(workers, train, critic_warmup=2)
    lines = [trainer.iterate(step)[1] for step in range(3)]
    assert asked == [False, False, True]
    assert [m["policy_version"] for m in lines] == [0, 0, 1] and workers.pool.loaded == [1]
    assert ["policy/loss" in m for m in lines] == [False, False, True] and all("critic/loss" in m for m in lines)
    assert "skipped" not in caplog.text
