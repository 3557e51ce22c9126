"""PPORun.update when the policy's optimizer skipped every step of an update (non-finite gradients; the learners'
side is tested on real DeepSpeed engines in test_learner_engine.py): the policy version stays, no weights are sent.
The learner groups here are stand-ins returning what the real ones return; the buffer is the real class."""

from __future__ import annotations

from types import SimpleNamespace

from rlhf_ray.buffer.replay_buffer import ReplayBuffer
from rlhf_ray.jobs.ppo_run import PPORun


class Group:
    """An ActorGroup stand-in: `call` / `submit` run the method on a local object, `gather` returns the results."""

    def __init__(self, target, role: str = ""):
        self.target, self.role = target, role

    def submit(self, method, *args):
        return [getattr(self.target, method)(*args)]

    def gather(self, refs, what):
        return refs

    def call(self, method, *args):
        return self.submit(method, *args)


class Policy:
    def __init__(self, applied_per_update: list[int]):
        self.applied = iter(applied_per_update)

    def train(self, plan):
        return {"policy/loss": 0.1, "policy/kl": 0.0, "policy/seconds": 0.01, "policy/steps_applied": next(self.applied)}


def test_an_update_whose_policy_steps_were_all_skipped_keeps_the_version_and_sends_nothing():
    run = object.__new__(PPORun)
    buffer = ReplayBuffer(capacity=4, max_staleness=4)
    run.buffer, run.policy, run.critic = Group(buffer), Group(Policy([1, 0, 2]), "policy"), None
    run.job = SimpleNamespace(train_batch_size=4, seed=0, ppo=SimpleNamespace(ppo_epochs=1))
    run.restarts, run.learner_restarts, run.version = SimpleNamespace(replaced=[]), 0, 0
    sent = []

    def sync_weights(bump: bool = True):
        run.version += int(bump)
        sent.append(run.version)
        return {"bytes": 8.0, "gather_seconds": 0.0, "learner_gather_seconds": 0.0, "load_seconds": 0.0,
                "engine_load_seconds": 0.0}

    run.sync_weights = sync_weights
    versions, bytes_sent = [], []
    for rollout in range(3):
        buffer.put([rollout], {"version": run.version, "samples": 4, "rollout": rollout}, run.version)
        _, metrics = run.update()
        versions.append(metrics["policy_version"])
        bytes_sent.append(metrics["sync/bytes"])
    assert versions == [1, 1, 2] and sent == [1, 2]  # the second update changed nothing: no sync, same version
    assert bytes_sent == [8.0, 0.0, 8.0]
