"""The producer side of the PPO loop: which rollouts generate when, and the replay buffer they go into. Rollouts go
to the generation pool up to `ppo.rollouts_ahead` ahead of the update in async mode, one at a time in sync mode; the
loop (PPOTrainer.iterate) scores each one the feed hands it, puts its experience back here, and takes from the buffer
one entry per update. How many entries the buffer holds is what the buffer says after each put and take."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from rlhf_ray.actors.pool import GenerationPool, Rollout
from rlhf_ray.buffer.replay_buffer import Minibatches
from rlhf_ray.config.ppo_job import PPOJob
from rlhf_ray.data.split import stable_seed
from rlhf_ray.jobs.ppo.scoring import ResultsLost, Scored
from rlhf_ray.learners.schedule import micro_batches

log = logging.getLogger(__name__)


class PromptSchedule:
    """Which training prompts rollout r answers, with which sampling seed: pure functions of r and the job's seed,
    so a resumed run asks the same prompts."""

    def __init__(self, rows: list[dict], per_rollout: int, seed: int):
        self.rows, self.per_rollout, self.seed = rows, per_rollout, seed

    def indices(self, index: int) -> list[int]:
        (indices,) = micro_batches(len(self.rows), self.per_rollout, self.per_rollout, 1, 0, index, self.seed)
        return list(indices)

    def submit(self, pool: GenerationPool, index: int):
        """Rollout `index` to the pool; its prompts' keys are (index, dataset index)."""
        indices = self.indices(index)
        rows = [self.rows[i] for i in indices]
        return pool.submit([r["prompt_ids"] for r in rows], stable_seed(self.seed, "rollout", index),
                           [r["columns"] for r in rows], [(index, i) for i in indices])


@dataclass
class Put:
    """A rollout whose experience is in the buffer, kept until an update trains on it."""

    index: int
    rollout: Rollout
    scored: Scored
    seconds: float
    """From its collection to its put: scoring it (and generating it again after lost results; time/experience)."""


@dataclass
class Taken:
    """What one update trains on: the buffer's mini-batches of a rollout's experience, that rollout, and how long
    the loop waited for rollouts to finish since the last take."""

    minibatches: Minibatches
    put: Put
    wait_seconds: float


@dataclass(frozen=True)
class FeedSettings:
    ahead: int
    """Rollouts generated ahead of the update: rollout r starts once r - ahead updates have run (0: sync mode)."""
    redo_limit: int
    """Times one rollout is generated again after a node took its results."""
    capacity: int
    """The buffer's: a put into a full buffer evicts its oldest entry."""
    train_batch_size: int
    epochs: int
    seed: int
    group_size: int = 1
    """The buffer's take: mini-batches of the train batch size of whole answer groups, epochs, the plan's seed."""
    sleep_engines: bool = False
    """Sync mode with vLLM's sleep: the engines sleep from a rollout's put until the weight sync wakes them."""

    @classmethod
    def of(cls, job: PPOJob) -> "FeedSettings":
        """As far ahead as `job`'s mode allows, mini-batches of whole answer groups (the buffer's minibatch_rows)."""
        ppo = job.ppo
        return cls(ahead=ppo.rollouts_ahead if ppo.mode == "async" else 0, redo_limit=job.cluster.max_actor_restarts,
                   capacity=ppo.buffer_capacity, train_batch_size=job.train_batch_size, epochs=ppo.ppo_epochs,
                   seed=job.seed, group_size=job.generation.sampling.n_samples_per_prompt,
                   sleep_engines=job.generation.vllm.sleep_when_idle and ppo.mode == "sync")


