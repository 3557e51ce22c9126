"""(pretrain ->) SFT -> RM -> PPO (or SFT -> DPO), each stage's model feeding the next. A stage whose output is
complete (its model and summary.json exist) is not run again, so a pipeline interrupted in stage k resumes at
stage k."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rlhf_ray.config.jobs import FINAL_MODEL_DIR, JobBase
from rlhf_ray.config.pipeline_job import PipelineJob
from rlhf_ray.jobs.kinds import run_job

log = logging.getLogger(__name__)


def completed_summary(stage: JobBase) -> dict | None:
    out = Path(stage.output_dir)
    if (out / FINAL_MODEL_DIR / "config.json").is_file() and (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text())
    return None


def run_pipeline(job: PipelineJob) -> dict:
    summary: dict[str, dict] = {}
    for stage in job.stages():
        done = completed_summary(stage)
        if done is not None:
            log.info("%s: already complete in %s, reusing it (delete the folder to run it again)",
                     stage.kind, stage.output_dir)
            summary[stage.kind] = {**done, "reused": True}
        else:
            summary[stage.kind] = run_job(stage)
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
