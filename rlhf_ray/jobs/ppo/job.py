"""The PPO job: everything that can fail without Ray is checked first (inputs, models, data, reward functions and
servers, the accuracy rule); then the roles are placed and PPOTrainer.fit runs, again from the newest checkpoint
when a learner rank dies (cluster.learner_restarts times)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rlhf_ray.actors.http_reward import HttpReward, credentials
from rlhf_ray.config.ppo_job import PPOJob
from rlhf_ray.data.build import build_phase_data
from rlhf_ray.data.registry import data_rule
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.envs.episode import EPISODE_COLUMNS
from rlhf_ray.functions import RewardFunctionError, column_arguments, load_function
from rlhf_ray.jobs.checkpoints import Checkpoints
from rlhf_ray.jobs.metrics import TIMELINE_FILE, MetricsLogger, write_timeline
from rlhf_ray.jobs.ppo.trainer import Attempt, PPOTrainer
from rlhf_ray.jobs.ppo.workers import RoleWorkers, learner_groups
from rlhf_ray.jobs.preflight import check_corpora
from rlhf_ray.jobs.restarts import learner_deaths_explained, placed_attempts
from rlhf_ray.jobs.threads import with_turn_threads
from rlhf_ray.models.loading import load_tokenizer
from rlhf_ray.models.sources import resolve_model_sources
from rlhf_ray.models.support import model_problems

log = logging.getLogger(__name__)


def run_ppo(job: PPOJob, stop_after: int | None = None) -> dict:
    """Run the PPO job; with `stop_after`, checkpoint after that iteration and return (run again to resume)."""
    started = time.time()
    if problems := list(check_corpora(job)):  # the CLI's preflight checks this and more; this covers other callers
        raise ValueError("; ".join(f"{'.'.join(loc)}: {what}" for loc, what in problems))
    job = resolve_model_sources(job)
    if problems := model_problems(job):
        raise ValueError("; ".join(f"{field}: {problem}" for field, problem in problems))
    if job.generation.partial_rollouts and job.ppo.rollouts_ahead < 2:
        log.warning("partial rollouts stream only when more rollouts are in flight than one: with "
                    "ppo.rollouts_ahead 1 they measured 0.76x plain async's samples per second (docs/jobs.md, "
                    "\"Partial rollouts\"); set ppo.rollouts_ahead: 2 and ppo.max_staleness: 4")
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(job.policy.model)
    tokens = TokenConventions.from_tokenizer(tokenizer, job.policy.model.path)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, job.data.cache_dir or out / "data_cache",
                            tokens=tokens)
    if job.reward.function:  # a function that needs a column the data lacks fails here, before Ray starts
        episode = dict.fromkeys(EPISODE_COLUMNS, 0) if job.generation.environment else {}  # the engines add these
        column_arguments(load_function(job.reward.function), [{**r["columns"], **episode} for r in data.train[:1]])
    if job.reward.http:  # a server that is down or speaks another protocol fails here, before Ray starts
        HttpReward(job.reward.http, **credentials(job.reward.http)).check()
    rule = accuracy_rule(job, data.eval[: job.ppo.eval_prompts][:1])
    metrics = MetricsLogger(out, job.logging, run_name=f"ppo-{out.name}")
    checkpoints = Checkpoints(out, job.checkpoint.keep_last)

    def attempt(job: PPOJob, placements: dict, plan, restarts: int) -> dict:
        workers = None
        try:
            workers = RoleWorkers(job, plan, placements, tokenizer, tokens)
            attempt = Attempt(metrics, checkpoints, started, learner_restarts=restarts, stop_after=stop_after)
            trainer = PPOTrainer(job, workers, data, tokenizer, attempt, rule)
            with learner_deaths_explained(checkpoints, learner_groups(job)):
                return trainer.fit()
        finally:
            if job.logging.timeline:
                write_timeline(out / TIMELINE_FILE, started)
            if workers is not None:
                workers.kill()

    def fitted(job: PPOJob, nodes: list[dict]) -> PPOJob:  # roles that take turns get the node's cores meanwhile
        return with_turn_threads(job, min(int(node.get("CPU", 1)) for node in nodes))

    return placed_attempts(job, checkpoints, metrics, attempt, adapt=fitted)


def accuracy_rule(job: PPOJob, rows: list[dict]):
    """The rule behind summary.json's task accuracy: `ppo.accuracy_function`, else the dataset's own (one
    dataset only), else None. A named rule that needs a column the held-out rows lack fails here, before Ray
    starts (with no held-out rows it is never called)."""
    if job.ppo.accuracy_function:
        try:
            rule = load_function(job.ppo.accuracy_function)
            if rows:
                column_arguments(rule, [r["columns"] for r in rows])
        except (ValueError, RewardFunctionError) as exc:
            raise ValueError(f"ppo.accuracy_function: {exc}") from None
        return rule
    return data_rule(job.data.datasets)
