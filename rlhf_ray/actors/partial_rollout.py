"""Partial rollouts (generation.partial_rollouts): generation that lets weight updates in, and rollouts that never
wait for their longest answer.

Weight updates: when an update waits for the engine, the answers stop where they are, the update loads, and the
unfinished answers continue from their tokens with the new weights (prompt and answer so far are prefilled again,
so their KV is the new weights'; nothing is re-tokenised). Each answer token keeps the policy version that sampled
it and its sampling log-prob.

Streaming: the rollouts the driver has started run together. A rollout call's prompts join the answers in flight at
once (the running call takes them in at its next token), and each call returns the first whole groups to finish
(as many as it brought prompts), oldest first; the rest go on, between calls too. So the longest answer holds back
only itself, and the engine's batch stays full while it runs. An answer whose first token is more than
`max_staleness` policy versions old is started again (the buffer would refuse its rollout)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from rlhf_ray.actors.engine import GenerationEngine
from rlhf_ray.actors.update_gate import HOLDING, UpdateGate
from rlhf_ray.config.generation import SamplingSpec
from rlhf_ray.data.split import stable_seed

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Answer:
    """One answer so far: its tokens, their sampling log-probs and the policy version that drew each."""

    prompt_ids: list[int]
    answer_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    """Ended with a stop id."""


@dataclass(eq=False)
class Group:
    """A prompt's answers (n_samples_per_prompt; 1 when greedy), with what its caller gave along."""

    prompt_index: int
    """Its place among the prompts of the call that brought it."""
    answers: list[Answer]
    columns: dict | None = None
    """The prompt's dataset columns (for reward functions)."""
    key: object = None
    """The caller's name for the prompt (the PPO feed's: rollout index, dataset index)."""
    call: int = 0
    """The rollout call that brought it (calls counted from 0 in arrival order)."""


