"""The producer side of the PPO loop: rollouts go to the generation pool (up to `ppo.rollouts_ahead` ahead of the
update in async mode, one at a time in sync mode), and each one's experience goes into the replay buffer as soon as
the rollout is collected and scored. The loop takes from the buffer on its own schedule, one entry per update; how
many entries the buffer holds is what the buffer says after each put and take."""

from __future__ import annotations

import logging
import time
from collections import deque
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
    """Scoring and putting it (time/experience)."""


@dataclass
class Taken:
    """What one update trains on: the buffer's mini-batches of a rollout's experience, that rollout, and how long
    the loop waited for rollouts to finish since the last take."""

    minibatches: Minibatches
    put: Put
    wait_seconds: float


class RolloutFeed:
    """Rollouts started, scored and put in the buffer ahead of the updates: rollout r starts once r - `ahead`
    updates have run (`ahead` 0 in sync mode: each rollout starts after the update before it). `workers` gives the
    pool, the buffer and the scorer (RoleWorkers, or a stand-in)."""

    def __init__(self, workers, prompts: PromptSchedule, *, ahead: int, redo_limit: int, capacity: int,
                 train_batch_size: int, epochs: int, seed: int, group_size: int = 1, keep_samples: int = 0,
                 sleep_engines: bool = False):
        self.workers, self.prompts, self.ahead, self.redo_limit = workers, prompts, ahead, redo_limit
        self.capacity = capacity
        """The buffer's: a put into a full buffer evicts its oldest entry."""
        self.take_args = (train_batch_size, epochs, seed, group_size)
        """The buffer's take: mini-batches of the train batch size, epochs, the plan's seed, whole answer groups."""
        self.keep_samples, self.sleep_engines = keep_samples, sleep_engines
        self.first = self.next_index = 0
        """This run's first rollout, and the next one to start (its prompts and seed follow from its index)."""
        self.updates = 0
        """Updates this feed has fed."""
        self.last_taken = -1
        self.pending: deque[tuple[int, object]] = deque()
        self.puts: dict[int, Put] = {}
        """Rollouts put in the buffer, until trained on (or dropped: evicted, too stale)."""
        self.held = 0
        """Entries the buffer holds: as it said after the last take, plus the puts since (counted as kept)."""
        self.unanswered: list[tuple[int, list]] = []
        """Puts whose answer the feed has not read yet: (rollout index, call refs); read at the next take."""
        self.in_engines: dict[int, int] = {}
        """Per rollout started, its prompts whose answers no collected rollout has brought back yet (partial
        rollouts return other rollouts' prompts; a resume regenerates from the oldest with any left)."""
        self.waited = 0.0

    @classmethod
    def for_job(cls, job: PPOJob, workers, prompts: list[dict]) -> "RolloutFeed":
        """The feed of `job`'s loop over its training `prompts`: as far ahead as its mode allows, mini-batches of
        whole answer groups (the replay buffer's minibatch_rows)."""
        ppo, sampling = job.ppo, job.generation.sampling
        return cls(workers, PromptSchedule(prompts, ppo.prompts_per_rollout, job.seed),
                   ahead=ppo.rollouts_ahead if ppo.mode == "async" else 0, redo_limit=job.cluster.max_actor_restarts,
                   capacity=ppo.buffer_capacity, train_batch_size=job.train_batch_size, epochs=ppo.ppo_epochs,
                   seed=job.seed, group_size=sampling.n_samples_per_prompt,
                   keep_samples=job.logging.samples_per_iteration,
                   sleep_engines=job.generation.vllm.sleep_when_idle and ppo.mode == "sync")

    def resume_at(self, index: int) -> None:
        """A resumed run starts generating at rollout `index` (those after the last one trained on are generated
        again)."""
        self.first = self.next_index = index

    @property
    def next_after_taken(self) -> int:
        """The rollout a resume from a checkpoint now would generate first: the one after the last trained on, or
        an older one whose answers were still being generated (partial rollouts), so none is lost."""
        return min([self.last_taken + 1, *self.in_engines])

    def take(self, version: int, updates_left: int) -> Taken:
        """The oldest experience within the staleness bound of `version`, after topping the buffer up; when the buffer
        refused everything it held as too stale, a rollout starts for this update and the take is tried again."""
        while True:
            self._top_up(version, updates_left)
            taking = self.workers.buffer.submit("take", version, *self.take_args)
            self._read_put_answers()
            (minibatches,) = self.workers.buffer.gather(taking, "take")
            self.held = minibatches.stats["buffer/entries"] if minibatches is not None else 0
            if minibatches is not None:
                break
            self.puts.clear()
        self.updates, self.last_taken = self.updates + 1, minibatches.meta.rollout_index
        for index in [i for i in self.puts if i < minibatches.meta.rollout_index]:
            self.puts.pop(index)
        waited, self.waited = self.waited, 0.0
        return Taken(minibatches, self.puts.pop(minibatches.meta.rollout_index), waited)

    def put(self, index: int, rollout: Rollout, version: int) -> None:
        """Score rollout `index` and put its experience in the buffer (the buffer refuses it when it is already too
        stale; its answer is read at the next take, which the buffer runs after the put: one round trip less). When a node took results the scoring needed, the dead actors are replaced as the scoring fails and
        the rollout is generated again: same prompts, same seed, same weights in sync mode, so the same numbers."""
        began = time.perf_counter()
        self.next_index = max(self.next_index, index + 1)
        for redo in range(self.redo_limit + 1):
            try:
                scored = self.workers.scorer.score(rollout, version, self.keep_samples)
                break
            except ResultsLost as err:
                if redo == self.redo_limit:
                    raise
                log.warning("rollout %d lost results with a node (%s); generating and scoring it again (%d of %d)",
                            index + 1, str(err).splitlines()[-1][:200], redo + 1, self.redo_limit)
                rollout = self._collect(self._submit(index))
        if self.sleep_engines:
            self.workers.pool.sleep()  # engines are idle until the weight sync, which wakes them
        meta = {"version": rollout.version, "samples": scored.experience.rows, "rollout_index": index,
                "prompt_indices": [key[1] for key in rollout.prompt_keys if isinstance(key, tuple)]}
        # (the feed's keys are (rollout, dataset index); a rollout submitted elsewhere, without keys, records none)
        self.unanswered.append((index, self.workers.buffer.submit("put", [scored.experience.ref], meta, version)))
        self.held = min(self.held + 1, self.capacity)
        self.puts[index] = Put(index, rollout, scored, time.perf_counter() - began)

    def _read_put_answers(self) -> None:
        """Forget the rollouts the buffer refused as too stale (their puts were not waited for)."""
        for index, refs in self.unanswered:
            (state,) = self.workers.buffer.gather(refs, "put")
            if not state.accepted:
                self.puts.pop(index, None)
        self.unanswered.clear()

    # ---- what may start, what is put -----------------------------------------------------------------------------
    def _top_up(self, version: int, updates_left: int) -> None:
        """Start what may start; wait for the oldest rollout while the buffer is empty, and put those that have
        finished until it holds `ahead` (in async mode they were scored with the weights of the time: their old
        log-probs are the policy's before this update, their staleness grows while they wait)."""
        self._start(updates_left)
        while self.held == 0 or self.held < self.ahead and self._oldest_done():
            self._start(updates_left, one_at_least=True)
            self._put_oldest(version, updates_left)

    def _start(self, updates_left: int, in_flight: int = 0, one_at_least: bool = False) -> None:
        """Start rollout r once r - `ahead` updates have run (counted from this run's first rollout and update), and
        no more than the updates left (this one included) can train on, counting the buffer's entries and
        `in_flight` rollouts being scored. With `one_at_least`, one starts regardless (the buffer refused everything
        as too stale)."""
        while len(self.pending) + self.held + in_flight < updates_left and (
                self.next_index - self.first < self.updates + self.ahead + 1 or one_at_least and not self.pending):
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

    def _put_oldest(self, version: int, updates_left: int) -> None:
        """Collect the oldest rollout (waiting for it), start the next ones (they generate while this one is scored
        and trained on), score it and put its experience in the buffer."""
        index, pending = self.pending.popleft()
        began = time.perf_counter()
        rollout = self._collect(pending)
        self.waited += time.perf_counter() - began
        self._start(updates_left, in_flight=1)
        self.put(index, rollout, version)
