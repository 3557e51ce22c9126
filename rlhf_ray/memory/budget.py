"""A job's memory, role by role and bundle by bundle, against what its devices hold.

A bundle's roles add up (colocated roles share the bundle's device). On a GPU a bundle may use its share of the
device: `num_gpus` x the GPU's memory (0.75 of an 80 GB GPU: 60 GB); a vLLM engine reserves
gpu_memory_utilization of the whole device whatever its share, so its share must cover that. CPU bundles share
their node's host memory: the sum of every CPU bundle and of what learners offload to the host is checked against
the cluster's host memory (an approximation on several nodes: which node a bundle lands on is Ray's choice).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from rlhf_ray.memory.estimate import (DTYPE_BYTES, GiB, RoleBytes, engine_bytes, inference_bytes, learner_bytes)
from rlhf_ray.memory.shapes import ModelShape, shape_of

GPU_MEMORY = "gpu_memory"
"""Node-dict key (bytes of one GPU), next to Ray's CPU / GPU / memory resources."""
HOST_MEMORY = "memory"
"""Node-dict key (bytes of host memory), Ray's own name for it."""


@dataclass(frozen=True)
class RoleMemory:
    role: str
    model: str
    bytes: RoleBytes | None
    """Per replica; None when the model's shape is unknown."""
    how: str
    """What the estimate assumed, or why there is none."""


PACKAGED = {"package:smollm2": "HuggingFaceTB/SmolLM2-135M"}
"""GGUF files the package ships, by the hub model they were made from (same shape)."""


def _shape(spec, derived: dict[str, ModelShape]) -> tuple[ModelShape | None, str]:
    """The model's shape: `size_like`, else its folder or hub id, else what an earlier stage writes there."""
    name = spec.size_like or spec.path or spec.gguf_file or "?"
    if spec.gguf_file and not spec.path and not spec.size_like:
        name = PACKAGED.get(spec.gguf_file, spec.gguf_file)
    return (derived.get(name) or shape_of(name)), name


def _learner(name: str, spec, deepspeed, replicas: int, micro: int, seq: int, positions: int, gpu: bool,
             scalar: bool, derived: dict[str, ModelShape]) -> RoleMemory:
    shape, model = _shape(spec, derived)
    if shape is None:
        return RoleMemory(name, model, None, f"shape of {model} unknown: set {name}.model.size_like to a hub id "
                                             "of the same architecture")
    got = learner_bytes(shape, dtype=spec.dtype, zero_stage=deepspeed.zero_stage, ranks=replicas, micro_batch=micro,
                        seq_len=seq, logit_positions=positions, offload_optimizer=deepspeed.offload_optimizer,
                        offload_params=deepspeed.offload_params, gradient_checkpointing=spec.gradient_checkpointing,
                        attention_scores=not gpu, scalar_head=scalar)
    how = (f"{shape.params / 1e9:.2f}B {spec.dtype}, ZeRO-{deepspeed.zero_stage} over {replicas}, "
           f"micro-batch {micro} x {seq} tokens{', checkpointed' if spec.gradient_checkpointing else ''}")
    return RoleMemory(name, model, got, how)


def _scorer(name: str, spec, micro: int, seq: int, positions: int, scalar: bool, gpu: bool,
            derived: dict[str, ModelShape]) -> RoleMemory:
    shape, model = _shape(spec, derived)
    if shape is None:
        return RoleMemory(name, model, None, f"shape of {model} unknown: set {name}.model.size_like")
    got = inference_bytes(shape, dtype=spec.dtype, micro_batch=micro, seq_len=seq, logit_positions=positions,
                          scalar_head=scalar, attention_scores=not gpu)
    return RoleMemory(name, model, got, f"{shape.params / 1e9:.2f}B {spec.dtype}, forward of {micro} x {seq} tokens")


def role_memory(job, gpu_bytes: int | None = None, derived: dict[str, ModelShape] | None = None
                ) -> dict[str, RoleMemory]:
    """Per-replica bytes of every role of one job (SFT, RM or PPO). `derived`: shapes of model folders an earlier
    pipeline stage writes (the SFT output has the SFT input's shape)."""
    derived = derived or {}
    if job.kind in ("sft", "rm"):
        gpu = job.placement.num_gpus > 0
        micro = job.train.micro_batch_size * (2 if job.kind == "rm" else 1)  # chosen + rejected
        seq = job.data.max_seq_len
        return {"learner": _learner("learner", job.model, job.deepspeed, job.placement.replicas, micro, seq, seq, gpu,
                                    job.kind == "rm", derived)}
    answer = job.generation.sampling.max_new_tokens
    seq = job.data.max_prompt_len + answer
    policy = job.policy
    out = {"policy": _learner("policy", policy.model, policy.deepspeed, policy.placement.replicas,
                              policy.micro_batch_size, seq, answer + 1, policy.placement.num_gpus > 0, False, derived),
           "reference": _scorer("reference", job.reference.model, job.reference.micro_batch_size, seq, answer + 1,
                                False, job.reference.placement.num_gpus > 0, derived)}
    if job.critic is not None:
        critic = job.critic
        out["critic"] = _learner("critic", critic.model, critic.deepspeed, critic.placement.replicas,
                                 critic.micro_batch_size, seq, 0, critic.placement.num_gpus > 0, True, derived)
    if job.reward.function is None:
        out["reward"] = _scorer("reward", job.reward.model, job.reward.micro_batch_size, seq, 0, True,
                                job.reward.placement.num_gpus > 0, derived)
    else:
        out["reward"] = RoleMemory("reward", job.reward.function, RoleBytes(), "a Python function")
    out["generation"] = _engine(job, gpu_bytes, derived, seq)
    return out


