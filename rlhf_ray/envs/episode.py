"""Multi-turn episodes, token in, token out: each turn the engine continues from the exact ids of the episode so far
(prompt, the policy's sampled turns, the rendered observations), the environment answers the decoded turn, and its
observation's ids are appended. The result is one sample per episode whose answer holds every turn with a mask:
1 on the ids the policy sampled, 0 on observation ids (context: no log-prob, KL, value or advantage)."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Callable

from rlhf_ray.envs.base import Environment, Step
from rlhf_ray.envs.render import ObservationRenderer

log = logging.getLogger(__name__)

Generate = Callable[[list[list[int]]], list[dict[str, Any]]]
"""An engine's generate call: prompts as token ids -> per prompt {"answer_ids", "logprobs", "finished"}."""


def run_episodes(generate: Generate, envs: list[Environment], prompt_ids: list[list[int]], tokenizer,
                 renderer: ObservationRenderer, max_turns: int, max_answer_tokens: int,
                 step_timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Play one episode per environment, all turns of all episodes batched into one generate call per turn. An
    episode ends when its environment says done or gives no observation, after `max_turns` policy turns, when a turn
    is cut off (no stop token), when the next observation would pass `max_answer_tokens`, or when a `step` raises or
    takes longer than `step_timeout_s` (reward 0 for that step, logged naming the environment)."""
    episodes = [{"prompt_ids": list(p), "answer_ids": [], "answer_mask": [], "logprobs": [], "reward": 0.0,
                 "turns": 0, "tool_calls": 0, "valid_calls": 0, "finished": False, "done": False}
                for p in prompt_ids]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(16, max(1, len(envs))))
    try:
        for turn in range(max_turns):
            live = [i for i, e in enumerate(episodes) if not e["done"]]
            if not live:
                break
            outs = generate([episodes[i]["prompt_ids"] + episodes[i]["answer_ids"] for i in live])
            pending = {}
            for i, out in zip(live, outs):
                e = episodes[i]
                e["answer_ids"] += out["answer_ids"]
                e["answer_mask"] += [1] * len(out["answer_ids"])
                e["logprobs"] += list(out["logprobs"])
                e["turns"] += 1
                e["finished"] = bool(out["finished"])
                if not out["finished"]:
                    e["done"] = True  # cut off mid-turn: nothing for the environment to answer
                    continue
                text = tokenizer.decode(out["answer_ids"], skip_special_tokens=True)
                pending[i] = pool.submit(envs[i].step, text)
            deadline = time.monotonic() + step_timeout_s  # the steps of a turn run side by side
            for i, future in pending.items():
                e = episodes[i]
                step = _result(future, envs[i], max(0.0, deadline - time.monotonic()), step_timeout_s)
                e["reward"] += step.reward
                e["tool_calls"] += int(step.tool_call)
                e["valid_calls"] += int(step.valid_call)
                if step.done or step.observation is None or turn == max_turns - 1:
                    e["done"] = True
                    continue
                observation = list(renderer.ids(step.observation))
                if len(e["answer_ids"]) + len(observation) >= max_answer_tokens:
                    e["done"] = True
                    continue
                e["answer_ids"] += observation
                e["answer_mask"] += [0] * len(observation)
                e["logprobs"] += [0.0] * len(observation)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a step that hangs is abandoned, not waited for
    for e in episodes:
        del e["done"]
    return episodes


def _result(future: concurrent.futures.Future, env: Environment, wait_s: float, timeout_s: float) -> Step:
    try:
        return future.result(timeout=wait_s)
    except concurrent.futures.TimeoutError:
        log.warning("%s.step took longer than %.1f s: the episode ends with no reward for that turn",
                    type(env).__name__, timeout_s)
    except Exception as exc:  # noqa: BLE001 - a task's own bug ends its episode, not the run
        log.warning("%s.step raised %r: the episode ends with no reward for that turn", type(env).__name__, exc)
    return Step(done=True)