class RolloutFeed:
    """Rollouts started and collected ahead of the updates, and the buffer their experience goes into. Per update
    the loop scores what `generated` hands it and `put`s it, then `take`s. `workers` gives the pool and the buffer
    (RoleWorkers, or a stand-in)."""

    def __init__(self, workers, prompts: PromptSchedule, settings: FeedSettings):
        self.workers, self.prompts, self.settings = workers, prompts, settings
        self.first = self.next_index = 0
        """This run's first rollout, and the next one to start (its prompts and seed follow from its index)."""
        self.updates = 0
        """Updates this feed has fed."""
        self.last_taken = -1
        self.pending: deque[tuple[int, object]] = deque()
        """Rollouts started and not collected: (index, the pool's handle), oldest first."""
        self.redos: deque[tuple[int, object]] = deque()
        """Rollouts started again after lost results: handed out before any other."""
        self.redone: dict[int, int] = {}
        self.collected_at: dict[int, float] = {}
        self.puts: dict[int, Put] = {}
        """Rollouts put in the buffer, until trained on (or dropped: evicted, too stale)."""
        self.held = 0
        """Entries the buffer holds, as it said after the last put or take."""
        self.in_engines: dict[int, int] = {}
        """Per rollout started, its prompts whose answers no collected rollout has brought back yet (partial
        rollouts return other rollouts' prompts; a resume regenerates from the oldest with any left)."""
        self.waited = 0.0

    @classmethod
    def for_job(cls, job: PPOJob, workers, prompts: list[dict]) -> "RolloutFeed":
        """The feed of `job`'s loop over its training `prompts`."""
        return cls(workers, PromptSchedule(prompts, job.ppo.prompts_per_rollout, job.seed), FeedSettings.of(job))

    def resume_at(self, index: int) -> None:
        """A resumed run starts generating at rollout `index` (those after the last one trained on are generated
        again)."""
        self.first = self.next_index = index

    @property
    def next_after_taken(self) -> int:
        """The rollout a resume from a checkpoint now would generate first: the one after the last trained on, or
        an older one whose answers were still being generated (partial rollouts), so none is lost."""
        return min([self.last_taken + 1, *self.in_engines])

    # ---- the loop's calls -----------------------------------------------------------------------------------------
    def generated(self, updates_left: int) -> Iterator[tuple[int, Rollout]]:
        """The rollouts to score before the next take, oldest first, as (index, rollout): while the buffer is empty,
        and in async mode while it holds fewer than `ahead` and the oldest has finished (scored with the weights of
        the time: their old log-probs are the policy's before this update, their staleness grows while they wait).
        The next ones start as each is handed out: they generate while it is scored and trained on. No more start
        than the updates left (this one included) can train on."""
        self._start(updates_left)
        while self.redos or self.held == 0 or self.held < self.settings.ahead and self._oldest_done():
            redo = bool(self.redos)
            if redo:
                index, pending = self.redos.popleft()
            else:
                self._start(updates_left, one_at_least=True)
                index, pending = self.pending.popleft()
            began = time.perf_counter()
            rollout = self._collect(pending)
            if not redo:  # generating a rollout again counts in its time/experience, from its first collection
                self.waited += time.perf_counter() - began
            self.collected_at.setdefault(index, time.perf_counter())
            self._start(updates_left, in_flight=1)
            yield index, rollout

    def redo(self, index: int, lost: ResultsLost) -> None:
        """Rollout `index` lost results with a node while it was scored (the dead actors were replaced as the scoring
        failed): it is generated again, with the same prompts and seed (and in sync mode the same weights: the same
        numbers), and handed out next. `lost` is raised once the rollout has been redone `redo_limit` times."""
        self.redone[index] = self.redone.get(index, 0) + 1
        if self.redone[index] > self.settings.redo_limit:
            raise lost
        log.warning("rollout %d lost results with a node (%s); generating and scoring it again (%d of %d)",
                    index + 1, str(lost).splitlines()[-1][:200], self.redone[index], self.settings.redo_limit)
        self.redos.append((index, self._submit(index)))

    def put(self, index: int, rollout: Rollout, scored: Scored, version: int) -> None:
        """Rollout `index`'s experience into the buffer (which refuses it when it is already too stale for the
        policy `version`, and evicts its oldest entry when full)."""
        now = time.perf_counter()
        self.next_index = max(self.next_index, index + 1)
        self.redone.pop(index, None)
        if self.settings.sleep_engines:
            self.workers.pool.sleep()  # engines are idle until the weight sync, which wakes them
        meta = {"version": rollout.version, "samples": scored.experience.rows, "rollout_index": index,
                "prompt_indices": [key[1] for key in rollout.prompt_keys if isinstance(key, tuple)]}
        # (the feed's keys are (rollout, dataset index); a rollout submitted elsewhere, without keys, records none)
        buffer = self.workers.buffer
        (answer,) = buffer.gather(buffer.submit("put", [scored.experience.ref], meta, version), "put")
        self.held = answer.entries
        seconds = now - self.collected_at.pop(index, now)
        if answer.accepted:
            self.puts[index] = Put(index, rollout, scored, seconds)

    def take(self, version: int) -> Taken | None:
        """The oldest experience within the staleness bound of `version`; None when the buffer refused everything it
        held as too stale (then `generated` starts a rollout for this update)."""
        buffer = self.workers.buffer
        (minibatches,) = buffer.gather(buffer.submit("take", version, *self.take_args), "take")
        if minibatches is None:
            self.held = 0
            self.puts.clear()
            return None
        self.held = minibatches.entries
        self.updates, self.last_taken = self.updates + 1, minibatches.meta.rollout_index
        for index in [i for i in self.puts if i < minibatches.meta.rollout_index]:
            self.puts.pop(index)
        waited, self.waited = self.waited, 0.0
        return Taken(minibatches, self.puts.pop(minibatches.meta.rollout_index), waited)

    @property
    def take_args(self) -> tuple[int, int, int, int]:
        s = self.settings
        return s.train_batch_size, s.epochs, s.seed, s.group_size

    # ---- what may start ------------------------------------------------------------------------------------------
    def _start(self, updates_left: int, in_flight: int = 0, one_at_least: bool = False) -> None:
        """Start rollout r once r - `ahead` updates have run (counted from this run's first rollout and update), and
        no more than the updates left (this one included) can train on, counting the buffer's entries and
        `in_flight` rollouts being scored. With `one_at_least`, one starts regardless (the buffer refused everything
        as too stale)."""
        while len(self.pending) + self.held + in_flight < updates_left and (
                self.next_index - self.first < self.updates + self.settings.ahead + 1
                or one_at_least and not self.pending):
            self.pending.append((self.next_index, self._submit(self.next_index)))
            self.next_index += 1

    def _submit(self, index: int):
        self.in_engines[index] = self.in_engines.get(index, 0) + len(self.prompts.indices(index))
        return self.prompts.submit(self.workers.pool, index)

    def _collect(self, pending) -> Rollout:
        rollout = self.workers.pool.collect(pending)
        for index, _ in rollout.prompt_keys:
            self.in_engines[index] -= 1
            if not self.in_engines[index]:
                del self.in_engines[index]
        return rollout

    def _oldest_done(self) -> bool:
        return bool(self.pending) and self.workers.pool.finished(self.pending[0][1])
