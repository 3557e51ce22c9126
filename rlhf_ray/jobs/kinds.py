"""Running a job of any kind: the function its config class names (config/jobs.py, JobBase.runner)."""

from __future__ import annotations

from collections.abc import Callable

from rlhf_ray.config.jobs import JobBase
from rlhf_ray.config.kinds import JOB_KINDS
from rlhf_ray.functions import load_function


def runner(kind: str) -> Callable[..., dict]:
    """The function that runs a `kind` job: `runner(kind)(job)` returns its summary."""
    return load_function(JOB_KINDS[kind].runner)


def run_job(job: JobBase, stop_after: int | None = None) -> dict:
    """Run `job`; with `stop_after` (kinds whose steps resume), checkpoint at that step and return."""
    if stop_after is None:
        return runner(job.kind)(job)
    return runner(job.kind)(job, stop_after=stop_after)
