"""The PPO loop's producer side (RolloutFeed) against the real replay buffer: when rollouts start, when their
experience is put, what each update trains on. The engines are a stand-in (tests/ppo_standins.py) that finishes
rollouts in the order they were queued, with the weights the engines had when each was queued."""

from __future__ import annotations

from tests.ppo_standins import Workers, feed, take


def run_loop(run: Workers, ahead: int, updates: int) -> list[dict]:
    """The feed as PPOTrainer.iterate uses it: a take per update, then the update (the policy version + 1)."""
    rollouts = feed(run, ahead)
    lines = []
    for iteration in range(updates):
        taken = take(rollouts, run, updates - iteration)
        # the metrics logged are those of the experience trained on
        assert taken.put.scored.experience.stats.metrics()["reward/mean"] == taken.minibatches.meta.rollout_index
        run.train_on(taken)
        lines.append(taken.minibatches.stats)
    return lines


def test_sync_mode_samples_each_rollout_after_the_update_before_it():
    run = Workers(capacity=4, max_staleness=0)
    run_loop(run, ahead=0, updates=3)
    assert run.events == ["start 0", "put 0", "train 0", "start 1", "put 1", "train 1", "start 2", "put 2", "train 2"]
    assert run.trained == [(0, 0), (1, 0), (2, 0)]


def test_one_rollout_ahead_generates_the_next_while_one_is_scored_and_trained():
    run = Workers(capacity=4, max_staleness=1)
    run_loop(run, ahead=1, updates=3)
    assert run.events == ["start 0", "start 1", "put 0", "train 0", "start 2", "put 1", "train 1", "put 2", "train 2"]
    assert run.trained == [(0, 0), (1, 1), (2, 1)]  # no rollout is started that no update would train on


def test_generation_far_ahead_fills_a_small_buffer_which_evicts_its_oldest():
    run = Workers(capacity=2, max_staleness=1, finish_at_once=True)
    lines = run_loop(run, ahead=3, updates=6)
    # four rollouts start with the first weights and finish before the first update: the buffer keeps the last two
    assert run.events[:9] == ["start 0", "start 1", "start 2", "start 3", "put 0", "put 1", "put 2", "put 3",
                              "train 2"]
    assert lines[0]["buffer/evicted"] == 2 and lines[-1]["buffer/evicted"] == 2
    assert run.trained == [(2, 0), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1)]
    assert max(int(e.split()[1]) for e in run.events if e.startswith("start")) == 7  # rollout r after update r - 3


def test_experience_waiting_past_the_staleness_bound_is_refused():
    run = Workers(capacity=3, max_staleness=1, finish_at_once=True)
    lines = run_loop(run, ahead=3, updates=6)
    # rollouts 2 and 3 (first weights) wait behind 0 and 1 until the policy is two versions on: refused
    assert [line["buffer/refused_stale"] for line in lines[:3]] == [0, 0, 2]
    assert run.trained == [(0, 0), (1, 1), (4, 1), (5, 1), (6, 1), (7, 1)]
    assert all(line["buffer/entries"] <= 3 for line in lines)


def test_when_the_buffer_refuses_all_it_holds_a_rollout_starts_for_the_update():
    run = Workers(capacity=3, max_staleness=1, finish_at_once=True)
    rollouts = feed(run, ahead=3)
    run.train_on(take(rollouts, run, 4))  # rollouts 0-3 started; 0 trained, 1-3 wait in the buffer
    run.version = 5  # as if the learner had moved on: every entry is too stale
    taken = take(rollouts, run, 3)
    assert run.events[-2:] == ["start 4", "put 4"] and taken.minibatches.meta.rollout_index == 4


def test_a_resume_regenerates_from_the_oldest_rollout_whose_answers_were_still_generating():
    """Partial rollouts return the first prompts to finish, another rollout's too: rollout 0 comes back with
    rollout 1's prompt while its own is still generating. A checkpoint then resumes at rollout 0, not 1, so the
    unfinished answer is generated again; once rollout 0's prompt comes back (with rollout 1), at rollout 2."""
    from tests.ppo_standins import FakeRollout

    run = Workers(capacity=4, max_staleness=1)
    swapped = {0: [(1, 1)], 1: [(0, 0)]}  # each rollout brings back the other's prompt
    run.pool.submit = lambda index: (run.events.append(f"start {index}")
                                     or FakeRollout(index, run.version, prompt_keys=swapped.get(index, [(index, index)])))
    rollouts = feed(run, ahead=1)
    run.train_on(take(rollouts, run, 3))
    assert rollouts.last_taken == 0 and rollouts.next_after_taken == 0  # rollout 0's own prompt is in flight
    run.train_on(take(rollouts, run, 2))
    assert rollouts.next_after_taken == 2


def test_a_jobs_feed_trains_on_mini_batches_of_whole_answer_groups():
    """The quickstart GRPO job's feed (8 prompts x 4 answers) with ppo.train_batch_size 8: each update walks 4
    mini-batches of 2 whole groups, so every prompt's forward is shared by its answers in training too."""
    from rlhf_ray.config import load_job
    from rlhf_ray.jobs.ppo.rollouts import RolloutFeed
    from tests.conftest import ROOT
    from tests.ppo_standins import FakeRollout, Prompts

    job = load_job(ROOT / "configs/quickstart/grpo.yaml", ["ppo.train_batch_size=8"])
    run = Workers(capacity=4, max_staleness=0)
    run.pool.submit = lambda index: FakeRollout(index, run.version, samples=32, prompt_keys=[(index, index)])
    rollouts = RolloutFeed.for_job(job, run, prompts=[])
    rollouts.prompts = Prompts()  # the stand-in pool is asked by rollout index
    plan = take(rollouts, run, 1).minibatches.rows
    assert len(plan) == 4
    for minibatch in plan:
        groups = {row // 4 for row in minibatch}
        assert len(groups) == 2 and set(minibatch) == {g * 4 + k for g in groups for k in range(4)}
    assert sorted(row for minibatch in plan for row in minibatch) == list(range(32))


def test_a_put_the_buffer_refuses_as_too_stale_is_not_kept_and_the_count_is_the_buffers():
    """A rollout sampled by weights two versions back, put once the learner is there: the buffer refuses it, the feed
    keeps nothing of it, and the count it goes by is the buffer's answer (before, a refused put counted as kept)."""
    from tests.ppo_standins import FakeRollout

    run = Workers(capacity=4, max_staleness=1)
    rollouts = feed(run, ahead=1)
    (index, rollout), = [next(rollouts.generated(updates_left=1))]
    assert rollout.version == 0 and rollouts.collected_at
    rollouts.put(index, rollout, run.advantages(run.score(rollout), 2), version=2)
    assert rollouts.held == 0 and rollouts.puts == {} and rollouts.collected_at == {}
    fresh = FakeRollout(1, version=2)
    rollouts.put(1, fresh, run.advantages(run.score(fresh), 2), version=2)
    assert rollouts.held == 1 and list(rollouts.puts) == [1]
