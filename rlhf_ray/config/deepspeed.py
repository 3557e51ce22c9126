"""DeepSpeed ZeRO settings of one learner role, and their translation into a DeepSpeed config dict."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel


class DeepSpeedSpec(StrictModel):
    """ZeRO stage and its communication knobs, offload, accumulation and fp16 loss scaling of a learner group. Its
    precision is the role's `model.dtype` (one place to say it): fp16 gets dynamic loss scaling as in
    DeepSpeed-Chat, bf16 and fp32 need none."""

    zero_stage: Literal[0, 1, 2, 3] = 2
    """0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + parameters."""
    offload_optimizer: bool = False
    """Keep optimizer state on CPU (ZeRO-Offload, zero_stage 1 or more): far less accelerator memory, slower
    steps."""
    offload_params: bool = False
    """Keep parameters on CPU between uses (ZeRO-3 only)."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step."""
    gradient_clipping: float = Field(1.0, ge=0)
    """Global-norm clip; 0 disables."""
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    """Elements per gradient reduce-scatter bucket (ZeRO 1-3)."""
    allgather_bucket_size: int = Field(500_000_000, gt=0, multiple_of=2)
    """Elements per parameter all-gather bucket (ZeRO 1-2; even: DeepSpeed aligns its send buffers to 4 bytes)."""
    stage3_prefetch_bucket_size: int = Field(30_000_000, gt=0)
    """ZeRO-3: elements of parameters fetched ahead of use."""
    stage3_param_persistence_threshold: int = Field(10_000, ge=0)
    """ZeRO-3: parameters smaller than this stay unpartitioned."""
    stage3_max_live_parameters: int = Field(30_000_000, gt=0)
    """ZeRO-3: most gathered parameter elements alive at once."""
    overlap_comm: bool | None = None
    """Reduce gradients on a separate stream while the backward goes on, with a second gradient bucket for double
    buffering (costs another reduce_bucket_size of memory). Unset: DeepSpeed's default, on for ZeRO-3 and off for
    ZeRO-1/2. Pays on GPUs with several ranks; on CPU there is no second stream to overlap with."""
    contiguous_gradients: bool = True
    """ZeRO-2/3: copy each gradient into a preallocated contiguous buffer as it is reduced (less fragmentation, a
    buffer of reduce_bucket_size elements; needed by reduce_scatter). DeepSpeed turns it off for ZeRO-1 and on with
    CPU offload."""
    reduce_scatter: bool = True
    """ZeRO-1/2: reduce each bucket's slices to the rank that owns them instead of all-reducing the whole bucket
    (half the traffic); off falls back to all-reduce."""
    round_robin_gradients: bool = False
    """ZeRO-2: deal gradients to ranks round-robin in the flat buffer, so the copy to CPU with offload_optimizer is
    spread over ranks; helps with offload and gradient accumulation, nothing otherwise."""
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    """Dtype gradients accumulate in over gradient_accumulation_steps (DeepSpeed's data_types.grad_accum_dtype).
    Unset: the model's dtype. fp32 with a bf16 model keeps small accumulated gradients exact at 2 bytes more per
    parameter (ZeRO-1 holds them whole, so it suits many micro-batches per step)."""
    initial_scale_power: int = Field(16, ge=0, le=64)
    """fp16 only: the dynamic loss scale starts at 2**initial_scale_power; each overflow skips a step, so a high
    power spends the first steps skipping until the scale comes down."""
    loss_scale_window: int = Field(100, ge=1)
    """fp16 only: steps without overflow before the loss scale doubles."""
    hysteresis: int = Field(2, ge=1)
    """fp16 only: overflows tolerated before the loss scale halves."""
    min_loss_scale: int = Field(1, ge=1)
    """fp16 only: the loss scale never goes below this."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Raw DeepSpeed config keys merged last (nested dicts merge key by key), for anything not modelled here."""

    @model_validator(mode="after")
    def _knobs_of_the_stage(self) -> "DeepSpeedSpec":
        """Options that do nothing at this stage are refused (a default left alone is fine)."""
        stage = self.zero_stage
        for name, stages in (("overlap_comm", (1, 2, 3)), ("contiguous_gradients", (2, 3)),
                             ("reduce_scatter", (1, 2)), ("round_robin_gradients", (2,))):
            default = type(self).model_fields[name].default
            if getattr(self, name) != default and stage not in stages:
                raise FieldProblem(name, f"{name} acts at ZeRO stage {' / '.join(map(str, stages))}, not at "
                                         f"zero_stage {stage}: remove it (or change zero_stage)")
        return self

    @model_validator(mode="after")
    def _offload_optimizer_needs_zero(self) -> "DeepSpeedSpec":
        # DeepSpeed reads the offload setting only in its ZeRO optimizers; at stage 0 the CPU Adam we hand it would
        # step the model's own (GPU) parameters and fails its first step: "CPUAdam param is on cuda:0 and must be
        # 'cpu'". On CPU the same config would run, so refuse it everywhere: what validates must start on a GPU.
        if self.offload_optimizer and self.zero_stage == 0:
            raise FieldProblem(
                "offload_optimizer",
                "optimizer offload (ZeRO-Offload) needs zero_stage 1, 2 or 3 (got 0: DeepSpeed keeps a ZeRO-0 "
                "optimizer beside the model, on the GPU); set zero_stage: 1 or more (the Adam state then lives on "
                "the host) or offload_optimizer: false",
            )
        return self

    @model_validator(mode="after")
    def _offload_params_needs_stage3(self) -> "DeepSpeedSpec":
        if self.offload_params and self.zero_stage != 3:
            raise FieldProblem(
                "offload_params",
                f"parameter offload needs zero_stage: 3 (got {self.zero_stage}); set zero_stage: 3 or offload_params: false",
            )
        return self

    def precision_problem(self, dtype: str) -> tuple[str, str] | None:
        """(field, why) when a precision knob does not fit the role's model.dtype, else None."""
        for name in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
            if dtype != "fp16" and getattr(self, name) != type(self).model_fields[name].default:
                return name, f"{name} sets fp16 loss scaling, but model.dtype is {dtype} (bf16 and fp32 train " \
                             "unscaled): remove it, or set model.dtype: fp16"
        if self.grad_accum_dtype not in (None, dtype) and self.zero_stage == 0:
            return "grad_accum_dtype", f"DeepSpeed accumulates gradients in another dtype than the model's " \
                                       f"({dtype}) only under ZeRO: set zero_stage 1 (or more), or remove it"
        return None

    def to_ds_config(self, precision: str, micro_batch_size: int, data_parallel_size: int) -> dict[str, Any]:
        """The DeepSpeed config dict for a learner with this many data-parallel ranks."""
        zero: dict[str, Any] = {
            "stage": self.zero_stage,
            "reduce_bucket_size": self.reduce_bucket_size,
            "allgather_bucket_size": self.allgather_bucket_size,
            "offload_optimizer": {"device": "cpu" if self.offload_optimizer else "none"},
            "contiguous_gradients": self.contiguous_gradients,
            "reduce_scatter": self.reduce_scatter,
            "round_robin_gradients": self.round_robin_gradients,
        }
        if self.overlap_comm is not None:
            zero["overlap_comm"] = self.overlap_comm
        if self.zero_stage == 3:
            zero.update(
                offload_param={"device": "cpu" if self.offload_params else "none"},
                stage3_prefetch_bucket_size=self.stage3_prefetch_bucket_size,
                stage3_param_persistence_threshold=self.stage3_param_persistence_threshold,
                stage3_max_live_parameters=self.stage3_max_live_parameters,
                stage3_gather_16bit_weights_on_model_save=True,
            )
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "train_batch_size": micro_batch_size * self.gradient_accumulation_steps * data_parallel_size,
            "gradient_clipping": self.gradient_clipping,
            "zero_optimization": zero,
            "bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": self.initial_scale_power,
                     "loss_scale_window": self.loss_scale_window, "hysteresis": self.hysteresis,
                     "min_loss_scale": self.min_loss_scale},
            "steps_per_print": 10**9,  # progress is ours to report, not DeepSpeed's
            "wall_clock_breakdown": False,
        }
        if self.grad_accum_dtype is not None:
            config["data_types"] = {"grad_accum_dtype": self.grad_accum_dtype}
        return _deep_merge(config, self.extra)


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
