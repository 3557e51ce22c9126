"""The replay buffer: references in, a staleness bound, mini-batch plans out. Unit tests on the class, and one
on the real Ray actor holding a real object reference."""

from __future__ import annotations

import pytest
import ray
import torch

from rlhf_ray.buffer.replay_buffer import ReplayBuffer, minibatch_rows


def meta(version: int, rollout_index: int = 0, samples: int = 8) -> dict:
    return {"version": version, "samples": samples, "rollout_index": rollout_index}


def test_stale_experience_is_refused_on_the_way_in_and_out():
    buffer = ReplayBuffer(capacity=4, max_staleness=1)
    assert buffer.put(["a"], meta(version=0), learner_version=0)
    assert buffer.put(["b"], meta(version=1), learner_version=1)
    assert not buffer.put(["c"], meta(version=0), learner_version=2)  # 2 versions behind: refused at once
    plan = buffer.take(learner_version=2, train_batch_size=4, epochs=1, seed=0)
    assert plan.refs == ["b"] and plan.staleness == 1  # "a" (version 0) was dropped on the way out
    stats = buffer.stats()
    assert stats["buffer/refused_stale"] == 2 and stats["buffer/taken"] == 1 and stats["buffer/entries"] == 0
    assert buffer.take(learner_version=2, train_batch_size=4, epochs=1, seed=0) is None  # empty: put more


def test_zero_staleness_takes_only_current_experience():
    buffer = ReplayBuffer(capacity=4, max_staleness=0)
    buffer.put(["old"], meta(version=3), learner_version=3)
    assert buffer.take(learner_version=4, train_batch_size=8, epochs=1, seed=0) is None
    assert buffer.stats()["buffer/refused_stale"] == 1


def test_full_buffer_drops_its_oldest_entry():
    buffer = ReplayBuffer(capacity=2, max_staleness=10)
    for i in range(3):
        buffer.put([f"e{i}"], meta(version=i, rollout_index=i), learner_version=i)
    assert buffer.stats()["buffer/evicted"] == 1
    assert [m["rollout_index"] for m in buffer.metas()] == [1, 2]
    assert buffer.take(2, 8, 1, 0).refs == ["e1"]  # first in, first out


def test_plan_covers_every_row_once_per_epoch_in_minibatches():
    plan = minibatch_rows(12, 4, epochs=2, seed=7)
    assert [len(b) for b in plan] == [4] * 6
    for epoch in (plan[:3], plan[3:]):
        assert sorted(i for b in epoch for i in b) == list(range(12))
    assert plan[:3] != plan[3:]  # a fresh order each epoch
    assert minibatch_rows(12, 4, 2, seed=7) == plan and minibatch_rows(12, 4, 2, seed=8) != plan



def test_answers_to_one_prompt_stay_in_one_minibatch():
    """GRPO's groups (4 consecutive answers to a prompt here) are shuffled whole, so the learners' shared-prompt
    forward runs each prompt once per mini-batch; every row still comes once per epoch, in a fresh order."""
    plan = minibatch_rows(16, 8, epochs=2, seed=3, group_size=4)
    for epoch in (plan[:2], plan[2:]):
        assert sorted(i for b in epoch for i in b) == list(range(16))
        for minibatch in epoch:  # two whole groups
            groups = {i // 4 for i in minibatch}
            assert len(groups) == 2 and set(minibatch) == {g * 4 + k for g in groups for k in range(4)}
    assert plan[:2] != plan[2:]
    # groups that do not tile a mini-batch (or the rows): rows are permuted one by one, as without groups
    assert minibatch_rows(16, 6, 1, seed=3, group_size=4) == minibatch_rows(16, 6, 1, seed=3)
    assert minibatch_rows(18, 8, 1, seed=3, group_size=4) == minibatch_rows(18, 8, 1, seed=3)


def test_a_take_plans_whole_groups():
    buffer = ReplayBuffer(capacity=2, max_staleness=1)
    buffer.put(["e"], meta(version=0, samples=16), learner_version=0)
    plan = buffer.take(0, 8, 1, 0, group_size=8)
    assert sorted(sorted(b) for b in plan.rows) == [list(range(8)), list(range(8, 16))]


@pytest.mark.system
def test_buffer_actor_hands_out_references_not_payloads():
    from rlhf_ray import cluster
    from rlhf_ray.actors.group import ActorGroup, Slots
    from rlhf_ray.config.placement import ClusterSpec

    with cluster.connect(ClusterSpec(num_cpus=1, dashboard=False)):
        group = ActorGroup(ReplayBuffer, "replay-buffer", 1, Slots(0),
                           kwargs={"capacity": 2, "max_staleness": 1}).wait_ready(60)
        payload = {"x": torch.arange(6)}
        ref = ray.put(payload)
        assert [bool(put) for put in group.call("put", [ref], meta(version=5, samples=6), 5)] == [True]
        (plan,) = group.call("take", 6, 3, 1, 0)
        assert isinstance(plan.refs[0], ray.ObjectRef) and plan.staleness == 1
        assert torch.equal(ray.get(plan.refs[0])["x"], payload["x"])
        assert [bool(put) for put in group.call("put", [ref], meta(version=4), 6)] == [False]  # 2 behind the learner
        assert group.call("stats")[0]["buffer/refused_stale"] == 1
