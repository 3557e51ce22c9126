"""Multi-turn episodes, token in, token out: each turn the engine continues from the exact ids of the episode so far
(prompt, the policy's sampled turns, the rendered observations), the environment answers the decoded turn, and its
observation's ids are appended. The result is one sample per episode whose answer holds every turn with a mask:
1 on the ids the policy sampled, 0 on observation ids (context: no log-prob, KL, value or advantage)."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Callable

from rlhf_ray.envs.environment import Environment, Step
from rlhf_ray.envs.render import ObservationRenderer

log = logging.getLogger(__name__)

EPISODE_COLUMNS = ("episode_reward", "turns", "tool_calls", "valid_calls")
"""What an episode adds to its sample's columns (for reward functions) and the engines sum for the metrics."""

Generate = Callable[[list[list[int]]], list[dict[str, Any]]]
"""An engine's generate call: prompts as token ids -> per prompt {"answer_ids", "logprobs", "finished"}."""


def run_episodes(generate: Generate, envs: list[Environment], prompt_ids: list[list[int]], tokenizer,
                 renderer: ObservationRenderer, max_turns: int, max_answer_tokens: int,
                 step_timeout_s: float = 10.0, turn_tokens: int = 0) -> list[dict[str, Any]]:
    """Play one episode per environment, all turns of all episodes batched into one generate call per turn. An
    episode ends when its environment says done or gives no observation, after `max_turns` policy turns, when a turn
    is cut off (no stop token), when the next observation and a next turn of up to `turn_tokens` would pass
    `max_answer_tokens`, or when a `step` raises or takes longer than `step_timeout_s` (reward 0 for that step,
    logged naming the environment). A turn's samples may carry `versions` (the policy version of each token:
    weight updates between turns); an observation's tokens take the version of the turn before them."""
    episodes = [{"prompt_ids": list(p), "answer_ids": [], "answer_mask": [], "logprobs": [], "versions": [],
                 "reward": 0.0,
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
                e["versions"] += out.get("versions") or [0] * len(out["answer_ids"])
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
                if len(e["answer_ids"]) + len(observation) + turn_tokens > max_answer_tokens:
                    e["done"] = True
                    continue
                e["answer_ids"] += observation
                e["answer_mask"] += [0] * len(observation)
                e["logprobs"] += [0.0] * len(observation)
                e["versions"] += e["versions"][-1:] * len(observation)
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


def episode_reward(prompts: list[str], answers: list[str], episode_reward: list[float], **_) -> list[float]:
    """The reward function of multi-turn runs (`reward.function: rlhf_ray.envs.episode:episode_reward`): each
    episode's reward as its environment gave it (the generation engines put it in the sample's columns)."""
    return [float(r) for r in episode_reward]


def episode_metrics(totals: dict[str, float], samples: int) -> dict[str, float]:
    """Episode statistics summed over `samples` episodes (EPISODE_COLUMNS, as the engines sum them) as means: turns
    and tool calls per episode, the share of tool calls that were well formed (nan without calls), the mean episode
    reward. Empty without episodes."""
    if not totals:
        return {}
    n = max(samples, 1)
    calls = totals["tool_calls"]
    return {"env/turns_per_episode": totals["turns"] / n, "env/tool_calls_per_episode": calls / n,
            "env/tool_call_validity": totals["valid_calls"] / calls if calls else float("nan"),
            "env/episode_reward": totals["episode_reward"] / n}


class EpisodeRunner:
    """Runs in a generation engine's actor: builds one environment per sample, renders its first messages into the
    prompt, and plays the episodes on the engine (n samples of a prompt are n episodes)."""

    def __init__(self, spec, tokenizer, tokens, sampling):
        from rlhf_ray.functions import load_function

        self.spec, self.tokenizer, self.tokens = spec, tokenizer, tokens
        self.env_class = load_function(spec.path)
        self.renderer = ObservationRenderer(tokenizer, spec.observation_role)
        self.renderer.ids("probe")  # a template without this role fails here, when the engine starts
        self.sampling = sampling

    def play(self, engine, prompts: list[list[int]], columns: list[dict] | None, seed: int,
             greedy: bool = False, before_turn: Callable[[], int] = lambda: 0) -> list[dict[str, Any]]:
        """The episodes; `before_turn()` runs before each turn and returns the policy version that turn samples
        with (the engine's, after any weight update that waited for the turn to end)."""
        from rlhf_ray.data.split import stable_seed

        n = 1 if greedy else self.sampling.n_samples_per_prompt
        one = self.sampling.model_copy(update={"n_samples_per_prompt": 1})
        expanded = [i for i in range(len(prompts)) for _ in range(n)]
        envs = [self.env_class(**self.spec.options) for _ in expanded]
        starts = []
        for env, i in zip(envs, expanded):
            sample = {"prompt": self.tokenizer.decode(prompts[i], skip_special_tokens=True),
                      **(columns[i] if columns else {})}
            text = self.tokenizer.apply_chat_template(env.reset(sample), tokenize=False, add_generation_prompt=True)
            starts.append(self.tokens.encode_prompt(self.tokenizer, text))
        turns = iter(range(self.spec.max_turns))

        def generate(batch: list[list[int]]) -> list[dict[str, Any]]:
            version = before_turn()
            samples = engine.generate(batch, one, stable_seed(seed, "turn", next(turns)), greedy)
            return [{**s, "versions": [version] * len(s["answer_ids"])} for s in samples]

        episodes = run_episodes(generate, envs, starts, self.tokenizer, self.renderer, self.spec.max_turns,
                                self.spec.max_episode_tokens, self.spec.step_timeout_s, one.max_new_tokens)
        out = []
        for i, e in zip(expanded, episodes):
            stats = {"episode_reward": e["reward"], "turns": e["turns"], "tool_calls": e["tool_calls"],
                     "valid_calls": e["valid_calls"]}
            out.append({"prompt_index": i, "prompt_ids": e["prompt_ids"], "answer_ids": e["answer_ids"],
                        "answer_mask": e["answer_mask"], "logprobs": e["logprobs"], "versions": e["versions"],
                        "finished": e["finished"], "episode": stats})
        return out
