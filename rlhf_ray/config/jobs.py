"""The top-level model of each job kind (`kind:` in the YAML) and the checks that span sections."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel
from rlhf_ray.config.data import DataSpec
from rlhf_ray.config.deepspeed import DeepSpeedSpec
from rlhf_ray.config.dpo import DPOSpec
from rlhf_ray.config.generation import GenerationSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.optim import OptimizerSpec
from rlhf_ray.config.placement import ClusterSpec, PlacementSpec, colocation_root
from rlhf_ray.config.pretrain import PretrainDataSpec, batch_counts
from rlhf_ray.config.ppo import CRITIC_FREE, PPOSpec
from rlhf_ray.config.run import CheckpointSpec, LoggingSpec

FINAL_MODEL_DIR = "model"
"""Every job saves its final Hugging Face model to `<output_dir>/model`; the pipeline chains stages by it."""
EMA_MODEL_DIR = "model_ema"
"""PPO with ppo.ema.enabled also saves the moving average of the policy to `<output_dir>/model_ema`."""


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
    that sizes its roles for `validate`)."""

    summary: ClassVar[str]
    runner: ClassVar[str]
    memory: ClassVar[str | None] = None
    steps_resume: ClassVar[bool] = False

    kind: str
    """Job kind: pretrain, sft, rm, dpo, ppo or pipeline. Picks which model validates the rest of the file."""
    output_dir: str = "outputs/run"
    """Everything the job writes: the final model in `model/`, checkpoints, logs, `summary.json`."""
    seed: int = 1234
    """Seeds data order, splits, initialisation and sampling."""
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)

    def placement_roles(self) -> dict[str, PlacementSpec]:
        """Role name -> placement, for the resource plan."""
        raise NotImplementedError

    def stages(self) -> list[JobBase]:
        """The jobs this one runs, in order: itself (a pipeline: its stages)."""
        return [self]

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


class LearnerRoleSpec(StrictModel):
    """A trained role of PPO (policy or critic): a DeepSpeed ZeRO learner group."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    optim: OptimizerSpec = Field(default_factory=OptimizerSpec)
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    micro_batch_size: int = Field(4, ge=1)
    """Samples per rank per forward/backward in the PPO update. Gradient accumulation follows from
    ppo.train_batch_size / (micro_batch_size x replicas) unless deepspeed.gradient_accumulation_steps is set."""

    def accumulation_steps(self, train_batch_size: int) -> int:
        return train_batch_size // (self.micro_batch_size * self.placement.replicas)


class InferenceRoleSpec(StrictModel):
    """A forward-only role of PPO (reference model)."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    micro_batch_size: int = Field(8, ge=1)
    """Samples per forward pass of this role when scoring experience."""
    sharded: bool = False
    """ZeRO-3 inference: the replicas form one group and each holds 1/replicas of the model's weights (gathered
    layer by layer during a forward), for a model larger than one device. Every call runs on all replicas at once;
    a replica that dies stops the group as a learner rank does (cluster.learner_restarts)."""


class HttpRewardSpec(StrictModel):
    """A reward served over HTTP: batches of decoded prompts, answers and dataset columns are POSTed as JSON, the
    server replies with one score per answer (protocol: rlhf_ray/actors/http_reward.py; a reference server:
    `python -m rlhf_ray.reward_server`)."""

    url: str = Field(pattern=r"^https?://\S+$")
    """Where to POST, e.g. http://127.0.0.1:8000/score."""
    batch_size: int = Field(64, ge=1)
    """Answers per request."""
    timeout_s: float = Field(30.0, gt=0)
    """Seconds to wait for one request's reply."""
    retries: int = Field(3, ge=0)
    """Tries after the first for a request that times out, cannot connect or gets a non-2xx reply (waiting 0.5 s,
    1 s, 2 s ... between them); then the job fails naming the URL and the batch."""
    concurrency: int = Field(4, ge=1)
    """Requests in flight at once from each reward replica."""


class RewardRoleSpec(InferenceRoleSpec):
    """The reward: a reward model, a Python function `package.module:function(prompts, answers) -> scores`, or a
    server (`http`)."""

    function: str | None = None
    """Import path of a reward function, used instead of a reward model. It runs in the reward role's actors
    (placement as for a model; it needs little: e.g. num_cpus: 0.1, colocate_with: policy)."""
    http: HttpRewardSpec | None = None
    """A reward server, used instead of a reward model; called from the reward role's actors (placement as for
    a function)."""

    @property
    def is_model(self) -> bool:
        """A reward model (not a function, not a server)."""
        return self.function is None and self.http is None


