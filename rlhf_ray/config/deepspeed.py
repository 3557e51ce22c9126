"""DeepSpeed ZeRO settings of one learner role, and their translation into a DeepSpeed config dict."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel


class DeepSpeedSpec(StrictModel):
    """ZeRO stage, offload and accumulation of a learner group. Its precision is the role's `model.dtype`
    (one place to say it): fp16 gets dynamic loss scaling as in DeepSpeed-Chat, bf16 and fp32 need none."""

    zero_stage: Literal[0, 1, 2, 3] = 2
    """0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + parameters."""
    offload_optimizer: bool = False
    """Keep optimizer state on CPU (ZeRO-Offload): far less accelerator memory, slower steps."""
    offload_params: bool = False
    """Keep parameters on CPU between uses (ZeRO-3 only)."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step."""
    gradient_clipping: float = Field(1.0, ge=0)
    """Global-norm clip; 0 disables."""
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    """Elements per gradient reduce-scatter bucket (ZeRO 1-3)."""
    allgather_bucket_size: int = Field(500_000_000, gt=0)
    """Elements per parameter all-gather bucket (ZeRO 1-2)."""
    stage3_prefetch_bucket_size: int = Field(30_000_000, gt=0)
    """ZeRO-3: elements of parameters fetched ahead of use."""
    stage3_param_persistence_threshold: int = Field(10_000, ge=0)
    """ZeRO-3: parameters smaller than this stay unpartitioned."""
    stage3_max_live_parameters: int = Field(30_000_000, gt=0)
    """ZeRO-3: most gathered parameter elements alive at once."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Raw DeepSpeed config keys merged last (nested dicts merge key by key), for anything not modelled here."""

    @model_validator(mode="after")
    def _offload_params_needs_stage3(self) -> "DeepSpeedSpec":
        if self.offload_params and self.zero_stage != 3:
            raise FieldProblem(
                "offload_params",
                f"parameter offload needs zero_stage: 3 (got {self.zero_stage}); set zero_stage: 3 or offload_params: false",
            )
        return self

    def to_ds_config(self, precision: str, micro_batch_size: int, data_parallel_size: int) -> dict[str, Any]:
        """The DeepSpeed config dict for a learner with this many data-parallel ranks."""
        zero: dict[str, Any] = {
            "stage": self.zero_stage,
            "reduce_bucket_size": self.reduce_bucket_size,
            "allgather_bucket_size": self.allgather_bucket_size,
            "offload_optimizer": {"device": "cpu" if self.offload_optimizer else "none"},
        }
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
            "fp16": {"enabled": precision == "fp16", "loss_scale_window": 100},
            "steps_per_print": 10**9,  # progress is ours to report, not DeepSpeed's
            "wall_clock_breakdown": False,
        }
        return _deep_merge(config, self.extra)


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
