"""Running a job of any kind: the function its config class names (config/jobs.py, JobBase.runner), then the
run's report (jobs/report.py) in its output_dir."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from rlhf_ray.config.jobs import JobBase
from rlhf_ray.config.kinds import JOB_KINDS
from rlhf_ray.functions import load_function
from rlhf_ray.jobs.report import run_folders, write_report

log = logging.getLogger(__name__)


def runner(kind: str) -> Callable[..., dict]:
    """The function that runs a `kind` job: `runner(kind)(job)` returns its summary."""
    return load_function(JOB_KINDS[kind].runner)


def run_job(job: JobBase, stop_after: int | None = None) -> dict:
    """Run `job`; with `stop_after` (kinds whose steps resume), checkpoint at that step and return. The report is
    written either way (a report that cannot be written is a warning: the run's results are kept)."""
    summary = runner(job.kind)(job) if stop_after is None else runner(job.kind)(job, stop_after=stop_after)
    out = Path(job.output_dir)
    try:
        if folders := run_folders(out):
            log.info("report: %s", write_report(folders, out))
    except Exception as exc:  # noqa: BLE001 - the job's results stand without it
        log.warning("could not write the report in %s: %s: %s", out, type(exc).__name__, exc)
    return summary
