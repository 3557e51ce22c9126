"""What every job has (JobBase: where a job kind is registered), and the learner jobs: pretrain, SFT, RM, DPO. PPO
is config/ppo_job.py, the pipeline config/pipeline_job.py, the list of kinds config/kinds.py."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, PrivateAttr, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel
from rlhf_ray.config.data import DataSpec
from rlhf_ray.config.deepspeed import DeepSpeedSpec
from rlhf_ray.config.dpo import DPOSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.optim import OptimizerSpec
from rlhf_ray.config.paths import PathField
from rlhf_ray.config.placement import ClusterSpec, PlacementSpec, colocation_root
from rlhf_ray.config.pretrain import PretrainDataSpec, batch_counts
from rlhf_ray.config.run import CheckpointSpec, LoggingSpec

FINAL_MODEL_DIR = "model"
"""Every job saves its final Hugging Face model to `<output_dir>/model`; the pipeline chains stages by it."""
EMA_MODEL_DIR = "model_ema"
"""PPO with ppo.ema.enabled also saves the moving average of the policy to `<output_dir>/model_ema`."""
BEST_MODEL_DIR = "best_model"
"""PPO with ppo.keep_best also saves the policy of its best held-out evaluation to `<output_dir>/best_model`."""


def check_global_batch(global_field: str, global_batch: int, micro_field: str, micro: int, accum_field: str,
                       accum: int, ranks: int) -> None:
    """global batch = micro-batch x accumulation x data-parallel ranks, or a FieldProblem with the arithmetic."""
    product = micro * accum * ranks
    if global_batch == product:
        return
    fixes = [f"set {global_field}: {product}"]
    if global_batch % (micro * ranks) == 0:
        fixes.append(f"or {accum_field}: {global_batch // (micro * ranks)}")
    raise FieldProblem(
        global_field,
        f"global batch {global_batch} != {micro_field} ({micro}) x {accum_field} ({accum}) "
        f"x data-parallel ranks ({ranks}) = {product}; " + " ".join(fixes),
    )


class JobBase(StrictModel):
    """What every job has: where it writes, its seed, its cluster, logging and checkpoints.

    A job kind is registered once, here: its class in JOB_KINDS, and on the class what the rest of the project
    finds from there: `summary` (its CLI command's help), `runner` (the function that runs it, by import path: the
    jobs live above the configs), `steps_resume` (its CLI command takes --stop-after) and `memory` (the function
    that sizes its roles for `validate`; None: a kind that places no actors, or a pipeline, whose stages are
    sized)."""

    summary: ClassVar[str]
    runner: ClassVar[str]
    memory: ClassVar[str | None] = None
    steps_resume: ClassVar[bool] = False

    kind: str
    """Job kind: pretrain, sft, rm, dpo, ppo or pipeline. Picks which model validates the rest of the file."""
    output_dir: Annotated[str, PathField()] = "outputs/run"
    """Everything the job writes: the final model in `model/`, checkpoints, logs, `summary.json`."""
    seed: int = 1234
    """Seeds data order, splits, initialisation and sampling."""
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    _origin: tuple = PrivateAttr(default=())
    """(the ConfigSource it was read from, its fields' prefix there: `ppo` for a pipeline's PPO stage), set by the
    loader, for errors found once the job runs (on another node) to point at the YAML line."""

    def where(self, loc: tuple[str, ...]) -> str:
        """`file:line` (or the `--set`) that gave field `loc` of this job, and the field's full name."""
        if not self._origin:
            return f"{'.'.join(loc)}"
        source, prefix = self._origin
        return f"{source.where(prefix + loc)}: {'.'.join(prefix + loc)}"

    def placement_roles(self) -> dict[str, PlacementSpec]:
        """Role name -> placement, for the resource plan."""
        raise NotImplementedError

    def named_stages(self) -> dict[str, JobBase]:
        """The jobs this one runs, in order, by the config section each is written in: itself, under "" (a
        pipeline: its stages, under sft, rm, ...)."""
        return {"": self}

    def stages(self) -> list[JobBase]:
        """The jobs this one runs, in order."""
        return list(self.named_stages().values())

    @model_validator(mode="after")
    def _placement_is_consistent(self) -> "JobBase":
        """A colocated role takes its host's replica count unless given; then the plan must be buildable
        (colocation targets exist, no chains, equal replicas)."""
        roles = self.placement_roles()
        for spec in roles.values():
            host = roles.get(spec.colocate_with or "")
            if host is not None and "replicas" not in spec.model_fields_set:
                spec.replicas = host.replicas
        for role, spec in roles.items():
            if spec.colocate_with:
                colocation_root(roles, role)
        return self


