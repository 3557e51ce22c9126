"""The PPO job (and GRPO, RLOO, REINFORCE++): its roles and the checks that span them."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, PrivateAttr, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel
from rlhf_ray.config.data import DataSpec
from rlhf_ray.config.deepspeed import DeepSpeedSpec
from rlhf_ray.config.generation import GenerationSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.optim import OptimizerSpec
from rlhf_ray.config.paths import PathField
from rlhf_ray.config.placement import PlacementSpec
from rlhf_ray.config.ppo import PPOSpec
from rlhf_ray.config.jobs import JobBase, check_global_batch


class TokenBudget(StrictModel):
    """How a role of PPO cuts its rows into micro-batches, besides its micro_batch_size."""

    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Cut each replica's rows by tokens instead of rows: the rows are sorted by length and a micro-batch takes
    rows while rows x (its longest prompt + its longest answer) stays within this budget, so short answers run many
    to a forward and little of it is padding (the metric `<role>/padding_fraction`). Applies to every forward of
    the role (and to the PPO epochs of a learner, whose optimizer still steps once per mini-batch); every rank of a
    ZeRO group runs as many micro-batches as the rank that needs most. Must hold the longest row:
    data.max_prompt_len + the answer's token limit. None: every micro_batch_size rows in their order."""
    pack_sequences: bool | None = None
    """Run each micro-batch as one packed row of its real tokens (models/packing.py): no pad is computed, each row
    attends only to itself (block by block: varlen attention), and the answers to one prompt share it; the numbers
    are the padded path's. With a token budget a micro-batch then takes rows while their tokens fit it. None (the
    default): packed where the model can run it (its attention goes through transformers' attention interface
    without logit soft-capping: every family in docs/models.md but Gemma 2), gains by it (hidden size 256 or more:
    below, the block-by-block attention costs more than the pads) and the role does not use gradient
    checkpointing, else padded; true: packed, refused where it cannot be; false: padded (docs/jobs.md, "Packed
    micro-batches": when to turn it off)."""


class LearnerRoleSpec(TokenBudget):
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


