"""Weight updates that reach an engine mid-rollout (generation.partial_rollouts). The engine actor then runs a
rollout and a weight update in two threads: the update asks for the engine, the rollout sees the request between
two tokens, gives the engine up and waits; the update loads (all its parts, for a handoff in several calls) and
gives it back; the rollout continues its unfinished answers with the new weights."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from collections.abc import Iterator

HOLD_ENV = "RLHF_RAY_HOLD_ROLLOUT_AT_TOKEN"
"""Test hook, `TOKEN[:SECONDS]` in an engine's environment: a rollout's answers hold after TOKEN tokens until a
weight update asks for the engine (SECONDS at most, default 120), so a test can land an update mid-generation; the
engine logs a warning beginning with HOLDING when it holds.
An engine's first rollout call is not held: the job's first update trains on it, so no update comes before it
ends (holding it only idled the engine for SECONDS)."""
HOLDING = "test hook: the rollout holds at token"


def hold_point(value: str | None) -> tuple[int, float] | None:
    """The test hook's (token, seconds), or None."""
    if not value:
        return None
    token, _, seconds = value.partition(":")
    return int(token), float(seconds or 120)


class UpdateGate:
    def __init__(self):
        self._changed = threading.Condition()
        self._engine_busy = False
        self._updates_waiting = 0
        self._updating = False
        """An update holds the engine between its parts (a handoff's calls)."""

    @property
    def requested(self) -> bool:
        """An update waits for the engine: a generation should stop at its next token and `pause`."""
        return self._updates_waiting > 0

    @contextmanager
    def generation(self) -> Iterator["UpdateGate"]:
        """The engine, for a generation, once no update waits for it or holds it."""
        self._take_after_updates()
        try:
            yield self
        finally:
            self._give()

    def pause(self) -> None:
        """Inside `generation`: give the engine to the waiting updates and take it back once they are done."""
        self._give()
        self._take_after_updates()

    def wait_for_request(self, timeout_s: float) -> bool:
        """Block until an update asks for the engine (or `timeout_s`); whether one does."""
        with self._changed:
            return self._changed.wait_for(lambda: self._updates_waiting > 0, timeout_s)

    def begin_update(self) -> None:
        """Take the engine for an update (waiting for the running generation to pause); again within the same
        update (its next part), nothing more happens."""
        with self._changed:
            if self._updating:
                return
            self._updates_waiting += 1
            self._changed.notify_all()
            self._changed.wait_for(lambda: not self._engine_busy)
            self._engine_busy, self._updating = True, True

    def end_update(self) -> None:
        """The update is whole: generations may go on."""
        with self._changed:
            if not self._updating:
                return
            self._updates_waiting -= 1
            self._engine_busy, self._updating = False, False
            self._changed.notify_all()

    @contextmanager
    def update(self, last: bool = True) -> Iterator[None]:
        """One update call; with `last` false the engine stays with the update after it (more parts follow). An
        update that fails gives the engine back."""
        self.begin_update()
        try:
            yield
        except BaseException:
            self.end_update()
            raise
        if last:
            self.end_update()

    def _take_after_updates(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: not self._engine_busy and self._updates_waiting == 0)
            self._engine_busy = True

    def _give(self) -> None:
        with self._changed:
            self._engine_busy = False
            self._changed.notify_all()
