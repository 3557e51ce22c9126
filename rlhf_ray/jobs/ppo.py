"""The PPO job: the loop over iterations, readable as the RL dataflow (the operations are in ppo_run.py).

    feed (rollout_feed.py), before each update:
        rollout    = generation_pool.collect(oldest started)      # references to samples, tagged with a version
        generation_pool.submit(next prompts)                      # async: up to rollouts_ahead generate meanwhile
        experience = run.experience(rollout)                      # policy / reference / critic / reward in parallel
        buffer.put(experience)                                    # capacity: the oldest is evicted
    plan = buffer.take(version)                                   # staleness bound, mini-batch plan
    in parallel: policy.train(plan)   critic.train(plan)
    generation_pool.broadcast(policy weights)                     # version += 1
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

from tqdm import tqdm

from rlhf_ray import cluster
from rlhf_ray.config.jobs import EMA_MODEL_DIR, FINAL_MODEL_DIR, PPOJob
from rlhf_ray.actors.http_reward import HttpReward
from rlhf_ray.functions import RewardFunctionError, column_arguments, load_function
from rlhf_ray.envs.episode import EPISODE_COLUMNS
from rlhf_ray.data.build import build_phase_data
from rlhf_ray.data.registry import task_rule
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.jobs.checkpoints import Checkpoints
from rlhf_ray.jobs.diagnostics import Diagnostics
from rlhf_ray.jobs.preflight import check_corpora
from rlhf_ray.jobs.metrics import SAMPLES_FILE, MetricsLogger, write_samples
from rlhf_ray.jobs.ppo_run import PPORun, merged_metrics, sharded_roles
from rlhf_ray.jobs.rollout_feed import RolloutFeed
from rlhf_ray.jobs.restarts import learner_deaths_explained, with_learner_restarts
from rlhf_ray.jobs.threads import with_turn_threads
from rlhf_ray.learners.schedule import micro_batches
from rlhf_ray.models.loading import load_tokenizer
from rlhf_ray.models.sources import resolve_model_sources
from rlhf_ray.models.support import model_problems
from rlhf_ray.plan import ResourcePlan

log = logging.getLogger(__name__)


def check_inputs(job: PPOJob) -> None:
    """Files the job reads besides its models, checked before any actor starts (the CLI's pre-flight checks do the
    same and more; this covers callers of run_ppo)."""
    if problems := list(check_corpora(job)):
        raise ValueError("; ".join(f"{'.'.join(loc)}: {what}" for loc, what in problems))


def run_ppo(job: PPOJob, stop_after: int | None = None) -> dict:
    """Run the PPO job; with `stop_after`, checkpoint after that iteration and return (run again to resume)."""
    check_inputs(job)
    job = resolve_model_sources(job)
    if problems := model_problems(job):
        raise ValueError("; ".join(f"{field}: {problem}" for field, problem in problems))
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(job.policy.model)
    tokens = TokenConventions.from_tokenizer(tokenizer, job.policy.model.path)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, job.data.cache_dir or out / "data_cache",
                            tokens=tokens)
    eval_rows = data.eval[: job.ppo.eval_prompts]
    if job.reward.function:  # a function that needs a column the data lacks fails here, before Ray starts
        episode = dict.fromkeys(EPISODE_COLUMNS, 0) if job.generation.environment else {}  # the engines add these
        column_arguments(load_function(job.reward.function), [{**r["columns"], **episode} for r in data.train[:1]])
    if job.reward.http:  # a server that is down or speaks another protocol fails here, before Ray starts
        HttpReward(job.reward.http).check()
    rule = accuracy_rule(job, eval_rows[:1])
    metrics = MetricsLogger(out, job.logging, run_name=f"ppo-{out.name}")
    checkpoints = Checkpoints(out, job.checkpoint.keep_last)
    started = time.time()
    with cluster.connect(job.cluster) as handle, contextlib.closing(metrics):
        job = with_turn_threads(job, min(int(node.get("CPU", 1)) for node in handle.nodes()))
        plan = ResourcePlan.from_roles(job.placement_roles())

        def attempt(restarts: int) -> dict:
            groups, run = cluster.place(plan, handle.nodes(), job.cluster.startup_timeout_s), None
            try:
                run = PPORun(job, plan, groups, tokenizer, tokens)
                run.learner_restarts = restarts
                with learner_deaths_explained(checkpoints, learner_groups(job)):
                    return _train(job, run, data, eval_rows, rule, metrics, checkpoints, stop_after, started, out)
            finally:
                if run is not None:
                    run.kill()
                cluster.remove(groups)

        return with_learner_restarts(job.cluster.learner_restarts, checkpoints, attempt)


def learner_groups(job: PPOJob) -> tuple[str, ...]:
    """The roles whose ranks form a ZeRO group (a dead rank ends the attempt): the learners and sharded roles."""
    return ("policy", "critic", *sharded_roles(job))


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
    return task_rule(job.data.datasets[0].name) if len(job.data.datasets) == 1 else None


def iteration_metrics(scored: dict, trained: dict, wait: float, elapsed: float, engines: int) -> dict[str, float]:
    """One update's line: the metrics of the experience it trained on (`scored`, from when it was put in the
    buffer) and of the update itself (`trained`), with the iteration's timing."""
    out = merged_metrics(scored, trained)
    compute = out["time/engine_generate"] + sum(out[f"compute/{part}_seconds"] for part in ("experience", "train",
                                                                                            "sync"))
    busy = out["time/engine_busy"]  # summed over engines
    return out | {"time/generate_wait": wait, "time/iteration": elapsed,
                  "time/orchestration_fraction": max(0.0, elapsed - compute) / elapsed,
                  "generate/tokens_per_s": out["generate/tokens"] / max(out["time/engine_generate"], 1e-9),
                  "generate/engine_utilisation": busy / (engines * elapsed)}