class TrainLoopSpec(StrictModel):
    """The training loop of a learner job: how long, how large a batch, how often to evaluate."""

    epochs: float = Field(1.0, gt=0)
    """Passes over the training split (fractions allowed); pretrain: over all corpora's training samples together."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps (overrides epochs)."""
    micro_batch_size: int = Field(4, ge=1)
    """Samples per rank per forward/backward (DeepSpeed's train_micro_batch_size_per_gpu)."""
    global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step; must equal micro_batch_size x gradient_accumulation_steps x ranks.
    Unset: derived from those."""
    eval_every_steps: int = Field(0, ge=0)
    """Evaluate every N optimizer steps; 0: at the start and the end only."""
    eval_batch_size: int = Field(8, ge=1)
    """Samples per rank per evaluation forward pass."""


class TrainSpec(TrainLoopSpec):
    """The supervised training loop of an SFT, RM or DPO job."""

    train_on_prompt: bool = False
    """SFT: also compute the loss on prompt tokens (default: answer tokens only)."""
    eval_max_samples: int | None = Field(None, ge=1)
    """Evaluate on the first N held-out samples only (a quick run of a recipe whose held-out split is large: each
    evaluation is a forward over every held-out sample). Unset: all of them."""
    packing: bool = False
    """SFT: pack several samples into one sequence."""


class _LearnerJob(JobBase):
    """A job whose work is one DeepSpeed learner group: the model, its loop, optimizer, ZeRO settings, placement."""

    model: ModelSpec
    train: TrainLoopSpec = Field(default_factory=TrainLoopSpec)
    optim: OptimizerSpec = Field(default_factory=OptimizerSpec)
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    """The learner group: `replicas` data-parallel DeepSpeed ranks."""

    def placement_roles(self) -> dict[str, PlacementSpec]:
        return {"learner": self.placement}

    @property
    def global_batch_size(self) -> int:
        t = self.train
        return t.global_batch_size or t.micro_batch_size * self.deepspeed.gradient_accumulation_steps * self.placement.replicas

    @model_validator(mode="after")
    def _checks(self) -> "_LearnerJob":
        if not self.model.is_set:
            raise FieldProblem("model.path", "no model to train: set a hub id or a local HF directory")
        if self.train.global_batch_size is not None:
            check_global_batch("train.global_batch_size", self.train.global_batch_size, "train.micro_batch_size",
                               self.train.micro_batch_size, "deepspeed.gradient_accumulation_steps",
                               self.deepspeed.gradient_accumulation_steps, self.placement.replicas)
        if self.placement.colocate_with is not None:
            raise FieldProblem("placement.colocate_with", f"a {self.kind} job has a single role; nothing to colocate "
                                                          "with")
        if problem := self.deepspeed.precision_problem(self.model.dtype):
            raise FieldProblem(f"deepspeed.{problem[0]}", problem[1])
        return self


class PretrainJob(_LearnerJob):
    """Continued pretraining: the causal-LM loss on every token of mmap corpora (`rlhf-ray preprocess` output), mixed
    by weight, with held-out perplexity per corpus; e.g. to adapt a model to a domain before SFT."""

    summary: ClassVar[str] = "continued pretraining on mmap corpora"
    runner: ClassVar[str] = "rlhf_ray.jobs.pretrain_job:run_pretrain"
    memory: ClassVar[str | None] = "rlhf_ray.memory.budget:learner_memory_roles"
    steps_resume: ClassVar[bool] = True
    kind: Literal["pretrain"] = "pretrain"
    model: ModelSpec
    """The model to continue training."""
    data: PretrainDataSpec

    @model_validator(mode="after")
    def _every_corpus_in_every_batch(self) -> "PretrainJob":
        weights = [c.weight for c in self.data.corpora]
        for i, count in enumerate(batch_counts(weights, self.global_batch_size)):
            if count == 0:
                raise FieldProblem(f"data.corpora.{i}.weight",
                                   f"weight {weights[i]} of {sum(weights)} rounds to 0 of the {self.global_batch_size} "
                                   "samples of a global batch: raise it, or the global batch size")
        return self


class _SupervisedJob(_LearnerJob):
    model: ModelSpec
    """The model to train (base model for SFT; backbone of the reward model for RM)."""
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)


class SFTJob(_SupervisedJob):
    """Step 1: supervised fine-tuning on prompt + chosen answer."""

    summary: ClassVar[str] = "supervised fine-tuning"
    runner: ClassVar[str] = "rlhf_ray.jobs.supervised:run_supervised"
    memory: ClassVar[str | None] = "rlhf_ray.memory.budget:learner_memory_roles"
    steps_resume: ClassVar[bool] = True
    kind: Literal["sft"] = "sft"


class RMJob(_SupervisedJob):
    """Step 2: a reward model (backbone + scalar head) trained on preference pairs."""

    summary: ClassVar[str] = "reward-model training"
    runner: ClassVar[str] = "rlhf_ray.jobs.supervised:run_supervised"
    memory: ClassVar[str | None] = "rlhf_ray.memory.budget:learner_memory_roles"
    steps_resume: ClassVar[bool] = True
    kind: Literal["rm"] = "rm"
    loss: Literal["pairwise", "divergence_window"] = "pairwise"
    """pairwise: -logsigmoid(r_chosen - r_rejected) at the last real token; divergence_window: DeepSpeed-Chat's
    per-token variant over the span where the two answers differ."""


class DPOJob(_SupervisedJob):
    """Direct preference optimisation: the policy learns from preference pairs against a frozen reference, without
    a reward model or sampling. Trains on the pairs share of `data.split` (the RM phase's)."""

    summary: ClassVar[str] = "direct preference optimisation"
    runner: ClassVar[str] = "rlhf_ray.jobs.dpo_job:run_dpo"
    memory: ClassVar[str | None] = "rlhf_ray.memory.budget:dpo_memory_roles"
    steps_resume: ClassVar[bool] = True
    kind: Literal["dpo"] = "dpo"
    dpo: DPOSpec = Field(default_factory=DPOSpec)

    def placement_roles(self) -> dict[str, PlacementSpec]:
        return {"learner": self.placement, "reference": self.dpo.reference.placement}

    @property
    def reference_model(self) -> ModelSpec:
        """The reference's model: `dpo.reference.model`, or the model training starts from."""
        return self.dpo.reference.model if self.dpo.reference.model.is_set else self.model
