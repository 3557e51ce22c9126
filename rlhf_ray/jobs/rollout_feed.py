"""The producer side of the PPO loop: rollouts go to the generation pool (up to `ppo.rollouts_ahead` ahead of the
update in async mode, one at a time in sync mode), and each one's experience goes into the replay buffer as soon as
the rollout is collected and scored. The loop takes from the buffer on its own schedule, one entry per update."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from rlhf_ray.jobs.ppo_run import ResultsLost

log = logging.getLogger(__name__)


def _put_redoing_lost_results(run, index: int, rollout: dict, prompt_indices: list[int], regenerate,
                              limit: int) -> dict:
    """run.put_experience; when a node died with results the scoring still needed (its rollout, a replica's
    scores), the dead actors are replaced as the scoring fails and the rollout is generated again: same prompts,
    same seed, same weights in sync mode, so the same numbers. Returns the metrics of the rollout that was put."""
    for redo in range(limit + 1):
        try:
            return run.put_experience(index, rollout, prompt_indices)
        except ResultsLost as err:
            if redo == limit:
                raise
            log.warning("rollout %d lost results with a node (%s); generating and scoring it again (%d of %d)",
                        index + 1, str(err).splitlines()[-1][:200], redo + 1, limit)
            rollout = regenerate()
    raise AssertionError("unreachable")


class RolloutFeed:
    """Rollouts started, scored and put in the buffer ahead of the updates: rollout r starts once r - `ahead`
    updates have run (`ahead` 0 in sync mode: each rollout starts after the update before it)."""

    def __init__(self, run, prompt_indices: Callable[[int], list[int]], submit: Callable[[int], dict], ahead: int,
                 first: int, redo_limit: int):
        self.run, self.prompt_indices, self.submit = run, prompt_indices, submit
        self.ahead, self.redo_limit = ahead, redo_limit
        self.first = self.next_index = first
        """The next rollout to start (its prompts and seed follow from it)."""
        self.updates = 0
        """Updates this feed has fed."""
        self.pending: deque[tuple[int, dict]] = deque()
        self.scored: dict[int, dict] = {}
        """Metrics of each rollout put in the buffer, until it is trained on (or dropped: evicted, too stale)."""
        self.buffered = 0
        """Entries the buffer holds (as of the last put or take), plus a rollout collected and being scored."""
        self.wait_seconds = 0.0
        """Time spent waiting for a rollout to finish (the loop resets it each iteration)."""

    def start(self, updates_left: int, one_at_least: bool = False) -> None:
        """Start the rollouts that may start: rollout r once r - `ahead` updates have run (counted from this run's
        first rollout and update), and no more than the updates left (this one included) can train on. With
        `one_at_least`, one starts regardless (the buffer refused everything as too stale)."""
        while len(self.pending) + self.buffered < updates_left and (
                self.next_index - self.first < self.updates + self.ahead + 1 or one_at_least and not self.pending):
            self.pending.append((self.next_index, self.submit(self.next_index)))
            self.next_index += 1

    def _oldest_done(self) -> bool:
        return bool(self.pending) and self.run.pool.finished(self.pending[0][1])

    def _put_oldest(self, updates_left: int) -> None:
        """Collect the oldest rollout (waiting for it), start the next ones (they generate while this one is
        scored and trained on), score it and put its experience in the buffer."""
        index, pending = self.pending.popleft()
        began = time.perf_counter()
        rollout = self.run.pool.collect(pending)
        self.wait_seconds += time.perf_counter() - began
        self.buffered += 1
        self.start(updates_left)
        scored = _put_redoing_lost_results(self.run, index, rollout, self.prompt_indices(index),
                                           lambda: self.run.pool.collect(self.submit(index)), self.redo_limit)
        if scored.pop("accepted"):
            self.scored[index] = scored
            self.buffered = min(self.buffered, self.run.job.ppo.buffer_capacity)  # a full buffer evicted one
        else:  # already too stale
            self.buffered -= 1

    def fill(self, updates_left: int) -> None:
        """Before an update: start what may start; wait for the oldest rollout while the buffer is empty, and put
        those that have finished until it holds `ahead` (in async mode they were scored with the weights of the
        time: their old log-probs are the policy's before this update, their staleness grows while they wait)."""
        self.start(updates_left)
        while self.buffered == 0 or self.buffered < self.ahead and self._oldest_done():
            self.start(updates_left, one_at_least=True)
            self._put_oldest(updates_left)

    def taken(self, rollout: int | None, entries_left: int) -> dict:
        """After a take: the buffer handed out `rollout` (None: it held nothing fresh enough) and holds
        `entries_left`. Returns the rollout's metrics; forgets older ones (dropped)."""
        self.buffered = entries_left
        if rollout is None:
            self.scored.clear()
            return {}
        self.updates += 1
        for index in [i for i in self.scored if i < rollout]:
            self.scored.pop(index)
        return self.scored.pop(rollout)
