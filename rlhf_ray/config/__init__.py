"""Pydantic models for every YAML option: the single source of truth for names, types and defaults."""

from rlhf_ray.config.base import FieldProblem, StrictModel
from rlhf_ray.config.data import DataSpec, DatasetSpec
from rlhf_ray.config.deepspeed import DeepSpeedSpec
from rlhf_ray.config.dpo import DPOReferenceSpec, DPOSpec
from rlhf_ray.config.generation import GenerationSpec, HfEngineSpec, SamplingSpec, VllmSpec
from rlhf_ray.config.jobs import FINAL_MODEL_DIR, DPOJob, JobBase, PretrainJob, RMJob, SFTJob, TrainLoopSpec, TrainSpec
from rlhf_ray.config.kinds import JOB_KINDS
from rlhf_ray.config.pipeline_job import PipelineJob
from rlhf_ray.config.ppo_job import InferenceRoleSpec, LearnerRoleSpec, PPOJob, RewardRoleSpec
from rlhf_ray.config.loader import ConfigError, ConfigSource, job_schema, load_job, validate_job
from rlhf_ray.config.model import LoraSpec, ModelSpec
from rlhf_ray.config.optim import OptimizerSpec
from rlhf_ray.config.placement import ClusterSpec, NodeShape, PlacementSpec
from rlhf_ray.config.ppo import EmaSpec, PPOSpec
from rlhf_ray.config.pretrain import CorpusSpec, PretrainDataSpec
from rlhf_ray.config.run import CheckpointSpec, LoggingSpec

__all__ = [
    "FieldProblem", "StrictModel", "DataSpec", "DatasetSpec", "DeepSpeedSpec", "DPOJob", "DPOReferenceSpec", "DPOSpec",
    "GenerationSpec", "HfEngineSpec",
    "SamplingSpec", "VllmSpec", "FINAL_MODEL_DIR", "JOB_KINDS", "InferenceRoleSpec", "JobBase", "LearnerRoleSpec",
    "PipelineJob", "PPOJob", "PretrainJob", "TrainLoopSpec", "CorpusSpec", "PretrainDataSpec", "RewardRoleSpec", "RMJob", "SFTJob", "TrainSpec", "ConfigError", "ConfigSource",
    "job_schema", "load_job", "validate_job", "LoraSpec", "ModelSpec", "OptimizerSpec", "ClusterSpec", "NodeShape",
    "PlacementSpec", "EmaSpec", "PPOSpec", "CheckpointSpec", "LoggingSpec",
]
