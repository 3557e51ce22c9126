"""A job's memory, role by role and bundle by bundle, against what its devices hold.

A bundle's roles add up (colocated roles share the bundle's device). On a GPU a bundle may use its share of the
device: `num_gpus` x the GPU's memory (0.75 of an 80 GB GPU: 60 GB); a vLLM engine reserves
gpu_memory_utilization of the whole device whatever its share, so its share must cover that. CPU bundles share
their node's host memory: the sum of every CPU bundle and of what learners offload to the host is checked against
the cluster's host memory (an approximation on several nodes: which node a bundle lands on is Ray's choice).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from rlhf_ray.memory.estimate import (DTYPE_BYTES, GiB, RoleBytes, engine_bytes, gradient_bucket, inference_bytes,
                                      learner_bytes)
from rlhf_ray.functions import load_function
from rlhf_ray.memory.shapes import ModelShape, shape_of
from rlhf_ray.models.packaged import packaged_model

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




def _shape(spec, derived: dict[str, ModelShape]) -> tuple[ModelShape | None, str]:
    """The model's shape: `size_like`, else its folder or hub id, else what an earlier stage writes there."""
    name = spec.size_like or spec.path or spec.gguf_file or "?"
    if spec.gguf_file and not spec.path and not spec.size_like:
        packaged = packaged_model(spec.gguf_file)
        name = packaged.like if packaged else spec.gguf_file
    return (derived.get(name) or shape_of(name)), name


def learner_memory(shape: ModelShape, spec, deepspeed, replicas: int, micro: int, seq: int, positions: int, gpu: bool,
                   scalar: bool) -> RoleBytes:
    """One learner rank's bytes from its ModelSpec and DeepSpeedSpec (what `validate` and the calibration
    benchmark both compute)."""
    params = shape.backbone_params if scalar else shape.params
    trainable = params
    if spec.lora.enabled and spec.lora.only_optimize_lora:  # adapters (and a scalar head) train, the base is frozen
        trainable = shape.lora_params(spec.lora.rank, spec.lora.target_modules) + (shape.hidden if scalar else 0)
    default_overlap = deepspeed.zero_stage == 3 if deepspeed.overlap_comm is None else deepspeed.overlap_comm
    overlap = deepspeed.extra.get("zero_optimization", {}).get("overlap_comm", default_overlap)
    bucket = gradient_bucket(trainable, deepspeed.zero_stage, replicas, deepspeed.reduce_bucket_size, gpu, overlap)
    return learner_bytes(shape, dtype=spec.dtype, zero_stage=deepspeed.zero_stage, ranks=replicas, micro_batch=micro,
                         seq_len=seq, logit_positions=positions, offload_optimizer=deepspeed.offload_optimizer,
                         offload_params=deepspeed.offload_params, gradient_checkpointing=spec.gradient_checkpointing,
                         attention_scores=not gpu, scalar_head=scalar, trainable=trainable, grad_bucket=bucket)


def _learner(name: str, spec, deepspeed, replicas: int, micro: int, seq: int, positions: int, gpu: bool,
             scalar: bool, derived: dict[str, ModelShape]) -> RoleMemory:
    shape, model = _shape(spec, derived)
    if shape is None:
        return RoleMemory(name, model, None, f"shape of {model} unknown: set {name}.model.size_like to a hub id "
                                             "of the same architecture")
    got = learner_memory(shape, spec, deepspeed, replicas, micro, seq, positions, gpu, scalar)
    how = (f"{shape.params / 1e9:.2f}B {spec.dtype}, ZeRO-{deepspeed.zero_stage} over {replicas}, "
           f"micro-batch {micro} x {seq} tokens{', checkpointed' if spec.gradient_checkpointing else ''}")
    return RoleMemory(name, model, got, how)


def _scorer(name: str, role, seq: int, positions: int, scalar: bool, derived: dict[str, ModelShape]
            ) -> RoleMemory:
    spec = role.model
    micro, seq, positions = _micro_batch(role, seq, positions)
    shape, model = _shape(spec, derived)
    if shape is None:
        return RoleMemory(name, model, None, f"shape of {model} unknown: set {name}.model.size_like")
    shards = role.placement.replicas if role.sharded else 1
    got = inference_bytes(shape, dtype=spec.dtype, micro_batch=micro, seq_len=seq, logit_positions=positions,
                          scalar_head=scalar, shards=shards, attention_scores=role.placement.num_gpus == 0)
    sharding = f", ZeRO-3 shard 1/{shards}" if shards > 1 else ""
    return RoleMemory(name, model, got, f"{shape.params / 1e9:.2f}B {spec.dtype}{sharding}, forward of {micro} x "
                                        f"{seq} tokens")


def role_memory(job, gpu_bytes: int | None = None, derived: dict[str, ModelShape] | None = None
                ) -> dict[str, RoleMemory]:
    """Per-replica bytes of every role of one job, by the function its kind names (JobBase.memory). `derived`: shapes
    of model folders an earlier pipeline stage writes (the SFT output has the SFT input's shape)."""
    if type(job).memory is None:
        if job.stages() != [job]:
            raise ValueError(f"a {job.kind} job has no roles of its own to size (size its stages)")
        return {}  # a kind that places no actors (Ray tasks only, or nothing on the cluster)
    return load_function(type(job).memory)(job, gpu_bytes, derived or {})


