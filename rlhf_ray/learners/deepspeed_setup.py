"""DeepSpeed engine construction for one learner rank: optimizer, LoRA, the engine itself."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys

import torch

from rlhf_ray.config.deepspeed import DeepSpeedSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.optim import OptimizerSpec
from rlhf_ray.distributed import on_gpu

log = logging.getLogger(__name__)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm scales are 1-D in every architecture, so no name list can miss them.
    Frozen parameters (LoRA's base model) are left out, and so are empty groups (DeepSpeed would drop them and
    desynchronise the LR scheduler)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def make_optimizer(model: torch.nn.Module, optim: OptimizerSpec, ds: DeepSpeedSpec) -> torch.optim.Optimizer:
    """AdamW: DeepSpeed's CPU Adam for an offloaded optimizer, its FusedAdam on a GPU, else torch's default AdamW.
    (torch's fused CPU kernel steps SmolLM2 3.5x faster, benchmarks/HISTORY.md "Optimizer step on CPU", but is not used
    yet: its different rounding moved the quickstart PPO test's single seeded run below two of its thresholds.)"""
    groups = param_groups(model, optim.weight_decay)
    kwargs = {"lr": optim.lr, "betas": optim.betas, "eps": optim.eps}
    if ds.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    if on_gpu():
        from deepspeed.ops.adam import FusedAdam

        plain_cuda_arch_list()
        return FusedAdam(groups, adam_w_mode=True, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def plain_cuda_arch_list() -> None:
    """Drop architecture-specific suffixes (Hopper's `9.0a`) from TORCH_CUDA_ARCH_LIST before DeepSpeed JIT-builds
    FusedAdam: DeepSpeed 0.19 reads every entry as numbers and fails on `9.0a` (seen on an H200 image that sets it),
    and the fused optimizer needs no architecture-specific instructions."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    plain = re.sub(r"(\d)[a-z]+\b", r"\1", value)
    if plain != value:
        log.info("TORCH_CUDA_ARCH_LIST %r -> %r for DeepSpeed's JIT build of FusedAdam", value, plain)
        os.environ["TORCH_CUDA_ARCH_LIST"] = plain


def apply_lora(model: torch.nn.Module, spec: ModelSpec) -> torch.nn.Module:
    """Wrap with peft LoRA adapters; with only_optimize_lora the base weights stay frozen (a scalar head, if the model
    has one, trains)."""
    if not spec.lora.enabled:
        return model
    from peft import LoraConfig, get_peft_model

    lora = spec.lora
    # a reward model's or critic's scalar head trains with the adapters (a fresh head would stay random otherwise)
    heads = [name for name in ("score", "classifier", "v_head") if isinstance(getattr(model, name, None),
                                                                           torch.nn.Module)]
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=lora.target_modules, bias="none", modules_to_save=heads or None)
    model = get_peft_model(model, config)
    if not lora.only_optimize_lora:
        for p in model.parameters():
            p.requires_grad_(True)
    if spec.gradient_checkpointing:
        # frozen embeddings give checkpointed blocks inputs without grad, and then no gradient at all
        model.enable_input_require_grads()
    return model


def skip_flagged_steps(optimizer: torch.optim.Optimizer) -> None:
    """Give a plain torch optimizer DeepSpeed's overflow protocol: while `optimizer.overflow` is set its step does
    nothing, and the engine, which reads that attribute after stepping, then counts a skipped step and leaves the
    LR schedule where it was (as its own fp16 / ZeRO optimizers do on a non-finite gradient)."""
    optimizer.overflow = False
    step = optimizer.step

    def guarded(*args, **kwargs):
        return None if optimizer.overflow else step(*args, **kwargs)

    optimizer.step = guarded


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def compiled_on_first_call(fn):
    """`torch.compile(fn)`, built when the function is first called instead of when it is defined."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


def import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer with its kernels compiled on their first call, not on import.

    Building any engine imports that module (the ZeRO sanity check and the ZeRO optimizers ask whether the optimizer
    is a Muon one), and the module hands three functions to `torch.compile` as it loads, which imports torch's whole
    compiler stack: 1.5 of the 1.8 CPU-seconds a tiny model's engine took to build, in every learner process of every
    job, for an optimizer no role here uses. Imported first from here, while DeepSpeed's `compiler.compile()` hands
    out `compiled_on_first_call`, every later import finds the module loaded: the same functions, compiled if ever
    called."""
    if MUON_MODULE in sys.modules:
        return
    from deepspeed.runtime import compiler

    with contextlib.suppress(ImportError), _swapped(compiler, "compile", lambda: compiled_on_first_call):
        __import__(MUON_MODULE)


@contextlib.contextmanager
def _swapped(owner, name: str, value):
    kept = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, kept)


def build_deepspeed(model: torch.nn.Module, spec: ModelSpec, optim: OptimizerSpec, ds: DeepSpeedSpec,
                 micro_batch_size: int, world_size: int, total_steps: int):
    """DeepSpeed engine with our optimizer and LR schedule; returns (engine, scheduler)."""
    import deepspeed
    from transformers import get_scheduler

    import_muon_uncompiled()

    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = make_optimizer(model, optim, ds)
    scheduler = get_scheduler(optim.lr_scheduler, optimizer, num_warmup_steps=optim.warmup_steps,
                              num_training_steps=max(total_steps, 1))
    config = ds.to_ds_config(spec.dtype, micro_batch_size, world_size)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config,
                                      dist_init_required=False)
    if engine.optimizer is optimizer:  # fp32 ZeRO-0: DeepSpeed drives our torch optimizer directly
        skip_flagged_steps(optimizer)
    if world_size == 1 and ds.zero_stage == 0:
        # one rank has nothing to average: DeepSpeed would still copy every gradient into flat buckets, "all-reduce"
        # them over a group of one, divide by one and copy them back, after each accumulation boundary
        engine.enable_backward_allreduce = False
    return engine, scheduler