def _train(job, run, data, eval_rows, rule, metrics, checkpoints, stop_after, started, out) -> dict:
    """The iterations, from the newest checkpoint (or the start) to the end or `stop_after`."""
    latest = checkpoints.resumable(job.checkpoint.resume)
    if latest is not None:
        state = run.restore(latest)
        start, before = state["step"], state["eval_before"]
        first_rollout = state.get("rollout", start)  # rollouts after the last one trained on are generated again
        log.info("resumed PPO from %s (iteration %d, policy version %d)", latest, start, run.version)
        metrics.rewind(start)  # the iterations after the checkpoint are redone: their old lines go
    else:
        metrics.rewind(-1)  # a fresh start: lines a previous run left in this output_dir are not this run's
        start, first_rollout, before = 0, 0, run.evaluate(eval_rows, rule, job.ppo.eval_samples)
        metrics.log(0, {f"eval/{k}": v for k, v in before.items()})
    end = min(job.ppo.iterations, stop_after) if stop_after is not None else job.ppo.iterations

    def prompt_indices(rollout: int) -> list[int]:
        count = job.ppo.prompts_per_rollout  # rollout_batch_size, more with dynamic sampling
        (indices,) = micro_batches(len(data.train), count, count, 1, 0, rollout, job.seed)
        return list(indices)

    def submit(rollout: int):
        rows = [data.train[i] for i in prompt_indices(rollout)]
        return run.pool.submit([r["prompt_ids"] for r in rows], run.rollout_seed(rollout),
                               [r["columns"] for r in rows])

    watch = Diagnostics(before, job.ppo.entropy_warning_ratio)
    bar = tqdm(range(start, end), desc="ppo", initial=start, total=job.ppo.iterations,
               disable=not job.logging.progress)
    ahead = job.ppo.rollouts_ahead if job.ppo.mode == "async" else 0
    feed = RolloutFeed(run, prompt_indices, submit, ahead, first_rollout, job.cluster.max_actor_restarts)
    engines = len(run.pool.group)
    for iteration in bar:
        began = time.perf_counter()
        plan = None
        while plan is None:  # the buffer may refuse everything it holds as too stale: then put more
            feed.fill(end - iteration)
            plan, trained = run.update()
            scored = feed.taken(plan.meta.rollout if plan else None, plan.stats["buffer/entries"] if plan else 0)
        elapsed, last = time.perf_counter() - began, iteration + 1 == end
        result = iteration_metrics(scored, trained, feed.wait_seconds, elapsed, engines)
        feed.wait_seconds = 0.0
        bar.set_postfix(reward=f"{result['reward/mean']:.3f}", kl=f"{result['kl/mean']:.3f}")
        if (iteration + 1) % job.logging.log_every_steps == 0:
            metrics.log(iteration + 1, result)
            write_samples(out / SAMPLES_FILE, iteration + 1, run.recent_samples, run.tokenizer)
        watch.iteration(iteration + 1, result)
        if job.ppo.eval_every and (iteration + 1) % job.ppo.eval_every == 0 and iteration + 1 < job.ppo.iterations:
            now = run.evaluate(eval_rows, rule, job.ppo.eval_samples)
            metrics.log(iteration + 1, {f"eval/{k}": v for k, v in now.items()} | watch.evaluation(iteration + 1, now))
        every = job.checkpoint.every_steps
        if (every and (iteration + 1) % every == 0) or last:
            run.save(checkpoints, iteration + 1, {"eval_before": before, "rollout": plan.meta.rollout + 1})
    if end < job.ppo.iterations:
        return {"stopped_at_iteration": end, "iterations": job.ppo.iterations}
    after = run.evaluate(eval_rows, rule, job.ppo.eval_samples)
    metrics.log(job.ppo.iterations,
                {f"eval/{k}": v for k, v in after.items()} | watch.evaluation(job.ppo.iterations, after))
    run.policy.call("export_hf", str(out / FINAL_MODEL_DIR))
    if job.ppo.ema.enabled:
        run.policy.call("export_ema", str(out / EMA_MODEL_DIR))
    summary = {"iterations": job.ppo.iterations, "seconds": round(time.time() - started, 2),
               "reward_before": before.get("reward"), "reward_after": after.get("reward"),
               "eval_prompts": len(eval_rows)}
    for key in sorted(before.keys() - {"reward"}):  # task accuracy, sampled_*, and the episodes' turns and tool calls
        summary.update({f"{key}_before": before[key], f"{key}_after": after[key]})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