class PPOJob(JobBase):
    """Step 3: PPO (or GRPO / RLOO / REINFORCE++) with separate policy, critic, reference, reward and generation
    groups."""

    summary: ClassVar[str] = "PPO (actor/learner service)"
    runner: ClassVar[str] = "rlhf_ray.jobs.ppo:run_ppo"
    memory: ClassVar[str | None] = "rlhf_ray.memory.budget:ppo_memory_roles"
    kind: Literal["ppo"] = "ppo"
    data: DataSpec = Field(default_factory=DataSpec)
    policy: LearnerRoleSpec = Field(default_factory=LearnerRoleSpec)
    critic: LearnerRoleSpec | None = None
    """Required by advantage_estimator gae; must be absent for the critic-free estimators."""
    reference: InferenceRoleSpec = Field(default_factory=InferenceRoleSpec)
    reward: RewardRoleSpec = Field(default_factory=RewardRoleSpec)
    generation: GenerationSpec = Field(default_factory=GenerationSpec)
    ppo: PPOSpec = Field(default_factory=PPOSpec)

    ROLE_ORDER: ClassVar[tuple[str, ...]] = ("policy", "critic", "reference", "reward", "generation")

    def placement_roles(self) -> dict[str, PlacementSpec]:
        roles = {"policy": self.policy.placement, "reference": self.reference.placement,
                 "reward": self.reward.placement, "generation": self.generation.placement}
        if self.critic is not None:
            roles["critic"] = self.critic.placement
        return {name: roles[name] for name in self.ROLE_ORDER if name in roles}

    @property
    def samples_per_iteration(self) -> int:
        return self.ppo.rollout_batch_size * self.generation.sampling.n_samples_per_prompt

    @property
    def train_batch_size(self) -> int:
        return self.ppo.train_batch_size or self.samples_per_iteration

    @property
    def old_logprobs_from_training(self) -> bool:
        """True when the policy's only update per rollout sees the weights that sampled it and the reward needs no
        log-probs: the old log-probs are then its training forward's, detached, and no extra forward is run."""
        ppo = self.ppo
        one_step = ppo.mode == "sync" and ppo.ppo_epochs == 1 and self.train_batch_size == self.samples_per_iteration
        return one_step and (ppo.kl_in_loss or ppo.kl_coef == 0)

    @model_validator(mode="after")
    def _checks(self) -> "PPOJob":
        self._fill_model_defaults()
        self._check_roles()
        self._check_batches()
        self._check_environment()
        return self

    def _check_environment(self) -> None:
        env, sampling = self.generation.environment, self.generation.sampling
        if env is None:
            return
        if env.max_episode_tokens < sampling.max_new_tokens:
            raise FieldProblem("generation.environment.max_episode_tokens",
                               f"an episode of at most {env.max_episode_tokens} tokens cannot hold one turn of "
                               f"generation.sampling.max_new_tokens ({sampling.max_new_tokens}); raise it")
        if self.ppo.overlong_buffer is not None:
            raise FieldProblem("ppo.overlong_buffer", "the overlong penalty counts an answer's tokens, but with an "
                                                      "environment an answer is a whole episode: remove it")

    def _fill_model_defaults(self) -> None:
        """Reference starts from the policy and the critic from the reward model (DeepSpeed-Chat step 3)."""
        if not self.reference.model.is_set:
            self.reference.model = self.policy.model.model_copy(update={"lora": self.reference.model.lora})
        if self.critic is not None and not self.critic.model.is_set and self.reward.model.is_set:
            self.critic.model = self.critic.model.model_copy(update={"path": self.reward.model.path,
                                                                     "gguf_file": self.reward.model.gguf_file,
                                                                     "tokenizer": self.reward.model.tokenizer})

    def _check_roles(self) -> None:
        if not self.policy.model.is_set:
            raise FieldProblem("policy.model.path", "no policy to train: set the SFT model (hub id or local path)")
        if self.reward.is_model and not self.reward.model.is_set:
            raise FieldProblem("reward.model.path", "no reward: set reward.model.path (a reward model), "
                                                    "reward.function (module:function) or reward.http (a server)")
        if self.reward.function is not None and self.reward.http is not None:
            raise FieldProblem("reward.http", "the reward is either a function or a server: remove reward.function "
                                              "or reward.http")
        if self.reward.function is not None and ":" not in self.reward.function:
            raise FieldProblem("reward.function", f"expected 'package.module:function', got {self.reward.function!r}")
        if self.generation.weight_sync.lora == "adapter":
            lora = self.policy.model.lora
            if not lora.enabled:
                raise FieldProblem("generation.weight_sync.lora", "adapter sync sends the policy's LoRA adapters, but "
                                   "the policy has none (policy.model.lora.rank is 0): use merged, or set the rank")
            if not lora.only_optimize_lora:
                raise FieldProblem("generation.weight_sync.lora", "adapter sync sends only the adapters, but "
                                   "policy.model.lora.only_optimize_lora is false (the base weights train too): "
                                   "use merged")
            if self.generation.engine == "hf":
                raise FieldProblem("generation.weight_sync.lora", "adapter sync needs vLLM's LoRA support; "
                                   "generation.engine is hf: use merged, or engine vllm")
        estimator = self.ppo.advantage_estimator
        if estimator in CRITIC_FREE and self.critic is not None:
            raise FieldProblem("critic", f"advantage_estimator {estimator} uses no critic; remove the critic section "
                                         "(or use advantage_estimator: gae)")
        if estimator == "gae":
            if self.critic is None:
                raise FieldProblem("critic", "advantage_estimator gae needs a critic: add a critic section "
                                             "(its model defaults to the reward model)")
            if not self.critic.model.is_set:
                raise FieldProblem("critic.model.path", "the critic starts from the reward model, but the reward is a "
                                                        "function; set critic.model.path")
        if self.ppo.mode == "async" and self.ppo.max_staleness < 1:
            raise FieldProblem("ppo.max_staleness", "async mode trains on experience sampled one policy version "
                                                    "earlier; set ppo.max_staleness: 1 (or more), or ppo.mode: sync")
        for name, role in {"reference": self.reference, "reward": self.reward}.items():
            if role.sharded and role.placement.replicas < 2:
                raise FieldProblem(f"{name}.placement.replicas", f"{name}.sharded splits the model's weights over "
                                   "the replicas: set replicas: 2 or more (or sharded: false)")
        if self.reward.sharded and not self.reward.is_model:
            raise FieldProblem("reward.sharded", "a reward function or server has no weights to shard; remove sharded")
        longest = self.generation.sampling.max_new_tokens
        if self.ppo.overlong_buffer is not None and self.ppo.overlong_buffer >= longest:
            raise FieldProblem("ppo.overlong_buffer", f"the buffer counts back from generation.sampling."
                               f"max_new_tokens ({longest}), so it must be smaller: every answer would be punished")
        n = self.generation.sampling.n_samples_per_prompt
        if estimator in {"grpo", "rloo"} and n < 2:
            raise FieldProblem("generation.sampling.n_samples_per_prompt",
                               f"{estimator} compares answers to the same prompt and needs at least 2 (got {n})")

    def _check_batches(self) -> None:
        engines = self.generation.placement.replicas
        if self.ppo.rollout_batch_size < engines:
            raise FieldProblem("ppo.rollout_batch_size",
                               f"{self.ppo.rollout_batch_size} prompts per iteration cannot keep {engines} engines busy; "
                               f"set ppo.rollout_batch_size >= {engines} or generation.placement.replicas <= "
                               f"{self.ppo.rollout_batch_size}")
        samples, train_batch = self.samples_per_iteration, self.train_batch_size
        if samples % train_batch:
            raise FieldProblem("ppo.train_batch_size",
                               f"an iteration yields ppo.rollout_batch_size ({self.ppo.rollout_batch_size}) x "
                               f"n_samples_per_prompt ({self.generation.sampling.n_samples_per_prompt}) = {samples} "
                               f"samples, which do not split into batches of {train_batch}; use a divisor of {samples}")
        for name, role in {"policy": self.policy, "critic": self.critic}.items():
            if role is None:
                continue
            if problem := role.deepspeed.precision_problem(role.model.dtype):
                raise FieldProblem(f"{name}.deepspeed.{problem[0]}", problem[1])
            per_step = role.micro_batch_size * role.placement.replicas
            if "gradient_accumulation_steps" in role.deepspeed.model_fields_set:
                check_global_batch("ppo.train_batch_size", train_batch, f"{name}.micro_batch_size", role.micro_batch_size,
                                   f"{name}.deepspeed.gradient_accumulation_steps",
                                   role.deepspeed.gradient_accumulation_steps, role.placement.replicas)
            elif train_batch % per_step:
                raise FieldProblem(f"{name}.micro_batch_size",
                                   f"the PPO train batch of {train_batch} samples does not split over {name}."
                                   f"micro_batch_size ({role.micro_batch_size}) x {name}.placement.replicas "
                                   f"({role.placement.replicas}) = {per_step}; choose them so their product divides "
                                   f"{train_batch}")


