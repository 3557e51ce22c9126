"""SFT and reward-model jobs: one DeepSpeed learner group trained on a tokenised phase of the data.

    data   = build_phase_data(...)                  # before any actor starts: bad data fails fast
    group  = start_learner_group(...)                # N ranks, one process group, engines built together
    resume from the newest complete checkpoint, if any
    for step: group.train_step(step)                 # every rank, every step: ZeRO steps are collectives
    evaluate, export the HF model, write summary.json
    a rank that dies: everything starts again from the newest checkpoint (cluster.learner_restarts times)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Callable

import ray
from tqdm import tqdm

from rlhf_ray.config.jobs import FINAL_MODEL_DIR, RMJob, SFTJob, _LearnerJob, _SupervisedJob
from rlhf_ray.data.build import build_phase_data
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.jobs.checkpoints import Checkpoints
from rlhf_ray.jobs.metrics import MetricsLogger
from rlhf_ray.jobs.restarts import learner_deaths_explained, placed_attempts
from rlhf_ray.learners.learner_group import start_learner_group
from rlhf_ray.learners.resharding import load_group_checkpoint
from rlhf_ray.learners.reward import RewardLearner
from rlhf_ray.learners.schedule import steps_per_epoch
from rlhf_ray.learners.sft import SFTLearner
from rlhf_ray.models.loading import load_tokenizer
from rlhf_ray.models.sources import resolve_model_sources
from rlhf_ray.models.support import model_problems

log = logging.getLogger(__name__)


def total_steps(job: _LearnerJob, num_samples: int) -> int:
    per_epoch = steps_per_epoch(num_samples, job.global_batch_size)
    if per_epoch == 0:
        raise ValueError(f"{num_samples} training samples do not fill one global batch of {job.global_batch_size}; "
                         f"lower train.global_batch_size or add data")
    return job.train.max_steps or max(1, math.ceil(per_epoch * job.train.epochs))


def learner_kwargs(job: _LearnerJob, pad_token_id: int) -> dict:
    kwargs = dict(model=job.model.model_dump(), optim=job.optim.model_dump(), deepspeed=job.deepspeed.model_dump(),
                  micro_batch_size=job.train.micro_batch_size, seed=job.seed, pad_token_id=pad_token_id,
                  global_batch_size=job.global_batch_size, eval_batch_size=job.train.eval_batch_size)
    if isinstance(job, RMJob):
        kwargs["loss"] = job.loss
    return kwargs


def resolved(job: _LearnerJob):
    """Before Ray starts: the job with its model sources resolved and checked, its output folder (created), the
    model's tokenizer and token conventions."""
    job = resolve_model_sources(job)
    if problems := model_problems(job):
        raise ValueError("; ".join(f"{field}: {problem}" for field, problem in problems))
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(job.model)
    return job, out, tokenizer, TokenConventions.from_tokenizer(tokenizer, job.model.path)


def prepared(job: _SupervisedJob, phase: str, **data_options):
    """`resolved`, plus the tokenised `phase` data (bad data fails here; held-out samples cut to
    `train.eval_max_samples`) and the number of optimizer steps."""
    job, out, tokenizer, tokens = resolved(job)
    data = build_phase_data(job.data, tokenizer, phase, job.seed, job.data.cache_dir or out / "data_cache",
                            tokens=tokens, **data_options)
    limit = job.train.eval_max_samples
    if limit is not None and len(data.eval) > limit:
        cut = f"{data.report['eval']}; evaluated on the first {limit} (train.eval_max_samples)"
        data = dataclasses.replace(data, eval=data.eval[:limit], report={**data.report, "eval": cut})
    return job, out, tokens, data, total_steps(job, len(data.train))


def run_supervised(job: SFTJob | RMJob, stop_after: int | None = None) -> dict:
    """Train, evaluate, export and summarise. With `stop_after`, checkpoint at that step and return early
    (for time-sliced or preemptible clusters): running the same job again resumes there."""
    phase, learner_cls = ("sft", SFTLearner) if isinstance(job, SFTJob) else ("rm", RewardLearner)
    started = time.time()
    job, out, tokens, data, steps = prepared(job, phase, train_on_prompt=job.train.train_on_prompt,
                                             packing=job.train.packing)
    result = run_learner_group(job, phase, learner_cls, steps, stop_after, learner_kwargs(job, tokens.pad_id),
                               feed=lambda learners: learners.call("set_data", ray.put(data.train), ray.put(data.eval)))
    if "stopped_at_step" in result:
        return result
    summary = _summary(phase, result["first_eval"], result["last_eval"], steps, len(data.train),
                       time.time() - started, data.report)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def run_learner_group(job: _LearnerJob, phase: str, learner_cls: type, steps: int, stop_after: int | None,
                      learner_args: dict, feed: Callable | None = None) -> dict:
    """One learner group on its placement trains the job's steps (train_steps), restarted from the newest checkpoint
    when a rank dies (cluster.learner_restarts times). `feed(learners)` hands the ranks their data once they
    started."""
    out = Path(job.output_dir)
    checkpoints = Checkpoints(out, job.checkpoint.keep_last)
    metrics = MetricsLogger(out, job.logging, run_name=f"{phase}-{out.name}")

    def attempt(job, placements: dict, plan, restarts: int) -> dict:
        learners = None
        try:
            placement, bundles = plan.role_slots("learner")
            learners = start_learner_group(learner_cls, f"{phase}-learner", job.placement, placements[placement],
                                           bundles, job.cluster, steps, **learner_args)
            if feed is not None:
                feed(learners)
            with learner_deaths_explained(checkpoints, (f"{phase}-learner",)):
                return train_steps(job, phase, learners, checkpoints, metrics, steps, stop_after, restarts, out)
        finally:
            if learners is not None:
                learners.kill()

    return placed_attempts(job, checkpoints, metrics, attempt)


