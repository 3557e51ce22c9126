"""Stand-ins for the PPO trainer's actors, for unit tests of its parts without Ray: an engine pool that finishes
rollouts in the order they were queued, with the weights the engines had when each was queued (as an engine actor
does: a weight update waits behind the rollouts queued before it), scoring that records what it scored, and the real
ReplayBuffer behind an ActorGroup stand-in. Every step is recorded in `events` ("start 3", "put 3", "train 3"; "put":
scored to be put). `take` runs the producer half of PPOTrainer.iterate on them."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from rlhf_ray.actors.pool import EnginesLoaded
from rlhf_ray.buffer.replay_buffer import ReplayBuffer
from rlhf_ray.jobs.ppo.rollouts import FeedSettings, RolloutFeed, Taken
from rlhf_ray.actors.experience_worker import Assembled, ExperienceStats, RolloutStats
from rlhf_ray.jobs.ppo.scoring import ResultsLost, Scored


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


@dataclass
class FakeRollout:
    index: int
    version: int
    samples: int = 4
    tokens: int = 16
    engine_seconds: float = 0.1
    engine_busy_seconds: float = 0.1
    episodes: dict = field(default_factory=dict)
    prompt_keys: list = field(default_factory=list)
    streamed_groups: int = 0
    restarted_answers: int = 0
    engines: int = 1


class Prompts:
    """A PromptSchedule stand-in: rollout r asks prompt r."""

    def indices(self, index: int) -> list[int]:
        return [index]

    def submit(self, pool, index: int):
        return pool.submit(index)


class Pool:
    def __init__(self, workers, finish_at_once: bool):
        self.workers, self.finish_at_once = workers, finish_at_once
        self.group, self.loaded = [None], []  # one engine; the versions it loaded

    def broadcast(self, refs: list, version: int) -> EnginesLoaded:
        self.loaded.append(version)
        return EnginesLoaded(0.0, 0.0)

    def submit(self, index: int) -> FakeRollout:
        self.workers.events.append(f"start {index}")
        return FakeRollout(index, self.workers.version, prompt_keys=[(index, index)])

    def finished(self, pending) -> bool:
        return self.finish_at_once

    def collect(self, pending: FakeRollout) -> FakeRollout:
        return pending

    def sleep(self) -> None:
        pass

    def grow(self) -> list[str]:
        return []  # a fixed pool


class Workers:
    """RoleWorkers' pool, buffer and scoring; `version` is the learner's policy version (what train() bumps)."""

    def __init__(self, capacity: int, max_staleness: int, finish_at_once: bool = False):
        self.events, self.version, self.trained = [], 0, []
        self.buffer = Group(ReplayBuffer(capacity=capacity, max_staleness=max_staleness))
        self.pool = Pool(self, finish_at_once)
        self.restarts = SimpleNamespace(replaced=[])
        self.scorer = self  # RoleWorkers' scorer: `score` below

    def score(self, rollout: FakeRollout) -> FakeRollout:
        self.events.append(f"put {rollout.index}")
        return rollout

    def advantages(self, scores: FakeRollout, scored_at: int) -> Scored:
        experience = Assembled(ref=scores.index, rows=scores.samples, samples=[], token_versions={},
                               stats=experience_stats(reward_mean=float(scores.index)))  # which rollout, in metrics
        return Scored(experience, role_seconds={"reward": 0.0})

    def train_on(self, taken: Taken) -> None:
        self.events.append(f"train {taken.minibatches.meta.rollout_index}")
        self.trained.append((taken.minibatches.meta.rollout_index, taken.minibatches.staleness))
        self.version += 1


def feed(workers: Workers, ahead: int, redo_limit: int = 0) -> RolloutFeed:
    return RolloutFeed(workers, Prompts(), FeedSettings(ahead=ahead, redo_limit=redo_limit,
                                                        capacity=workers.buffer.target.capacity, train_batch_size=4,
                                                        epochs=1, seed=0))


def take(rollouts: RolloutFeed, workers: Workers, updates_left: int) -> Taken:
    """The producer half of PPOTrainer.iterate, on stand-ins: score and put what the feed generates, then take;
    again while the buffer refused everything it held."""
    version, taken = workers.version, None
    while taken is None:
        for index, rollout in rollouts.generated(updates_left):
            try:
                experience = workers.scorer.advantages(workers.scorer.score(rollout), version)
            except ResultsLost as lost:
                rollouts.redo(index, lost)
                continue
            rollouts.put(index, rollout, experience, version)
        taken = rollouts.take(version)
    return taken


def experience_stats(reward_mean: float) -> ExperienceStats:
    """An experience's statistics with this mean reward (the rest zero)."""
    return ExperienceStats(RolloutStats(reward_mean, 0.0, 0.0, 0.0, 1.0), multi_version_answers=0.0)