class InferenceRoleSpec(TokenBudget):
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
    token_env: str | None = None
    """Name of an environment variable, on the driver's host, that holds a bearer token for the server (sent as
    `Authorization: Bearer ...`; the token itself never goes in the YAML or a log line)."""
    token_file: Annotated[str | None, PathField()] = None
    """A file, on the driver's host, whose content is the bearer token (instead of token_env)."""
    ca_file: Annotated[str | None, PathField()] = None
    """For an https URL whose certificate is not signed by a CA this host trusts: the CA (PEM) to check it with."""

    @model_validator(mode="after")
    def _one_token_source(self) -> "HttpRewardSpec":
        if self.token_env and self.token_file:
            raise FieldProblem("token_file", "give the token one way: token_env or token_file, not both")
        if self.ca_file and not self.url.startswith("https://"):
            raise FieldProblem("ca_file", f"a CA file checks an https server's certificate, but url is {self.url}")
        return self


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
    reference: InferenceRoleSpec | None = Field(default_factory=InferenceRoleSpec)
    """The frozen model the KL term measures the policy against. null: none runs, which only a run without a KL term
    may do (ppo.kl_coef: 0; on-policy distillation, GRPO without KL): its forward is then saved on every rollout."""
    teacher: InferenceRoleSpec | None = None
    """On-policy distillation (advantage_estimator: distill): the model the policy learns to match, scoring every
    token the policy samples; placed and sharded like the reference. It must share the policy's tokenizer."""
    reward: RewardRoleSpec = Field(default_factory=RewardRoleSpec)
    generation: GenerationSpec = Field(default_factory=GenerationSpec)
    ppo: PPOSpec = Field(default_factory=PPOSpec)

    ROLE_ORDER: ClassVar[tuple[str, ...]] = ("policy", "critic", "reference", "teacher", "reward", "generation")

    def placement_roles(self) -> dict[str, PlacementSpec]:
        roles = {"policy": self.policy.placement, "reward": self.reward.placement,
                 "generation": self.generation.placement}
        for name in ("critic", "reference", "teacher"):
            if getattr(self, name) is not None:
                roles[name] = getattr(self, name).placement
        return {name: roles[name] for name in self.ROLE_ORDER if name in roles}

    @property
    def samples_per_iteration(self) -> int:
        return self.ppo.rollout_batch_size * self.generation.sampling.n_samples_per_prompt

    @property
    def train_batch_size(self) -> int:
        return self.ppo.train_batch_size or self.samples_per_iteration

    _scoring_threads: dict[str, int] = PrivateAttr(default_factory=dict)

    @property
    def scoring_threads(self) -> dict[str, int]:
        """Threads per replica a learner role (policy, critic) scores on (old log-probs, values), where that is
        fewer than its placement's `threads`: set by jobs/threads.with_turn_threads for the CPU roles of a sync job,
        whose scoring phase is more crowded than its training phase. Not a YAML key."""
        return self._scoring_threads

    @scoring_threads.setter
    def scoring_threads(self, threads: dict[str, int]) -> None:
        self._scoring_threads = dict(threads)

    @property
    def old_logprobs_from_training(self) -> bool:
        """True when the policy's only update per rollout sees the weights that sampled it and the reward needs no
        log-probs: the old log-probs are then its training forward's, detached, and no extra forward is run (unless
        ppo.old_logprobs asks for the engine's, which then serve instead)."""
        ppo = self.ppo
        one_step = ppo.mode == "sync" and ppo.ppo_epochs == 1 and self.train_batch_size == self.samples_per_iteration
        return (one_step and (ppo.kl_in_loss or ppo.kl_coef == 0) and not ppo.estimator.policy_logprobs
                and ppo.old_logprobs == "policy")

    @property
    def policy_scores_rollouts(self) -> bool:
        """True when the policy runs a forward over each rollout for its old log-probs: neither the engine's
        (ppo.old_logprobs: engine) nor its training forward's (old_logprobs_from_training) serve."""
        return self.ppo.old_logprobs == "policy" and not self.old_logprobs_from_training

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
        if self.reference is not None and not self.reference.model.is_set:
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
        estimator_name, estimator = self.ppo.advantage_estimator, self.ppo.estimator
        if not estimator.critic and self.critic is not None:
            raise FieldProblem("critic", f"advantage_estimator {estimator_name} uses no critic; remove the critic section "
                                         "(or use advantage_estimator: gae)")
        if estimator.critic:
            if self.critic is None:
                raise FieldProblem("critic", f"advantage_estimator {estimator_name} needs a critic: add a critic section "
                                             "(its model defaults to the reward model)")
            if not self.critic.model.is_set:
                raise FieldProblem("critic.model.path", "the critic starts from the reward model, but the reward is a "
                                                        "function; set critic.model.path")
        if estimator.teacher and self.teacher is None:
            raise FieldProblem("teacher", f"advantage_estimator {estimator_name} learns from a teacher model: add a teacher "
                                          "section (teacher.model.path: the model to distil)")
        if self.teacher is not None:
            if not estimator.teacher:
                raise FieldProblem("teacher", f"a teacher is used by advantage_estimator distill, not {estimator_name}: "
                                              "set ppo.advantage_estimator: distill, or remove the teacher section")
            if not self.teacher.model.is_set:
                raise FieldProblem("teacher.model.path", "no teacher to distil: set teacher.model.path (or gguf_file)")
        if self.ppo.mode == "async" and self.ppo.max_staleness < 1:
            raise FieldProblem("ppo.max_staleness", "async mode trains on experience sampled one policy version "
                                                    "earlier; set ppo.max_staleness: 1 (or more), or ppo.mode: sync")
        if self.generation.partial_rollouts and self.ppo.mode != "async":
            raise FieldProblem("generation.partial_rollouts", "in sync mode no weight update reaches an engine during "
                                                              "a rollout; set ppo.mode: async, or remove it")
        if self.reference is None and self.ppo.kl_coef:
            where = "policy loss (ppo.kl_in_loss)" if self.ppo.kl_in_loss else "reward"
            raise FieldProblem("reference", f"ppo.kl_coef is {self.ppo.kl_coef}: the KL term in the {where} needs the "
                                            "reference's log-probs; give reference a section (an empty one starts "
                                            "it from the policy's model) or set ppo.kl_coef: 0")
        for name, role in {"reference": self.reference, "teacher": self.teacher, "reward": self.reward}.items():
            if role is not None and role.sharded and role.placement.replicas < 2:
                raise FieldProblem(f"{name}.placement.replicas", f"{name}.sharded splits the model's weights over "
                                   "the replicas: set replicas: 2 or more (or sharded: false)")
        if self.reward.sharded and not self.reward.is_model:
            raise FieldProblem("reward.sharded", "a reward function or server has no weights to shard; remove sharded")
        longest = self.generation.sampling.max_new_tokens
        if self.ppo.overlong_buffer is not None and self.ppo.overlong_buffer >= longest:
            raise FieldProblem("ppo.overlong_buffer", f"the buffer counts back from generation.sampling."
                               f"max_new_tokens ({longest}), so it must be smaller: every answer would be punished")
        n = self.generation.sampling.n_samples_per_prompt
        if estimator.groups and n < 2:
            raise FieldProblem("generation.sampling.n_samples_per_prompt",
                               f"{estimator_name} compares answers to the same prompt and needs at least 2 (got {n})")

    def _check_batches(self) -> None:
        placement = self.generation.placement
        engines = placement.max_replicas or placement.replicas
        if self.ppo.rollout_batch_size < engines:
            field = "max_replicas" if placement.max_replicas else "replicas"
            raise FieldProblem("ppo.rollout_batch_size",
                               f"{self.ppo.rollout_batch_size} prompts per iteration cannot keep {engines} engines busy; "
                               f"set ppo.rollout_batch_size >= {engines} or generation.placement.{field} <= "
                               f"{self.ppo.rollout_batch_size}")
        samples, train_batch = self.samples_per_iteration, self.train_batch_size
        if samples % train_batch:
            raise FieldProblem("ppo.train_batch_size",
                               f"an iteration yields ppo.rollout_batch_size ({self.ppo.rollout_batch_size}) x "
                               f"n_samples_per_prompt ({self.generation.sampling.n_samples_per_prompt}) = {samples} "
                               f"samples, which do not split into batches of {train_batch}; use a divisor of {samples}")
        longest = self.data.max_prompt_len + self.generation.max_answer_tokens
        for name, role in {"policy": self.policy, "critic": self.critic, "reference": self.reference,
                           "teacher": self.teacher, "reward": self.reward}.items():
            if role is not None and role.max_tokens_per_micro_batch is not None and \
                    role.max_tokens_per_micro_batch < longest:
                raise FieldProblem(f"{name}.max_tokens_per_micro_batch",
                                   f"{role.max_tokens_per_micro_batch} tokens cannot hold the longest row: "
                                   f"data.max_prompt_len ({self.data.max_prompt_len}) + the answer's limit "
                                   f"({self.generation.max_answer_tokens}) = {longest}; set at least {longest}")
            if role is not None and role.pack_sequences is True and role.model.gradient_checkpointing:
                raise FieldProblem(f"{name}.pack_sequences",
                                   f"packed rows cannot be recomputed by gradient checkpointing (the backward pass "
                                   f"would attend across rows); set {name}.pack_sequences: false or "
                                   f"{name}.model.gradient_checkpointing: false")
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
