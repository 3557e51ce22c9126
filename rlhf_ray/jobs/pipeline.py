"""(pretrain ->) SFT -> RM -> PPO (or SFT -> DPO), each stage's model feeding the next. A stage whose output is complete (its model and
summary.json exist) is not run again, so a pipeline interrupted in stage k resumes at stage k."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

from rlhf_ray.config.jobs import FINAL_MODEL_DIR, JobBase, PipelineJob

log = logging.getLogger(__name__)
NOT_IMPLEMENTED = "not implemented in this version"


def stage_runners() -> dict[str, Callable[[JobBase], dict]]:
    from rlhf_ray.jobs.dpo import run_dpo
    from rlhf_ray.jobs.ppo import run_ppo
    from rlhf_ray.jobs.pretrain import run_pretrain
    from rlhf_ray.jobs.supervised import run_supervised

    return {"pretrain": run_pretrain, "sft": run_supervised, "rm": run_supervised, "dpo": run_dpo, "ppo": run_ppo}


def completed_summary(stage: JobBase) -> dict | None:
    out = Path(stage.output_dir)
    if (out / FINAL_MODEL_DIR / "config.json").is_file() and (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text())
    return None


def run_pipeline(job: PipelineJob) -> dict:
    runners = stage_runners()
    summary: dict[str, dict] = {}
    for stage in job.stages():
        done = completed_summary(stage)
        if done is not None:
            log.info("%s: already complete in %s, reusing it (delete the folder to run it again)",
                     stage.kind, stage.output_dir)
            summary[stage.kind] = {**done, "reused": True}
        elif stage.kind in runners:
            summary[stage.kind] = runners[stage.kind](stage)
        else:
            summary[stage.kind] = {"status": NOT_IMPLEMENTED}
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