def learner_memory_roles(job, gpu_bytes: int | None, derived: dict[str, ModelShape]) -> dict[str, RoleMemory]:
    """Pretrain, SFT and RM: one learner group."""
    gpu = job.placement.num_gpus > 0
    micro = job.train.micro_batch_size * (2 if job.kind == "rm" else 1)  # chosen + rejected
    seq = _corpus_seq_len(job.data) if job.kind == "pretrain" else job.data.max_seq_len
    return {"learner": _learner("learner", job.model, job.deepspeed, job.placement.replicas, micro, seq, seq, gpu,
                                job.kind == "rm", derived)}


def dpo_memory_roles(job, gpu_bytes: int | None, derived: dict[str, ModelShape]) -> dict[str, RoleMemory]:
    """DPO: chosen + rejected of each pair in one forward, every answer position scored; the reference alike."""
    seq, micro = job.data.max_seq_len, 2 * job.train.micro_batch_size
    reference = job.dpo.reference.model_copy(update={"model": job.reference_model,
                                                     "micro_batch_size": 2 * job.dpo.reference.micro_batch_size})
    return {"learner": _learner("learner", job.model, job.deepspeed, job.placement.replicas, micro, seq, seq,
                                job.placement.num_gpus > 0, False, derived),
            "reference": _scorer("reference", reference, seq, seq, False, derived)}


