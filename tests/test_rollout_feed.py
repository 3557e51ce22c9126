"""The PPO loop's producer side (RolloutFeed) against the real replay buffer: when rollouts start, when their
experience is put, what each update trains on. The engines are a stand-in that finishes rollouts in the order they
were queued, with the weights the engines had when each was queued (as an engine actor does: a weight update waits
behind the rollouts queued before it)."""

from __future__ import annotations

from types import SimpleNamespace

from rlhf_ray.buffer.replay_buffer import ReplayBuffer
from rlhf_ray.jobs.rollout_feed import RolloutFeed


class Engines:
    def __init__(self, run, finish_at_once: bool):
        self.run, self.finish_at_once, self.events = run, finish_at_once, run.events

    def submit(self, index: int) -> dict:
        self.events.append(f"start {index}")
        return {"index": index, "version": self.run.version}

    def finished(self, pending: dict) -> bool:
        return self.finish_at_once

    def collect(self, pending: dict) -> dict:
        return {"version": pending["version"]}


class Run:
    """PPORun's two halves: put_experience (score + put) and update (take + train + sync: version + 1)."""

    def __init__(self, capacity: int, max_staleness: int, finish_at_once: bool = False):
        self.events, self.version, self.trained = [], 0, []
        self.buffer = ReplayBuffer(capacity=capacity, max_staleness=max_staleness)
        self.pool = Engines(self, finish_at_once)
        self.job = SimpleNamespace(ppo=SimpleNamespace(buffer_capacity=capacity))

    def put_experience(self, index, rollout, prompt_indices):
        self.events.append(f"put {index}")
        accepted = self.buffer.put([index], {"version": rollout["version"], "samples": 4, "rollout": index},
                                   self.version)
        return {"accepted": accepted, "rollout": index}

    def update(self):
        plan = self.buffer.take(self.version, 4, 1, 0)
        if plan is None:
            return None, {}
        self.events.append(f"train {plan.meta.rollout}")
        self.trained.append((plan.meta.rollout, plan.staleness))
        self.version += 1
        return plan, plan.stats


def run_loop(run: Run, ahead: int, updates: int) -> list[dict]:
    """The loop of jobs/ppo.py's _train, without the logging."""
    feed = RolloutFeed(run, lambda i: [i], run.pool.submit, ahead, first=0, redo_limit=0)
    lines = []
    for iteration in range(updates):
        plan = None
        while plan is None:
            feed.fill(updates - iteration)
            plan, trained = run.update()
            scored = feed.taken(plan.meta.rollout if plan else None, plan.stats["buffer/entries"] if plan else 0)
        assert scored["rollout"] == plan.meta.rollout  # the metrics logged are those of the experience trained on
        lines.append(trained)
    return lines


def test_sync_mode_samples_each_rollout_after_the_update_before_it():
    run = Run(capacity=4, max_staleness=0)
    run_loop(run, ahead=0, updates=3)
    assert run.events == ["start 0", "put 0", "train 0", "start 1", "put 1", "train 1", "start 2", "put 2", "train 2"]
    assert run.trained == [(0, 0), (1, 0), (2, 0)]


def test_one_rollout_ahead_generates_the_next_while_one_is_scored_and_trained():
    run = Run(capacity=4, max_staleness=1)
    run_loop(run, ahead=1, updates=3)
    assert run.events == ["start 0", "start 1", "put 0", "train 0", "start 2", "put 1", "train 1", "put 2", "train 2"]
    assert run.trained == [(0, 0), (1, 1), (2, 1)]  # no rollout is started that no update would train on


def test_generation_far_ahead_fills_a_small_buffer_which_evicts_its_oldest():
    run = Run(capacity=2, max_staleness=1, finish_at_once=True)
    lines = run_loop(run, ahead=3, updates=6)
    # four rollouts start with the first weights and finish before the first update: the buffer keeps the last two
    assert run.events[:9] == ["start 0", "start 1", "start 2", "start 3", "put 0", "put 1", "put 2", "put 3",
                              "train 2"]
    assert lines[0]["buffer/evicted"] == 2 and lines[-1]["buffer/evicted"] == 2
    assert run.trained == [(2, 0), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1)]
    assert max(int(e.split()[1]) for e in run.events if e.startswith("start")) == 7  # rollout r after update r - 3


def test_experience_waiting_past_the_staleness_bound_is_refused():
    run = Run(capacity=3, max_staleness=1, finish_at_once=True)
    lines = run_loop(run, ahead=3, updates=6)
    # rollouts 2 and 3 (first weights) wait behind 0 and 1 until the policy is two versions on: refused
    assert [line["buffer/refused_stale"] for line in lines[:3]] == [0, 0, 2]
    assert run.trained == [(0, 0), (1, 1), (4, 1), (5, 1), (6, 1), (7, 1)]
    assert all(line["buffer/entries"] <= 3 for line in lines)


def test_when_the_buffer_refuses_all_it_holds_a_rollout_starts_for_the_update():
    run = Run(capacity=3, max_staleness=1, finish_at_once=True)
    feed = RolloutFeed(run, lambda i: [i], run.pool.submit, 3, first=0, redo_limit=0)
    feed.fill(4)
    run.version = 5  # as if the learner had moved on: every entry is too stale
    plan, _ = run.update()
    assert plan is None and feed.taken(None, 0) == {}
    feed.fill(4)
    assert run.events[-2:] == ["start 4", "put 4"] and run.update()[0].meta.rollout == 4
