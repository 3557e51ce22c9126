"""Held-out prompts answered by the engines, greedily (the policy's mode) and sampled with the training settings
(the distribution PPO optimises), scored by the reward role and, where the task has one, checked by its rule."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import ray
import torch

from rlhf_ray.algorithms.experience import pack_rollouts
from rlhf_ray.config.ppo_job import PPOJob
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.envs.episode import EPISODE_COLUMNS, episode_metrics
from rlhf_ray.functions import column_arguments
from rlhf_ray.jobs.held_out import Answered, Evaluation
from rlhf_ray.jobs.ppo.workers import RoleWorkers


def mean_and_error(values: Sequence[float], prompts: Sequence[int]) -> tuple[float, float]:
    """The mean of answers' scores and its standard error with each prompt's answers as one cluster: answers to one
    prompt are not independent draws (a problem the policy cannot solve fails all its samples), so a binomial error
    over every answer would understate the uncertainty; an error over prompts does not. Equal answers per prompt:
    the spread of the per-prompt means over sqrt(prompts). nan with fewer than two prompts."""
    totals: dict[int, list[float]] = {}
    for value, prompt in zip(values, prompts, strict=True):
        total = totals.setdefault(prompt, [0.0, 0])
        total[0] += value
        total[1] += 1
    mean = sum(values) / len(values)
    n = len(totals)
    if n < 2:
        return mean, float("nan")
    spread = sum((score - count * mean) ** 2 for score, count in totals.values()) * n / (n - 1)
    return mean, math.sqrt(spread) / len(values)


class Evaluator:
    def __init__(self, job: PPOJob, workers: RoleWorkers, tokenizer, tokens: TokenConventions, rows: list[dict],
                 rule=None):
        self.job, self.workers, self.tokenizer, self.tokens = job, workers, tokenizer, tokens
        self.rows, self.rule = rows, rule

    def evaluate(self) -> Evaluation:
        """Mean reward score and, with a rule, its check of the greedy answers and, with `ppo.eval_samples`, of
        sampled ones, each with its standard error over the held-out prompts (`mean_and_error`). Multi-turn: the
        episodes' turns and tool calls too. No held-out prompts: an empty Evaluation. (Small: the answers come to the
        driver, which decodes them for the rule.)"""
        if not self.rows:
            return Evaluation()
        pool, samples = self.workers.pool, self.job.ppo.eval_samples
        prompts, columns = [r["prompt_ids"] for r in self.rows], [r.get("columns", {}) for r in self.rows]
        with self._reward_model_on_every_core():
            out = Evaluation(self._score(pool.generate(prompts, seed=0, greedy=True, columns=columns)))
            if samples:
                rounds = -(-samples // self.job.generation.sampling.n_samples_per_prompt)
                out.sampled = self._score(pool.generate(prompts * rounds, seed=1, columns=columns * rounds))
        return out

    @contextlib.contextmanager
    def _reward_model_on_every_core(self):
        """In sync mode nothing else runs during the evaluation, so a CPU reward model, sized for the experience
        phase it shares with three other roles (often one thread), scores on the node's cores meanwhile."""
        placement, reward = self.job.reward.placement, self.workers.reward
        if not self.job.reward.is_model or placement.num_gpus > 0 or self.job.ppo.mode != "sync":
            yield
            return
        cores = min(int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n.get("Alive"))
        before = reward.call("set_threads", max(1, cores // placement.replicas))
        try:
            yield
        finally:
            reward.call("set_threads", before[0])

    def _score(self, samples: list[dict]) -> Answered:
        rows = self.rows
        index = [s["prompt_index"] % len(rows) for s in samples]
        batch = pack_rollouts([s["prompt_ids"] for s in samples], [s["answer_ids"] for s in samples],
                              self.tokens.pad_id, [s.get("answer_mask") for s in samples])
        batch = dataclasses.replace(batch, ended=torch.tensor([s["finished"] for s in samples]),
                                    columns=[{**rows[i].get("columns", {}), **s.get("episode", {})}
                                             for i, s in zip(index, samples)])
        scores = self.workers.scorer.reward_scores(ray.put(batch), len(samples)).float().tolist()
        out = Answered(*mean_and_error(scores, index))
        episodes = [s["episode"] for s in samples if "episode" in s]
        if episodes:  # multi-turn: how the episodes went (tool-call validity: nan when no tool was called)
            totals = {k: sum(e[k] for e in episodes) for k in EPISODE_COLUMNS}
            means = episode_metrics(totals, len(episodes))
            out.turns_per_episode, out.tool_calls_per_episode, out.tool_call_validity = (
                means["env/turns_per_episode"], means["env/tool_calls_per_episode"], means["env/tool_call_validity"])
        if self.rule is not None:
            answers = self.tokenizer.batch_decode([s["answer_ids"] for s in samples], skip_special_tokens=True)
            prompts = [rows[i]["prompt"] for i in index]
            columns = column_arguments(self.rule, batch.columns)
            verdicts = [float(v) for v in self.rule(prompts, answers, **columns)]
            out.check, out.check_se = mean_and_error(verdicts, index)
        return out