class PartialRollouts:
    """The generation of one engine actor with partial rollouts. `version()` reads the engine's policy version;
    `hold`: the test hook (update_gate.HOLD_ENV)."""

    def __init__(self, engine: GenerationEngine, sampling: SamplingSpec, gate: UpdateGate,
                 version: Callable[[], int], *, max_staleness: int | None = None,
                 hold: tuple[int, float] | None = None):
        self.engine, self.sampling, self.gate, self.version = engine, sampling, gate, version
        self.max_staleness, self.hold = max_staleness, hold
        self.in_flight: list[Group] = []
        """Groups of the rollout calls so far that no call has returned yet, oldest first."""
        self.changed = threading.Condition()
        self.issued = 0
        """Turns given out: calls (and the drive between calls) take the engine one at a time, in arrival order."""
        self.serving = 0
        """The turn being served: the call whose turn it is, or `issued` when the engine is free."""
        self.arrived = False
        """Prompts joined since the driving call's last round began (it takes them in at its next token)."""
        self.restarted = 0
        """Answers started again for staleness since the last rollout call returned (wasted tokens)."""
        self.waiting = 0
        """Calls waiting for their turn (the answers in flight go on between calls only while none does)."""
        self.between_seconds = 0.0
        """Seconds the engine generated between rollout calls since the last one returned (counted with it)."""
        self.rollout_calls = 0
        """Rollout calls so far (the test hook leaves the first one alone)."""

    def generate(self, prompts: list[list[int]], seed: int, greedy: bool = False) -> list[dict]:
        """Every answer of `prompts` to its end, through weight updates (evaluation; nothing carries over)."""
        groups = self._groups(prompts, greedy)
        with self._turn():
            self._drive(lambda: groups, len(groups), seed, greedy, streaming=False)
        return samples_of(groups)

    def rollout(self, prompts: list[list[int]], seed: int, columns: list[dict] | None = None,
                keys: list | None = None) -> tuple[list[Group], dict, float]:
        """Join `prompts` to the answers in flight, wait for this call's turn, then drive the engine until
        len(prompts) groups are whole. Returns them (oldest first), counts (`streamed`: those another call brought;
        `restarted`: answers started again for staleness since the last call returned) and the seconds the engine
        generated for it: its own turn, plus the generation between calls since the last call returned."""
        with self._turn(self._groups(prompts, False, columns, keys)) as ticket:
            began = time.perf_counter()
            self.rollout_calls += 1
            done = self._drive(self._current, len(prompts), seed, False, streaming=True,
                               hold=self.rollout_calls > 1)
            with self.changed:
                self.in_flight = [g for g in self.in_flight if not any(g is d for d in done)]
                counts = {"streamed": sum(g.call != ticket for g in done), "restarted": self.restarted}
                seconds = time.perf_counter() - began + self.between_seconds
                self.restarted, self.between_seconds = 0, 0.0
        return done, counts, seconds

    def close(self) -> None:
        """The job's end: the answers in flight are dropped and this waits for the engine's turn (a drive between
        calls stops at its next round), so the engine can shut down with nothing generating on it."""
        with self.changed:
            self.in_flight = []
        with self._turn():
            pass

    @contextmanager
    def _turn(self, joining: list[Group] = ()) -> Iterator[int]:
        """The engine for one call, in arrival order: its groups (a rollout's) join the answers in flight at once,
        then it waits for the calls before it. Afterwards, answers left in flight go on until the next call."""
        with self.changed:
            ticket, self.issued = self.issued, self.issued + 1
            for group in joining:
                group.call = ticket
            self.in_flight += joining
            self.arrived = self.arrived or bool(joining)
            self.waiting += 1
            self.changed.wait_for(lambda: self.serving == ticket)
            self.waiting -= 1
        try:
            yield ticket
        finally:
            with self.changed:
                self.serving += 1
                self.changed.notify_all()
        self._between_calls()

    def _between_calls(self) -> None:
        """While no call waits, the answers in flight go on (in a thread of their own, with a turn of its own): the
        next rollout call finds them further along, and stops them at the next token when it joins."""
        with self.changed:
            if self.serving != self.issued or all(self._done(a) for g in self.in_flight for a in g.answers):
                return  # a call drives or waits, or nothing is left to do
            ticket, self.issued = self.issued, self.issued + 1  # the engine is free: this turn is now
        threading.Thread(target=self._drive_between, args=(ticket,), name="rollouts-between-calls",
                         daemon=True).start()

    def _drive_between(self, ticket: int) -> None:
        began = time.perf_counter()
        try:
            self._drive(self._current, None, stable_seed(ticket, "between calls"), False, streaming=True)
        except Exception:  # noqa: BLE001 - the next rollout call drives the same answers and reports it
            log.exception("continuing the answers in flight between rollout calls failed")
        finally:
            with self.changed:
                self.between_seconds += time.perf_counter() - began
                self.serving += 1
                self.changed.notify_all()

    # ---- driving the engine ----------------------------------------------------------------------------------
    def _drive(self, groups_now: Callable[[], list[Group]], quota: int | None, seed: int, greedy: bool,
               streaming: bool, hold: bool = True) -> list[Group]:
        """Rounds of generation over the unfinished answers of `groups_now()` until `quota` groups are whole (the
        oldest of them returned). A round ends for a weight update (loaded between rounds), for prompts that
        joined (streaming), or when enough groups are whole. `quota` None: between calls, until every answer
        ends or a call waits for the engine. `hold` False: the test hook does not hold this call."""
        between = quota is None
        stop_hold = (lambda tokens: self.gate.requested) if between else self._holding(hold)
        if not streaming:
            yield_now = lambda: False  # noqa: E731
        else:  # prompts joined; between calls, also a call that waits for the engine
            yield_now = (lambda: self.arrived or self.waiting > 0) if between else (lambda: self.arrived)
        with self.gate.generation():
            for round_ in itertools.count():
                groups = groups_now()
                whole = [g for g in groups if all(self._done(a) for a in g.answers)]
                todo = [(g, a) for g in groups for a in g.answers if not self._done(a)]
                if not todo or between and self.waiting or not between and len(whole) >= quota:
                    return whole[:quota]
                now, drawn = self.version(), sum(len(a.answer_ids) for _, a in todo)
                if streaming:
                    with self.changed:
                        self.arrived = False  # this round takes in what has joined
                self._round(todo, len(groups) if between else quota - len(whole),
                            stable_seed(seed, "round", round_) if round_ else seed, greedy, now,
                            lambda tokens: stop_hold(tokens) or yield_now())
                if sum(len(a.answer_ids) for _, a in todo) == drawn and not (self.gate.requested or yield_now()):
                    raise RuntimeError(f"{len(todo)} answers stopped short of max_new_tokens with no weight update "
                                       f"waiting, and continuing them drew no token (the {self.engine.name} engine)")
                if self.gate.requested:
                    self.gate.pause()  # the update that stopped the round loads now

    def _round(self, todo: list[tuple[Group, Answer]], needed: int, seed: int, greedy: bool, now: int,
               interrupted: Callable[[int], bool]) -> None:
        """One engine call continuing every answer of `todo` (with version `now`), each within what is left of its
        max_new_tokens; it ends once `needed` more groups are whole, or when `interrupted(tokens drawn)` says so
        (an update waits, prompts joined)."""
        rows_of: dict[int, list[int]] = {}
        for row, (group, _) in enumerate(todo):
            rows_of.setdefault(id(group), []).append(row)
        groups_rows = list(rows_of.values())

        def stop(tokens: int, ended: Sequence[bool]) -> bool:
            return interrupted(tokens) or sum(all(ended[r] for r in rows) for rows in groups_rows) >= needed

        one = self.sampling.model_copy(update={"n_samples_per_prompt": 1})
        samples = self.engine.generate([a.prompt_ids + a.answer_ids for _, a in todo], one, seed, greedy, stop,
                                       [(self.sampling.max_new_tokens - len(a.answer_ids),
                                         max(0, self.sampling.min_new_tokens - len(a.answer_ids))) for _, a in todo])
        for (_, answer), sample in zip(todo, samples):
            answer.answer_ids += sample["answer_ids"]
            answer.logprobs += sample["logprobs"]
            answer.versions += [now] * len(sample["answer_ids"])
            answer.finished = sample["finished"]

    def _holding(self, hold: bool) -> Callable[[int], bool]:
        """Whether an update waits (asked after each token). With the test hook (token, seconds) and `hold`, the
        first round's answers go on to that token whatever waits, and hold there until an update does."""
        held = not hold

        def asked(tokens: int) -> bool:
            nonlocal held
            if self.hold is not None and not held:
                if tokens < self.hold[0]:
                    return False
                held = True
                log.warning("%s %d until an update asks (%.0f s at most)", HOLDING, tokens, self.hold[1])
                self.gate.wait_for_request(self.hold[1])
            return self.gate.requested

        return asked

    # ---- groups --------------------------------------------------------------------------------------------------
    def _current(self) -> list[Group]:
        """The groups in flight, those whose oldest token is over `max_staleness` versions old started again."""
        with self.changed:
            if self.max_staleness is not None:
                oldest_allowed = self.version() - self.max_staleness
                for group in self.in_flight:
                    if any(a.versions and a.versions[0] < oldest_allowed for a in group.answers):
                        self.restarted += sum(bool(a.answer_ids) for a in group.answers)
                        group.answers = [Answer(a.prompt_ids) for a in group.answers]
            return list(self.in_flight)

    def _groups(self, prompts: list[list[int]], greedy: bool, columns: list[dict] | None = None,
                keys: list | None = None, call: int = 0) -> list[Group]:
        n = 1 if greedy else self.sampling.n_samples_per_prompt
        return [Group(i, [Answer(list(p)) for _ in range(n)], columns[i] if columns else None,
                      keys[i] if keys else None, call) for i, p in enumerate(prompts)]

    def _done(self, answer: Answer) -> bool:
        return answer.finished or len(answer.answer_ids) >= self.sampling.max_new_tokens


def samples_of(groups: list[Group]) -> list[dict]:
    """The groups' answers as engine samples (engine.Sample) with `versions`, consecutive per group."""
    return [{"prompt_index": g.prompt_index, "prompt_ids": a.prompt_ids, "answer_ids": a.answer_ids,
             "logprobs": a.logprobs, "finished": a.finished, "versions": a.versions}
            for g in groups for a in g.answers]
