"""What a job writes besides its model: logs and checkpoints."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel


class LoggingSpec(StrictModel):
    """Where metrics go. All sinks receive the same numbers."""

    log_every_steps: int = Field(1, ge=1)
    """Log metrics every N optimizer steps (PPO: iterations)."""
    tensorboard: bool = True
    """TensorBoard event files under `<output_dir>/tensorboard`."""
    ray_metrics: bool = True
    """Export metrics through Ray's metrics API (Ray dashboard, Prometheus endpoint)."""
    wandb_project: str | None = None
    """Also log to Weights & Biases when set (needs `wandb` installed and configured)."""
    wandb_run_name: str | None = None
    """W&B run name; default: the output directory name."""
    progress: bool = True
    """Show progress on the driver: PPO prints a line per iteration (iteration, reward, KL, entropy, samples/s, the
    time split, ETA; rewritten in place on a terminal, one line each in `ray job logs` or a pipe), SFT/RM/DPO a
    progress bar."""
    verbose: bool = False
    """The library logs of every actor (vLLM, DeepSpeed, torch, transformers) on the job's terminal too (Ray's
    streaming of worker output; `--verbose` on the command line). Off: each actor's output goes to
    `<output_dir>/logs/<actor>.log` (e.g. `policy-0.log`, `generation-0.log`) and the terminal shows the job's own
    lines."""
    timeline: bool = False
    """PPO: write Ray's timeline of every actor call of the run (start, end, argument and result transfers; this
    job's calls since it started, not other jobs' on the same cluster) to `<output_dir>/timeline.json` when the job
    ends, as a Chrome trace (open it in ui.perfetto.dev or chrome://tracing) to see where an iteration's time goes
    between the actors."""
    samples_per_iteration: int = Field(0, ge=0)
    """PPO: the first N rollout samples of every logged iteration (prompt, answer, reward, dataset columns) are
    appended to `<output_dir>/samples.jsonl`, to read what the policy writes and what it was scored on."""


class CheckpointSpec(StrictModel):
    """Checkpoints are written aside and renamed into place, so a crash always leaves the last good one.
    Each holds every rank's weights, optimizer and scheduler state and random generators: a resumed run continues
    exactly."""

    every_steps: int = Field(0, ge=0)
    """Save every N optimizer steps (PPO: iterations); 0 saves only at the end."""
    keep_last: int = Field(2, ge=1)
    """Older checkpoints beyond this many are deleted after a new one is complete."""
    resume: bool = True
    """Continue from the newest checkpoint in `<output_dir>/checkpoints` when one exists."""

    @model_validator(mode="before")
    @classmethod
    def _save_optimizer_is_gone(cls, data: Any) -> Any:
        # a key of earlier versions that no job ever read: a config setting it to false saved the optimizer anyway
        if isinstance(data, dict) and "save_optimizer" in data:
            raise FieldProblem("save_optimizer", "no longer a setting (it never took effect): a checkpoint always "
                                                 "holds the optimizer and scheduler state, for an exact resume; "
                                                 "remove the key")
        return data