def _with_default(section: dict[str, Any], keys: tuple[str, ...], value: str) -> None:
    """Set section[k0][k1]...[kn] = value unless the user gave it (raw YAML dicts, before validation)."""
    for key in keys[:-1]:
        child = section.setdefault(key, {})
        if not isinstance(child, dict):
            return
        section = child
    section.setdefault(keys[-1], value)


class PipelineJob(JobBase):
    """SFT -> RM -> PPO, SFT -> PPO with a reward function or server (no reward model to train), or SFT -> DPO,
    optionally after continued pretraining. Stage outputs default to
    `<output_dir>/{pretrain,sft,rm,ppo,dpo}`; SFT starts from the pretrain stage's model when there is one, the reward
    model from the SFT model (as InstructGPT's does), PPO's policy and reference from the SFT model, and its critic
    and reward model from the RM, unless a path is given; DPO starts from the SFT model."""

    summary: ClassVar[str] = "(pretrain ->) SFT -> RM -> PPO, or SFT -> DPO"
    runner: ClassVar[str] = "rlhf_ray.jobs.pipeline:run_pipeline"
    kind: Literal["pipeline"] = "pipeline"
    pretrain: PretrainJob | None = None
    """Optional stage 0, as in a pretrain config: continued pretraining on mmap corpora, whose model SFT starts from
    (sft's `model.path` left unset takes it)."""
    sft: SFTJob
    """Stage 1, as in an sft config (`kind` and `output_dir` may be left out)."""
    rm: RMJob | None = None
    """Stage 2, as in an rm config; `model.path` left unset takes the SFT output. Leave it out when PPO's reward is a
    function or a server."""
    ppo: PPOJob | None = None
    """Stage 3, as in a ppo config; model paths left unset take the SFT / RM outputs."""
    dpo: DPOJob | None = None
    """Instead of rm and ppo: DPO after SFT, as in a dpo config; `model.path` left unset takes the SFT output."""

    @model_validator(mode="after")
    def _one_route(self) -> "PipelineJob":
        if self.dpo is not None and (self.rm is not None or self.ppo is not None):
            raise FieldProblem("dpo", "a pipeline runs either rm and ppo after sft, or dpo: remove one route")
        if self.dpo is None and self.ppo is None:
            raise FieldProblem("ppo", "no stage after sft: give a ppo section (with an rm section when its reward is "
                                      "a reward model), or a dpo one")
        return self

    @model_validator(mode="before")
    @classmethod
    def _wire_stages(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        root = data.get("output_dir", cls.model_fields["output_dir"].default)
        shared = {k: data[k] for k in ("seed", "cluster", "logging") if k in data}
        stages = {}
        for stage in ("pretrain", "sft", "rm", "ppo", "dpo"):
            section = data.get(stage)
            if section is None and stage != "sft":
                continue
            if not isinstance(section, dict):
                return data
            section = {**shared, **section}
            section.setdefault("kind", stage)
            section.setdefault("output_dir", f"{root}/{stage}")
            stages[stage] = section
        if "pretrain" in stages:
            _with_default(stages["sft"], ("model", "path"), f"{stages['pretrain']['output_dir']}/{FINAL_MODEL_DIR}")
        sft_model = f"{stages['sft']['output_dir']}/{FINAL_MODEL_DIR}"
        for stage in ("rm", "dpo"):
            if stage in stages:
                _with_default(stages[stage], ("model", "path"), sft_model)
        if "ppo" in stages:
            _with_default(stages["ppo"], ("policy", "model", "path"), sft_model)
        if "ppo" in stages and "rm" in stages:  # without an rm stage the reward is a function or a server
            rm_model = f"{stages['rm']['output_dir']}/{FINAL_MODEL_DIR}"
            reward = stages["ppo"].get("reward")
            if not (isinstance(reward, dict) and (reward.get("function") or reward.get("http"))):
                _with_default(stages["ppo"], ("reward", "model", "path"), rm_model)
            if isinstance(stages["ppo"].get("critic"), dict):
                _with_default(stages["ppo"], ("critic", "model", "path"), rm_model)
        return {**data, **stages}

    def placement_roles(self) -> dict[str, PlacementSpec]:
        """Stages run one after another, so the plan that must fit is the largest stage's."""
        return (self.dpo or self.ppo or self.sft).placement_roles()  # sft alone: the route check then says why

    def stages(self) -> list[JobBase]:
        first = [self.pretrain] if self.pretrain is not None else []
        later = [self.dpo] if self.dpo is not None else [self.rm, self.ppo]
        return first + [self.sft] + [stage for stage in later if stage is not None]


JOB_KINDS: dict[str, type[JobBase]] = {cls.model_fields["kind"].default: cls for cls in (
    PretrainJob, SFTJob, RMJob, DPOJob, PPOJob, PipelineJob)}
"""Every job kind, by its `kind:` (the loader's discriminator). Adding a kind: its config class here; see JobBase."""
