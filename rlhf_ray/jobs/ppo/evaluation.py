"""Held-out prompts answered by the engines, greedily (the policy's mode) and sampled with the training settings
(the distribution PPO optimises), scored by the reward role and, where the task has one, checked by its rule."""

from __future__ import annotations

import contextlib
import dataclasses

import ray
import torch

from rlhf_ray.algorithms.experience import pack_rollouts
from rlhf_ray.config.ppo_job import PPOJob
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.envs.episode import EPISODE_COLUMNS, episode_metrics
from rlhf_ray.functions import column_arguments
from rlhf_ray.jobs.ppo.workers import RoleWorkers


class Evaluator:
    def __init__(self, job: PPOJob, workers: RoleWorkers, tokenizer, tokens: TokenConventions, rows: list[dict],
                 rule=None):
        self.job, self.workers, self.tokenizer, self.tokens = job, workers, tokenizer, tokens
        self.rows, self.rule = rows, rule

    def evaluate(self) -> dict[str, float]:
        """Mean reward score and, with a rule, task accuracy of the greedy answers (`reward`, `task_accuracy`) and,
        with `ppo.eval_samples`, of sampled ones (`sampled_reward`, ...). Multi-turn: the episodes' turns and tool
        calls too. No held-out prompts: nothing to report. (Small: the answers come to the driver, which decodes
        them for the rule.)"""
        if not self.rows:
            return {}
        pool, samples = self.workers.pool, self.job.ppo.eval_samples
        prompts, columns = [r["prompt_ids"] for r in self.rows], [r.get("columns", {}) for r in self.rows]
        with self._reward_model_on_every_core():
            out = self._score(pool.generate(prompts, seed=0, greedy=True, columns=columns))
            if samples:
                rounds = -(-samples // self.job.generation.sampling.n_samples_per_prompt)
                sampled = pool.generate(prompts * rounds, seed=1, columns=columns * rounds)
                out |= {f"sampled_{k}": v for k, v in self._score(sampled).items()}
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

    def _score(self, samples: list[dict]) -> dict[str, float]:
        rows = self.rows
        batch = pack_rollouts([s["prompt_ids"] for s in samples], [s["answer_ids"] for s in samples],
                              self.tokens.pad_id, [s.get("answer_mask") for s in samples])
        batch = dataclasses.replace(batch, ended=torch.tensor([s["finished"] for s in samples]),
                                    columns=[{**rows[s["prompt_index"] % len(rows)].get("columns", {}),
                                              **s.get("episode", {})} for s in samples])
        out = {"reward": self.workers.reward_scores(ray.put(batch), len(samples)).float().mean().item()}
        episodes = [s["episode"] for s in samples if "episode" in s]
        if episodes:  # multi-turn: how the episodes went (tool-call validity: nan when no tool was called)
            totals = {k: sum(e[k] for e in episodes) for k in EPISODE_COLUMNS}
            out.update({k.removeprefix("env/"): v for k, v in episode_metrics(totals, len(episodes)).items()
                        if k != "env/episode_reward"})
        if self.rule is not None:
            answers = self.tokenizer.batch_decode([s["answer_ids"] for s in samples], skip_special_tokens=True)
            prompts = [rows[s["prompt_index"] % len(rows)]["prompt"] for s in samples]
            columns = column_arguments(self.rule, batch.columns)
            out["task_accuracy"] = sum(self.rule(prompts, answers, **columns)) / len(samples)
        return out
