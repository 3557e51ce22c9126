"""Every job kind, by its `kind:` (the loader's discriminator). Adding a kind: its config class here; see JobBase for
what the class names (its runner, CLI help, memory function)."""

from __future__ import annotations

from rlhf_ray.config.jobs import DPOJob, JobBase, PretrainJob, RMJob, SFTJob
from rlhf_ray.config.pipeline_job import PipelineJob
from rlhf_ray.config.ppo_job import PPOJob

JOB_KINDS: dict[str, type[JobBase]] = {cls.model_fields["kind"].default: cls for cls in (
    PretrainJob, SFTJob, RMJob, DPOJob, PPOJob, PipelineJob)}