def _micro_batch(role, seq: int, positions: int) -> tuple[int, int, int]:
    """(rows, tokens per row, logit positions per row) a learner's micro-batch is sized as. Cut by a token budget,
    it holds at most the budget's tokens: sized as the full-length rows the budget holds (activations, attention)
    with logits at up to every budgeted token (short rows: many answers to a forward)."""
    budget = getattr(role, "max_tokens_per_micro_batch", None)  # a DPO reference has none
    if budget is None:
        return role.micro_batch_size, seq, positions
    rows = max(1, budget // seq)
    return rows, seq, -(-budget // rows) if positions else 0


def ppo_memory_roles(job, gpu_bytes: int | None, derived: dict[str, ModelShape]) -> dict[str, RoleMemory]:
    """PPO: policy, reference, critic, reward and the generation engines."""
    answer = job.generation.max_answer_tokens
    seq = job.data.max_prompt_len + answer
    policy = job.policy
    out = {"policy": _learner("policy", policy.model, policy.deepspeed, policy.placement.replicas,
                              *_micro_batch(policy, seq, answer + 1), policy.placement.num_gpus > 0, False, derived)}
    for name in ("reference", "teacher"):
        if getattr(job, name) is not None:
            out[name] = _scorer(name, getattr(job, name), seq, answer + 1, False, derived)
    if job.critic is not None:
        critic = job.critic
        out["critic"] = _learner("critic", critic.model, critic.deepspeed, critic.placement.replicas,
                                 *_micro_batch(critic, seq, 0), critic.placement.num_gpus > 0, True, derived)
    if job.reward.is_model:
        out["reward"] = _scorer("reward", job.reward, seq, 0, True, derived)
    elif job.reward.http is not None:
        out["reward"] = RoleMemory("reward", job.reward.http.url, RoleBytes(), "a reward server")
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
        batch = -(-job.ppo.prompts_per_rollout * gen.sampling.n_samples_per_prompt // gen.placement.replicas)
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


@dataclass(frozen=True)
class PlacementMemory:
    """One placement group's bundle: the roles on it, the bytes they need together, what it holds."""

    placement: str
    roles: tuple[str, ...]
    need: int
    gpu_share: float
    """GPUs per bundle (0: a CPU bundle, checked against host memory as a whole)."""
    have: int | None
    """Bytes of the bundle's share of one GPU (a bundle of several GPUs, a tensor-parallel engine's, has one
    whole GPU per worker: `need` is then per GPU too); None for a CPU bundle or a GPU of unknown size."""
    bundles: int
    host: int
    """Bytes its roles offload to host memory, per bundle."""


def placement_memory(roles: dict[str, RoleMemory], plan, gpu_bytes: int | None) -> list[PlacementMemory]:
    out = []
    for placement in plan.placements:
        known = [roles[r] for r in placement.roles if roles.get(r) and roles[r].bytes is not None]
        share = placement.bundles[0].get("GPU", 0.0)
        have = int(min(share, 1.0) * gpu_bytes) if share > 0 and gpu_bytes else None
        out.append(PlacementMemory(placement.name, tuple(placement.roles), sum((rm.bytes.device for rm in known), 0),
                                   share, have, len(placement.bundles), sum(rm.bytes.host for rm in known)))
    return out


MEMORY_COLUMNS = ("role", "weights", "grads", "optim", "activ", "logits", "KV", "device", "host")


def check_memory(job, plan, nodes: list[dict[str, float]], derived: dict[str, ModelShape] | None = None,
                 name: str | None = None) -> tuple[Group, list[str]]:
    """The memory table of one job's plan, titled `name` (default: the job's kind; short columns, each role's
    assumptions below it: it reads at 80 columns, in a terminal or a log), and what does not fit (naming the
    placement group, its roles, the bytes over and the fields to change)."""
    gpu_bytes = max((int(n.get(GPU_MEMORY, 0)) for n in nodes), default=0) or None
    host_bytes = max((int(n.get(HOST_MEMORY, 0)) for n in nodes), default=0) or None
    roles = role_memory(job, gpu_bytes, derived)
    table = Table(title=f"{name or job.kind}: memory per replica (GiB)", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, show_edge=False)
    for column in MEMORY_COLUMNS:
        table.add_column(column, justify="left" if column == "role" else "right", no_wrap=True)
    for name, rm in roles.items():
        b = rm.bytes
        if b is None:
            table.add_row(name, *["?"] * (len(MEMORY_COLUMNS) - 1))
            continue
        table.add_row(name, _gib(b.weights), _gib(b.gradients), _gib(b.optimizer), _gib(b.activations),
                      _gib(b.logits), _gib(b.kv_cache), _gib(b.device), _gib(b.host))
    notes = [Text("device: total on the role's device (host memory on CPU); host: offloaded state"),
             Text("assumed:"), *(Text(f"  {name}: {rm.how}") for name, rm in roles.items())]
    problems, cpu_total, host_total = [], 0, 0
    for g in placement_memory(roles, plan, gpu_bytes):
        host_total += g.host * g.bundles
        members = " + ".join(g.roles)
        if g.gpu_share == 0:
            cpu_total += g.need * g.bundles
        elif g.have is not None and g.need > g.have:
            problems.append(f"placement group `{g.placement}` ({members}) needs {_gib(g.need)} GiB per GPU bundle "
                            f"but holds {min(g.gpu_share, 1.0):g} of a {_gib(gpu_bytes)} GiB GPU = {_gib(g.have)} GiB: "
                            f"{_gib(g.need - g.have)} GiB over; {_advice(g.roles)}")
    if host_bytes is not None and cpu_total + host_total > host_bytes * len(nodes):
        problems.append(f"CPU roles and offloaded state need {_gib(cpu_total + host_total)} GiB of host memory but "
                        f"the cluster has {_gib(host_bytes * len(nodes))} GiB; use fewer replicas, smaller "
                        "micro_batch_size or a smaller generation.vllm.kv_cache_gb")
    return Group(table, *notes), problems


def recipe_table(job, plan, nodes: list[dict[str, float]], derived: dict[str, ModelShape] | None = None
                 ) -> list[str]:
    """Markdown rows `| placement group | roles | bundles | need GiB | holds GiB |` of one job's GPU bundles."""
    gpu_bytes = max((int(n.get(GPU_MEMORY, 0)) for n in nodes), default=0) or None
    rows = []
    for g in placement_memory(role_memory(job, gpu_bytes, derived), plan, gpu_bytes):
        holds = _gib(g.have) if g.have is not None else ("host" if g.gpu_share == 0 else "?")
        rows.append(f"| {job.kind} | `{g.placement}` | {' + '.join(g.roles)} | {g.bundles} | {_gib(g.need)} | {holds} |")
    return rows


def _advice(roles: tuple[str, ...]) -> str:
    tips = []
    if any(r in roles for r in ("reference", "reward")):
        tips.append("reference / reward: sharded: true over more replicas (ZeRO-3 inference), or a smaller "
                    "micro_batch_size")
    if "generation" in roles:
        tips.append("generation.vllm.gpu_memory_utilization at most the bundle's num_gpus")
    if any(r in roles for r in ("policy", "critic", "learner")):
        tips.append("more replicas with deepspeed.zero_stage 3, deepspeed.offload_optimizer, "
                    "model.gradient_checkpointing or a smaller micro_batch_size")
    tips.append("a larger placement.num_gpus")
    return "try " + "; ".join(tips)


def _corpus_seq_len(data) -> int:
    """The longest sample a pretrain job trains on: data.max_seq_len, else the longest sample of its corpora (read
    from their indexes), else 512 (preprocess's default --max-len) while they are not written yet."""
    from rlhf_ray.data.mmap_corpus import MMapCorpus

    if data.max_seq_len is not None:
        return data.max_seq_len
    try:
        return max(int(MMapCorpus(c.path).sizes.max(initial=1)) for c in data.corpora)
    except (OSError, ValueError):
        return 512


def written_shapes(job, derived: dict[str, ModelShape]) -> dict[str, ModelShape]:
    """The model folder a pretrain / SFT / RM / DPO stage writes, with its shape (its input model's), for the stages after
    it."""
    from rlhf_ray.config.jobs import FINAL_MODEL_DIR

    if job.kind not in ("pretrain", "sft", "rm", "dpo"):
        return {}
    shape, _ = _shape(job.model, derived)
    return {f"{job.output_dir}/{FINAL_MODEL_DIR}": shape} if shape is not None else {}
