"""(pretrain ->) SFT (-> warm-up) -> RM -> PPO (or SFT -> DPO), each stage's model feeding the next. A stage whose
output is complete (its model and summary.json exist) is not run again, so a pipeline interrupted in stage k
resumes at stage k."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhf_ray.config.jobs import FINAL_MODEL_DIR, JobBase
from rlhf_ray.config.pipeline_job import ANSWERS_FILE, PipelineJob
from rlhf_ray.jobs.kinds import run_job
from rlhf_ray.jobs.teacher_answers import check_same_tokenizer, sample_answers
from rlhf_ray.models.sources import resolve_model_sources

log = logging.getLogger(__name__)


def completed_summary(stage: JobBase) -> dict | None:
    out = Path(stage.output_dir)
    if (out / FINAL_MODEL_DIR / "config.json").is_file() and (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text())
    return None


@dataclass(frozen=True)
class TeacherAnswers:
    """The summary's `warmup.teacher_answers`: the answers the warm-up trains on and their tokens (the teacher's
    cost of the warm-up); of a fresh sample also the prompts asked, the answers cut at max_new_tokens and the
    engine (None when the file of an earlier run is `reused`: it records only the answers)."""

    answers: int
    tokens: int
    reused: bool
    prompts: int | None = None
    unfinished: int | None = None
    engine: str | None = None


def teacher_answers(job: PipelineJob, sample: bool) -> TeacherAnswers | None:
    """What the warm-up trains on: the teacher's answers to `warmup.prompts` of the PPO stage's training prompts,
    sampled on the cluster when the file is not there and `sample`; a file written earlier is kept (it is written
    whole or not at all)."""
    warmup = job.warmup
    path = Path(warmup.output_dir) / ANSWERS_FILE
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        log.info("warmup: the teacher's answers in %s are there, reusing them (delete the file to sample again)", path)
        return TeacherAnswers(answers=len(rows), tokens=sum(r["tokens"] for r in rows), reused=True)
    if not sample:
        return None
    ppo = resolve_model_sources(job.ppo)
    check_same_tokenizer(ppo.teacher.model, resolve_model_sources(warmup).model, "the student (warmup.model)")
    written = sample_answers(ppo, ppo.teacher.model, path, warmup.prompts, warmup.keep_unfinished)
    log.info("warmup: %d teacher answers (%d tokens) to %d prompts in %s; %d cut at max_new_tokens %s",
             written.kept, written.tokens, written.prompts, path, written.unfinished,
             "kept" if warmup.keep_unfinished else "dropped")
    return TeacherAnswers(answers=written.kept, tokens=written.tokens, reused=False, prompts=written.prompts,
                          unfinished=written.unfinished, engine=written.engine)


def run_pipeline(job: PipelineJob) -> dict:
    summary: dict[str, dict] = {}
    for name, stage in job.named_stages().items():
        done = completed_summary(stage)
        answers = teacher_answers(job, sample=done is None) if name == "warmup" else None
        if done is not None:
            log.info("%s: already complete in %s, reusing it (delete the folder to run it again)",
                     name, stage.output_dir)
            summary[name] = {**done, "reused": True}
        else:
            summary[name] = run_job(stage)
        if answers is not None:
            summary[name]["teacher_answers"] = asdict(answers)
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
