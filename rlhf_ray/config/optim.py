"""Optimizer and learning-rate schedule of one trained role."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_ray.config.base import StrictModel

Scheduler = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]


class OptimizerSpec(StrictModel):
    """AdamW with decoupled weight decay; bias and norm weights are never decayed.

    Its kernel follows the placement: DeepSpeed's FusedAdam on a GPU, its CPU Adam with
    `deepspeed.offload_optimizer`, torch's AdamW on CPU. DeepSpeed compiles the first two at a machine's first job
    (with nvcc, with a C++ compiler; cached in ~/.cache/torch_extensions); a job on CPU without offload compiles
    nothing and needs no compiler (benchmarks/HISTORY.md "Start-up compiles on CPU")."""

    lr: float = Field(1e-5, gt=0)
    """Peak learning rate (after warm-up)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay for weights other than biases and norms."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas (DeepSpeed-Chat's (0.9, 0.95))."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    lr_scheduler: Scheduler = "cosine"
    """Learning-rate schedule after warm-up (transformers.get_scheduler names)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up."""