def train_steps(job: _LearnerJob, phase: str, learners, checkpoints: Checkpoints, metrics: MetricsLogger,
                steps: int, stop_after: int | None, restarts: int, out: Path,
                before_step: Callable[[int], None] | None = None) -> dict:
    """The steps from the newest checkpoint (or the start) to the end or `stop_after`; the first and last
    evaluations, or where it stopped. `before_step(step)` runs before each step's collective (DPO's on-the-fly
    reference)."""
    start, first_eval = _resume(job, checkpoints, learners)
    metrics.rewind(start if first_eval is not None else -1)  # steps to be redone (or a previous run's)
    if first_eval is None:
        first_eval = learners.call("evaluate")[0]
        metrics.log(0, first_eval)
    last_eval = first_eval
    end = min(steps, stop_after) if stop_after is not None else steps
    bar = tqdm(range(start, end), desc=f"{phase} train", initial=start, total=steps,
               disable=not job.logging.progress)
    for step in bar:
        if before_step is not None:
            before_step(step)
        began = time.perf_counter()
        result = learners.call("train_step", step)[0]
        result["step_s"] = time.perf_counter() - began
        if "input_tokens" in result:
            result["tokens_per_s"] = result["input_tokens"] / result["step_s"]
        bar.set_postfix(loss=f"{result['loss']:.4f}",
                        **({"tok/s": f"{result['tokens_per_s']:.0f}"} if "tokens_per_s" in result else {}))
        if (step + 1) % job.logging.log_every_steps == 0:
            metrics.log(step + 1, {**{f"train/{k}": v for k, v in result.items()},
                                   "actors/learner_restarts": restarts})
        if job.train.eval_every_steps and (step + 1) % job.train.eval_every_steps == 0:
            last_eval = learners.call("evaluate")[0]
            metrics.log(step + 1, last_eval)
        if job.checkpoint.every_steps and (step + 1) % job.checkpoint.every_steps == 0:
            _save(checkpoints, learners, step + 1, first_eval)
    if end < steps:
        if not (job.checkpoint.every_steps and end % job.checkpoint.every_steps == 0):
            _save(checkpoints, learners, end, first_eval)
        return {"phase": phase, "stopped_at_step": end, "steps": steps}
    if not (job.train.eval_every_steps and steps % job.train.eval_every_steps == 0 and steps > start):
        last_eval = learners.call("evaluate")[0]
        metrics.log(steps, last_eval)
    if job.checkpoint.every_steps == 0 or steps % job.checkpoint.every_steps:
        _save(checkpoints, learners, steps, first_eval)
    learners.call("export_hf", str(out / FINAL_MODEL_DIR))
    return {"first_eval": first_eval, "last_eval": last_eval}


def _resume(job: _LearnerJob, checkpoints: Checkpoints, learners) -> tuple[int, dict | None]:
    latest = checkpoints.resumable(job.checkpoint.resume)
    if latest is None:
        return 0, None
    state = Checkpoints.state(latest)
    load_group_checkpoint(learners, latest, "learner")
    log.info("resumed from %s (step %d)", latest, state["step"])
    return state["step"], state.get("first_eval")


def _save(checkpoints: Checkpoints, learners, step: int, first_eval: dict) -> None:
    staging = checkpoints.staging(step)
    learners.call("save_checkpoint", str(staging), {"step": step})
    checkpoints.commit(staging, step, {"first_eval": first_eval})


def _summary(phase: str, first: dict, last: dict, steps: int, samples: int, seconds: float,
             report: dict) -> dict:
    summary = {"phase": phase, "steps": steps, "train_samples": samples, "seconds": round(seconds, 2),
               "data_report": report}
    if phase == "sft":
        summary.update(eval_loss_first=first["eval_loss"], eval_loss_last=last["eval_loss"],
                       eval_perplexity=last["eval_perplexity"], eval_perplexity_first=first["eval_perplexity"])
    else:
        summary.update(eval_accuracy=last["eval_accuracy"], eval_accuracy_first=first["eval_accuracy"],
                       eval_chosen_mean=last["eval_chosen_mean"], eval_rejected_mean=last["eval_rejected_mean"],
                       eval_loss_first=first["eval_loss"], eval_loss_last=last["eval_loss"])
    return summary
