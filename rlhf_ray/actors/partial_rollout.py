"""Generation that lets weight updates in (generation.partial_rollouts): when an update waits for the engine, the
answers stop where they are, the update loads, and the unfinished answers continue from their tokens with the new
weights (prompt and answer so far are prefilled again, so their KV is the new weights'; nothing is re-tokenised).
Each answer token keeps the policy version that sampled it and its sampling log-prob."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from rlhf_ray.actors.engine import GenerationEngine
from rlhf_ray.actors.update_gate import UpdateGate
from rlhf_ray.config.generation import SamplingSpec
from rlhf_ray.data.split import stable_seed


def generate_through_updates(engine: GenerationEngine, prompts: list[list[int]], sampling: SamplingSpec, seed: int,
                             greedy: bool, gate: UpdateGate, version: Callable[[], int],
                             hold: tuple[int, float] | None = None) -> list[dict]:
    """The engine's samples of `prompts` (its contract), each with `versions`: the policy version of each answer
    token. `version()` reads the engine's version after an update; `hold`: the test hook (update_gate.HOLD_ENV)."""
    stop = _asked_to_stop(gate, hold)
    with gate.generation():
        now = version()
        rows = [{**s, "versions": [now] * len(s["answer_ids"])}
                for s in engine.generate(prompts, sampling, seed, greedy, stop)]
        restart, drawn = 0, None
        while todo := [i for i, r in enumerate(rows)
                       if not r["finished"] and len(r["answer_ids"]) < sampling.max_new_tokens]:
            before, drawn = drawn, sum(len(r["answer_ids"]) for r in rows)
            if drawn == before and not gate.requested:
                raise RuntimeError(f"{len(todo)} answers stopped short of max_new_tokens with no weight update "
                                   f"waiting, and continuing them drew no token (the {engine.name} engine)")
            gate.pause()  # the update that stopped them loads now
            now, restart = version(), restart + 1
            by_length = itertools.groupby(sorted(todo, key=lambda i: len(rows[i]["answer_ids"])),
                                          key=lambda i: len(rows[i]["answer_ids"]))
            for done, group in by_length:  # rows stopped at the same token go on together
                group = list(group)
                rest = sampling.model_copy(update={"n_samples_per_prompt": 1,
                                                   "max_new_tokens": sampling.max_new_tokens - done,
                                                   "min_new_tokens": max(0, sampling.min_new_tokens - done)})
                more = engine.generate([rows[i]["prompt_ids"] + rows[i]["answer_ids"] for i in group], rest,
                                       stable_seed(seed, "continue", restart, done), greedy, stop)
                for i, sample in zip(group, more):
                    row = rows[i]
                    rows[i] = {**row, "answer_ids": row["answer_ids"] + sample["answer_ids"],
                               "logprobs": row["logprobs"] + sample["logprobs"], "finished": sample["finished"],
                               "versions": row["versions"] + [now] * len(sample["answer_ids"])}
    return rows


def _asked_to_stop(gate: UpdateGate, hold: tuple[int, float] | None) -> Callable[[int], bool]:
    """What the engine asks after each token: whether an update waits. With the test hook (token, seconds), the
    first call's answers go on to that token whatever waits, and hold there until an update does."""
    held = False

    def stop(tokens: int) -> bool:
        nonlocal held
        if hold is not None and not held:
            if tokens < hold[0]:
                return False
            held = True
            gate.wait_for_request(hold[1])
        return gate.requested

    return stop
