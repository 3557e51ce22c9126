"""Bytes one replica of a role needs, on its accelerator (or, for a CPU role, in host memory), by part: weights,
gradients, optimizer state, activations, the log-prob working set, KV cache. Pure arithmetic on a ModelShape.

Model states follow DeepSpeed's own estimators (stage_1_and_2.py / stage3.py): mixed precision keeps an fp32
master copy, fp32 gradients and two Adam moments (16 bytes per parameter) besides the 16-bit weights and
gradients; ZeRO stage 1 shards the optimizer state over the data-parallel ranks, stage 2 also the gradients,
stage 3 also the weights (then the largest gathered module lives whole). Activations follow Korthikanti et al.
(arXiv 2205.05198) per token and layer, re-derived for a gated MLP and grouped-query attention, with the attention
scores counted where the attention kernel stores them (eager / CPU SDPA). Logits: fp32, B x T x V, with the copies
the log-prob path keeps alive (the cast, log-softmax, its gradient).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from rlhf_ray.memory.shapes import ModelShape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GiB = 2**30


@dataclass(frozen=True)
class RoleBytes:
    """One replica's bytes by part; `host` is what it keeps in CPU memory besides (offloaded state)."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    logits: int = 0
    kv_cache: int = 0
    host: int = 0

    @property
    def device(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.kv_cache

    def __add__(self, other: RoleBytes) -> RoleBytes:
        return RoleBytes(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def model_states(params: int, dtype: str, zero_stage: int, ranks: int, offload_optimizer: bool = False,
                 offload_params: bool = False, largest_module: int = 0, trainable: int | None = None,
                 grad_bucket: int = 0) -> RoleBytes:
    """Weights, gradients and Adam state of one data-parallel rank. `trainable`: parameters with gradients and
    optimizer state (LoRA: the adapters), default all. `grad_bucket`: gradient elements DeepSpeed stages for
    reduction besides the gradients themselves (see gradient_bucket)."""
    d = DTYPE_BYTES[dtype]
    trainable = params if trainable is None else trainable
    # Mixed precision keeps an fp32 master copy and fp32 gradients for Adam; so does every ZeRO stage >= 1 even in
    # fp32 (DeepSpeed clones the rank's partition as its master and flattens each step's gradient partition).
    fp32_copies = d < 4 or zero_stage >= 1
    grad_bytes = d + (4 if fp32_copies else 0)
    optim_bytes = 8 + (4 if fp32_copies else 0)  # Adam's two moments (+ the fp32 master weights)
    weights = d * params
    if zero_stage == 3:
        weights = d * params // ranks + d * largest_module
    gradients = d * trainable if zero_stage < 2 else d * trainable // ranks
    fp32_grads = (grad_bytes - d) * trainable // (ranks if zero_stage >= 1 else 1)
    optimizer = optim_bytes * trainable // (ranks if zero_stage >= 1 else 1)
    host = 0
    # ZeRO-Offload (stage 1 up; DeepSpeed has none at stage 0): gradient partitions stream to the host, where Adam
    # steps
    if offload_optimizer and zero_stage >= 1:
        host, optimizer, gradients, fp32_grads = optimizer + fp32_grads + gradients, 0, 0, 0
    if offload_params:
        host += d * params // ranks
        weights = d * largest_module
    return RoleBytes(weights=weights, gradients=gradients + fp32_grads + d * grad_bucket, optimizer=optimizer,
                     host=host)


def gradient_bucket(trainable: int, zero_stage: int, ranks: int, reduce_bucket_size: int, on_gpu: bool,
                    overlap_comm: bool) -> int:
    """Elements of DeepSpeed's gradient staging buffers, in the gradients' dtype. ZeRO 1-3 copy gradients into a
    contiguous bucket of `reduce_bucket_size` elements (two with overlap_comm at stage 1-2) as they are produced:
    a GPU reserves it whole, a CPU process touches only what the gradients fill. ZeRO-0 over several ranks
    flattens the gradients into all-reduce buffers of up to 5e8 elements; one rank reduces nothing (our engine
    skips that pass)."""
    if zero_stage == 0:
        return min(trainable, 500_000_000) if ranks > 1 else 0
    size = reduce_bucket_size if on_gpu else min(reduce_bucket_size, trainable)
    return size * (2 if overlap_comm and zero_stage < 3 else 1)


def activation_bytes(shape: ModelShape, dtype: str, micro_batch: int, seq_len: int, gradient_checkpointing: bool,
                     attention_scores: bool) -> int:
    """Activations kept for the backward pass of one micro-batch. Per token and layer, in units of the dtype:
    7h (the layer input and its norm, q, the attention context, the residual, the MLP input and its norm), 2 kv
    (k and v), 4I gated (gate, up, activation, product) or 2I plain; `attention_scores`: the softmax
    probabilities (heads x seq per token, the dtype) and the pre-softmax scores. With gradient checkpointing:
    each layer's input, plus one layer's whole set."""
    d = DTYPE_BYTES[dtype]
    tokens = micro_batch * seq_len
    kv = shape.kv_heads * shape.dim_per_head
    per_token = 7 * shape.hidden + 2 * kv + (4 if shape.gated_mlp else 2) * shape.intermediate
    if attention_scores:
        per_token += 2 * shape.heads * seq_len
    layer = d * tokens * per_token
    if gradient_checkpointing:
        return d * tokens * shape.hidden * shape.layers + layer
    return layer * shape.layers


def logits_bytes(shape: ModelShape, micro_batch: int, positions: int, training: bool) -> int:
    """The log-prob working set of one micro-batch: fp32 logits of `positions` per sequence, the log-softmax
    output, and in training their gradients (TRL and veRL count the same ~3 copies)."""
    copies = 3 if training else 2
    return 4 * micro_batch * positions * shape.vocab * copies


def learner_bytes(shape: ModelShape, *, dtype: str, zero_stage: int, ranks: int, micro_batch: int, seq_len: int,
                  logit_positions: int, offload_optimizer: bool = False, offload_params: bool = False,
                  gradient_checkpointing: bool = False, attention_scores: bool = True, scalar_head: bool = False,
                  trainable: int | None = None, grad_bucket: int = 0) -> RoleBytes:
    """A training rank: model states + activations of one micro-batch + (causal LM) its logits."""
    params = shape.backbone_params if scalar_head else shape.params
    states = model_states(params, dtype, zero_stage, ranks, offload_optimizer, offload_params,
                          shape.largest_module_params, trainable, grad_bucket)
    acts = activation_bytes(shape, dtype, micro_batch, seq_len, gradient_checkpointing, attention_scores)
    logits = 0 if scalar_head else logits_bytes(shape, micro_batch, logit_positions, training=True)
    return states + RoleBytes(activations=acts, logits=logits)


def inference_bytes(shape: ModelShape, *, dtype: str, micro_batch: int, seq_len: int, logit_positions: int,
                    scalar_head: bool = False, shards: int = 1, attention_scores: bool = True) -> RoleBytes:
    """A scoring replica (reference, reward): weights (its shard), one layer's activations at a time (no graph is
    kept), and the logits of the answer positions."""
    params = shape.backbone_params if scalar_head else shape.params
    d = DTYPE_BYTES[dtype]
    acts = activation_bytes(shape, dtype, micro_batch, seq_len, gradient_checkpointing=False,
                            attention_scores=attention_scores) // shape.layers
    logits = 0 if scalar_head else logits_bytes(shape, micro_batch, logit_positions, training=False)
    weights = d * params // shards + (d * shape.largest_module_params if shards > 1 else 0)
    return RoleBytes(weights=weights, activations=acts, logits=logits)


def engine_bytes(shape: ModelShape, *, dtype: str, device_bytes: int | None, gpu_memory_utilization: float,
                 kv_cache_gb: float, tensor_parallel: int = 1) -> RoleBytes:
    """A vLLM engine. On a GPU it takes gpu_memory_utilization of the whole device, whatever the model needs (the
    KV cache fills the rest; per GPU of a tensor-parallel engine); on CPU its weights twice plus `kv_cache_gb` (a
    tensor-parallel engine's workers share the bundle's host memory: the whole model and cache, counted once).
    Twice: vLLM's CPU kernels re-lay each linear layer's weights for oneDNN when they load (the LM head keeps both
    layouts), and the process keeps the memory of the first layout; measured with SmolLM2 in fp32 (vllm 0.32,
    docs/benchmarks.md "Rehearsal"): 1.99 GB above the runtime for 0.51 GB of weights and a 1 GiB cache."""
    d = DTYPE_BYTES[dtype]
    weights = d * shape.params // (tensor_parallel if device_bytes else 1)
    if device_bytes:
        reserved = int(gpu_memory_utilization * device_bytes)
        return RoleBytes(weights=weights, kv_cache=max(reserved - weights, 0))
    return RoleBytes(weights=2 * weights, kv_cache=int(kv_cache_gb * GiB))
