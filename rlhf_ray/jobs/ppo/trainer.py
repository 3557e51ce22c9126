"""The PPO loop, as docs/architecture.md draws it: generate -> score on every role -> advantages -> into the replay
buffer, the oldest fresh experience out -> PPO epochs on policy and critic -> the new weights to the engines; then
log, evaluate, checkpoint. Each part owns its state: the role workers (workers.py), the scorer (scoring.py), the
rollout feed (rollouts.py), the weight sync (weight_sync.py) and the evaluation (evaluation.py)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_ray.config.jobs import EMA_MODEL_DIR, FINAL_MODEL_DIR
from rlhf_ray.config.ppo_job import PPOJob
from rlhf_ray.data.build import PhaseData
from rlhf_ray.jobs.checkpoints import Checkpoints
from rlhf_ray.jobs.alerts import Diagnostics
from rlhf_ray.jobs.held_out import Evaluation
from rlhf_ray.jobs.metrics import SAMPLES_FILE, MetricsLogger, write_samples
from rlhf_ray.jobs.ppo.best_model import BestModel
from rlhf_ray.jobs.ppo.evaluation import Evaluator
from rlhf_ray.jobs.ppo.iteration_metrics import iteration_metrics
from rlhf_ray.jobs.ppo.rollouts import RolloutFeed, Taken
from rlhf_ray.jobs.ppo.scoring import ResultsLost
from rlhf_ray.jobs.ppo.weight_sync import WeightSync
from rlhf_ray.jobs.ppo.workers import RoleWorkers
from rlhf_ray.jobs.progress import Progress

log = logging.getLogger(__name__)


@dataclass
class Attempt:
    """What an attempt of the job shares with the attempts before it (after a learner died, every role restarts
    from the newest checkpoint): where the metrics and checkpoints go, when the job started, how many times the
    learners were restarted, and where to stop early (`stop_after`: checkpoint at that iteration and return)."""

    metrics: MetricsLogger
    checkpoints: Checkpoints
    started: float = field(default_factory=time.time)
    learner_restarts: int = 0
    stop_after: int | None = None


class PPOTrainer:
    def __init__(self, job: PPOJob, workers: RoleWorkers, data: PhaseData, tokenizer, attempt: Attempt, rule=None):
        """`rule`: the held-out accuracy check (jobs/ppo/job.py:accuracy_rule), None for none."""
        ppo = job.ppo
        self.job, self.workers, self.tokenizer = job, workers, tokenizer
        self.metrics, self.checkpoints = attempt.metrics, attempt.checkpoints
        self.learner_restarts, self.started = attempt.learner_restarts, attempt.started
        self.end = ppo.iterations if attempt.stop_after is None else min(ppo.iterations, attempt.stop_after)
        self.weights = WeightSync(job, workers)
        self.rollouts = RolloutFeed.for_job(job, workers, data.train)
        self.evaluator = Evaluator(job, workers, tokenizer, workers.tokens, data.eval[: ppo.eval_prompts], rule)
        self.best = BestModel(Path(job.output_dir), ppo.keep_best,
                              lambda folder: workers.policy.call("export_hf", folder))
        self.before = Evaluation()
        self.watch = self.diagnostics()

    def fit(self) -> dict:
        """From the newest checkpoint (or the start) to the end of the job, or to `stop_after`."""
        start = self.start()
        progress = Progress(self.job.ppo.iterations, start, self.job.samples_per_iteration, self.job.logging.progress)
        progress.evaluated(0, self.before)
        for step in range(start, self.end):
            taken, metrics = self.iterate(step)
            self.log(step + 1, metrics, taken)
            progress.update(step + 1, metrics)
            self.maybe_evaluate(step + 1, progress)
            self.maybe_checkpoint(step + 1)
        progress.close()
        return self.finish()

    def iterate(self, step: int) -> tuple[Taken, dict[str, float]]:
        """One update, the method's phases in order. The feed hands out the rollouts to score before this update
        (sync mode: the one rollout sampled with the current weights; async: as far ahead as the mode allows, the
        next ones generating meanwhile). The buffer gives the oldest fresh experience; None when it refused all it
        held as too stale, and a rollout is generated for this update."""
        began, version, scorer = time.perf_counter(), self.weights.version, self.workers.scorer
        taken = None
        while taken is None:
            for index, rollout in self.rollouts.generated(updates_left=self.end - step):  # 1. generate
                try:
                    scores = scorer.score(rollout)  # 2. reward, reference and old log-probs, values
                    experience = scorer.advantages(scores, version)  # 3. advantages (algorithms/advantages.py)
                except ResultsLost as lost:  # a node took results with it: the same rollout is generated again
                    self.rollouts.redo(index, lost)
                    continue
                self.rollouts.put(index, rollout, experience, version)
            taken = self.rollouts.take(version)
        trained = self.workers.train(taken.minibatches, policy=step >= self.job.ppo.critic_warmup)  # 4. PPO epochs
        if trained.steps_applied:
            synced = self.weights.sync()  # 5. the new weights to the engines: policy version + 1
        else:
            synced = self.weights.unchanged(taken.minibatches, trained)
        self.workers.pool.grow()  # an elastic pool: engines on nodes that made room, given these weights first
        return taken, iteration_metrics(taken, trained, synced, time.perf_counter() - began,
                                        len(self.workers.pool.group), len(self.workers.restarts.replaced),
                                        self.learner_restarts)

    # ---- around the loop ------------------------------------------------------------------------------------------
    def start(self) -> int:
        """Resume from the newest checkpoint: weights, optimizer, policy version, the next rollout; or evaluate the
        starting policy. Returns the first step to run."""
        latest = self.checkpoints.resumable(self.job.checkpoint.resume)
        if latest is None:
            self.metrics.rewind(-1)  # a fresh start: lines a previous run left in this output_dir are not this run's
            self.best.start_fresh()  # and so is a best model
            self.before = self.evaluator.evaluate()
            self.metrics.log(0, eval_line(self.before) | Diagnostics.opening(self.before))
            self.best.consider(0, self.before.metrics())
            first = 0
        else:
            state = Checkpoints.state(latest)
            self.workers.restore(latest)
            self.weights.version = state["policy_version"]
            self.weights.sync(bump=False)
            self.before, first = Evaluation.of(state["eval_before"]), state["step"]
            self.rollouts.resume_at(state.get("rollout", first))  # rollouts after the last trained on: generated again
            self.best.resume(state.get("best"))
            log.info("resumed PPO from %s (iteration %d, policy version %d)", latest, first, self.weights.version)
            self.metrics.rewind(first)  # the iterations after the checkpoint are redone: their old lines go
        self.watch = self.diagnostics()
        return first

    def diagnostics(self) -> Diagnostics:
        ppo = self.job.ppo
        return Diagnostics(self.before, ppo.entropy_warning_ratio, ppo.hacking_warning_evaluations,
                           check=ppo.accuracy_function or "the dataset's rule")

    def log(self, step: int, metrics: dict[str, float], taken: Taken) -> None:
        if step % self.job.logging.log_every_steps == 0:
            self.metrics.log(step, metrics)
            write_samples(Path(self.job.output_dir) / SAMPLES_FILE, step, taken.put.scored.experience.samples,
                          self.tokenizer)
        self.watch.iteration(step, metrics)

    def maybe_evaluate(self, step: int, progress: Progress) -> None:
        every = self.job.ppo.eval_every
        if every and step % every == 0 and step < self.job.ppo.iterations:  # the last one: in finish()
            now = self.evaluator.evaluate()
            self.metrics.log(step, eval_line(now) | self.watch.evaluation(step, now))
            progress.evaluated(step, now)
            self.best.consider(step, now.metrics())

    def maybe_checkpoint(self, step: int) -> None:
        every = self.job.checkpoint.every_steps
        if (every and step % every == 0) or step == self.end:
            staging = self.checkpoints.staging(step)
            self.workers.save(staging, step)
            self.checkpoints.commit(staging, step, {"policy_version": self.weights.version,
                                                    "eval_before": self.before.metrics(),
                                                    "rollout": self.rollouts.next_after_taken,
                                                    "best": self.best.state()})

    def finish(self) -> dict:
        """Evaluate the trained policy, export it, write summary.json (a run stopped early: only where it stopped)."""
        iterations = self.job.ppo.iterations
        if self.end < iterations:
            return {"stopped_at_iteration": self.end, "iterations": iterations}
        after = self.evaluator.evaluate()
        self.metrics.log(iterations, eval_line(after) | self.watch.evaluation(iterations, after))
        self.best.consider(iterations, after.metrics())
        out = Path(self.job.output_dir)
        self.workers.policy.call("export_hf", str(out / FINAL_MODEL_DIR))
        if self.job.ppo.ema.enabled:
            self.workers.policy.call("export_ema", str(out / EMA_MODEL_DIR))
        before, after = self.before.metrics(), after.metrics()
        summary = {"iterations": iterations, "seconds": round(time.time() - self.started, 2),
                   "reward_before": before.get("reward"), "reward_after": after.get("reward"),
                   "eval_prompts": len(self.evaluator.rows), "weight_sync": self.weights.transport,
                   "peak_memory_gib": {role: round(n / 2**30, 4) for role, n in self.workers.peak_memory().items()}}
        if self.best.metric is not None:
            summary["best"] = self.best.state()
        for key in sorted(before.keys() - {"reward"}):  # task accuracy, sampled_*, episodes' turns and tool calls
            summary.update({f"{key}_before": before[key], f"{key}_after": after[key]})
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def eval_line(evaluation: Evaluation) -> dict[str, float]:
    """An evaluation's metrics line: eval/reward, eval/task_accuracy, eval/sampled_reward, ..."""
    return {f"eval/{name}": value for name, value in evaluation.metrics().items()}