def _engine(job, gpu_bytes: int | None, derived: dict[str, ModelShape], seq: int) -> RoleMemory:
    shape, model = _shape(job.policy.model, derived)
    gen = job.generation
    on_gpu = gen.placement.num_gpus > 0
    dtype = job.policy.model.dtype if gen.engine == "hf" or gen.vllm.dtype == "auto" else gen.vllm.dtype
    if shape is None:
        return RoleMemory("generation", model, None, "shape unknown: set policy.model.size_like")
    if gen.engine == "hf" or (gen.engine == "auto" and not on_gpu and shape.params < gen.auto_vllm_min_params):
        batch = -(-job.ppo.rollout_batch_size * gen.sampling.n_samples_per_prompt // gen.placement.replicas)
        return RoleMemory("generation", model,
                          RoleBytes(weights=DTYPE_BYTES[dtype] * shape.params,
                                    kv_cache=batch * seq * shape.kv_bytes_per_token(DTYPE_BYTES[dtype])),
                          f"hf engine, KV cache of {batch} x {seq} tokens")
    if on_gpu and gpu_bytes is None:
        return RoleMemory("generation", model, None, "vLLM takes gpu_memory_utilization of the GPU, whose size is "
                                                     "unknown: declare cluster.shape[].gpu_memory_gb")
    got = engine_bytes(shape, dtype=dtype, device_bytes=gpu_bytes if on_gpu else None,
                       gpu_memory_utilization=gen.vllm.gpu_memory_utilization, kv_cache_gb=gen.vllm.kv_cache_gb,
                       tensor_parallel=gen.vllm.tensor_parallel_size)
    how = (f"vLLM, gpu_memory_utilization {gen.vllm.gpu_memory_utilization:g} of the GPU" if on_gpu
           else f"vLLM, weights + kv_cache_gb {gen.vllm.kv_cache_gb:g}")
    return RoleMemory("generation", model, got, how)


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def check_memory(job, plan, nodes: list[dict[str, float]], derived: dict[str, ModelShape] | None = None
                 ) -> tuple[Table, list[str]]:
    """The memory table of one job's plan, and what does not fit (naming the group, its roles, the bytes over
    and the fields to change)."""
    gpu_bytes = max((int(n.get(GPU_MEMORY, 0)) for n in nodes), default=0) or None
    host_bytes = max((int(n.get(HOST_MEMORY, 0)) for n in nodes), default=0) or None
    roles = role_memory(job, gpu_bytes, derived)
    table = Table(title=f"{job.kind}: memory per replica (GiB)")
    for column in ("role", "weights", "grads", "optimizer", "activations", "logits", "KV cache", "device total",
                   "host (offload)", "assumed"):
        table.add_column(column, justify="left" if column in ("role", "assumed") else "right")
    for name, rm in roles.items():
        b = rm.bytes
        if b is None:
            table.add_row(name, *["?"] * 8, rm.how)
            continue
        table.add_row(name, _gib(b.weights), _gib(b.gradients), _gib(b.optimizer), _gib(b.activations),
                      _gib(b.logits), _gib(b.kv_cache), _gib(b.device), _gib(b.host), rm.how)
    problems, cpu_total, host_total = [], 0, 0
    for group in plan.groups:
        known = [roles[r] for r in group.roles if roles.get(r) and roles[r].bytes is not None]
        need = sum((rm.bytes.device for rm in known), 0)
        host_total += sum(rm.bytes.host for rm in known) * len(group.bundles)
        share = group.bundles[0].get("GPU", 0.0)
        members = " + ".join(group.roles)
        if share > 0:
            if gpu_bytes is None:
                continue
            have = int(share * gpu_bytes)
            if need > have:
                problems.append(f"group `{group.name}` ({members}) needs {_gib(need)} GiB per GPU bundle but holds "
                                f"{share:g} of a {_gib(gpu_bytes)} GiB GPU = {_gib(have)} GiB: "
                                f"{_gib(need - have)} GiB over; {_advice(group.roles)}")
        else:
            cpu_total += need * len(group.bundles)
    if host_bytes is not None and cpu_total + host_total > host_bytes * len(nodes):
        problems.append(f"CPU roles and offloaded state need {_gib(cpu_total + host_total)} GiB of host memory but "
                        f"the cluster has {_gib(host_bytes * len(nodes))} GiB; use fewer replicas, smaller "
                        "micro_batch_size or a smaller generation.vllm.kv_cache_gb")
    return table, problems


def _advice(roles: tuple[str, ...]) -> str:
    tips = []
    if any(r in roles for r in ("reference", "reward")):
        tips.append("a smaller micro_batch_size for reference / reward (a model larger than one GPU cannot be a "
                    "reference or reward model in this version: they are not sharded)")
    if "generation" in roles:
        tips.append("generation.vllm.gpu_memory_utilization at most the bundle's num_gpus")
    if any(r in roles for r in ("policy", "critic", "learner")):
        tips.append("more replicas with deepspeed.zero_stage 3, deepspeed.offload_optimizer, "
                    "model.gradient_checkpointing or a smaller micro_batch_size")
    tips.append("a larger placement.num_gpus")
    return "try " + "; ".join(tips)


def written_shapes(job, derived: dict[str, ModelShape]) -> dict[str, ModelShape]:
    """The model folder an SFT / RM stage writes, with its shape (its input model's), for the stages after it."""
    from rlhf_ray.config.jobs import FINAL_MODEL_DIR

    if job.kind not in ("sft", "rm"):
        return {}
    shape, _ = _shape(job.model, derived)
    return {f"{job.output_dir}/{FINAL_MODEL_DIR}": shape} if shape is not None else {}
