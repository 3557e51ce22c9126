"""One rank of a DeepSpeed learner group. The driver calls every method on all ranks at once: ZeRO steps,
checkpoints and parameter gathers are collectives, and calling a subset of ranks would deadlock."""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from rlhf_ray.config.deepspeed import DeepSpeedSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.optim import OptimizerSpec
from rlhf_ray.distributed import RendezvousHost, all_reduce, init_process_group
from rlhf_ray.learners.deepspeed_setup import apply_lora, build_deepspeed
from rlhf_ray.models.lora_weights import adapter_file_name, is_adapter
from rlhf_ray.models.lora_weights import folded as lora_folded, units as lora_units
from rlhf_ray.models.weight_buckets import group_by_size, whole_layers
from rlhf_ray.memory.probe import PeakMemory

log = logging.getLogger(__name__)


def peak_memory_gib() -> float:
    """This rank's peak memory so far: the GPU's allocated bytes on a GPU, else the process's peak resident set
    (VmHWM: weights, optimizer state, activations, and whatever the libraries keep)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


class LearnerRank(RendezvousHost):
    """Holds the DeepSpeed engine of one rank. Subclasses say which model to build and how a step's loss is made."""

    def __init__(self, *, rank: int, world_size: int, model: dict, optim: dict, deepspeed: dict,
                 micro_batch_size: int, seed: int):
        self.memory = PeakMemory()  # before the model: its peak counts what the model and training add
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.model_spec = ModelSpec.model_validate(model)
        self.optim_spec = OptimizerSpec.model_validate(optim)
        self.ds_spec = DeepSpeedSpec.model_validate(deepspeed)
        self.micro_batch_size = micro_batch_size
        self.deepspeed = None
        self._grad_norm: float | None = None  # see optimizer_step
        self.step_counts = {"applied": 0, "skipped": 0}
        """Optimizer steps this rank applied and skipped (non-finite gradients) since it started."""
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    # ---- setup -------------------------------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def setup(self, master_addr: str, master_port: int, total_steps: int, collective_timeout_s: float = 1800.0) -> dict:
        """Join the group's process group (its collectives fail after `collective_timeout_s`: a rank that stops
        answering ends the step instead of blocking the others forever) and build this rank's DeepSpeed engine."""
        init_process_group(self.rank, self.world_size, master_addr, master_port, self.take_listener(master_port),
                           collective_timeout_s)
        self._seed_everything(self.seed)
        ds_config = self.ds_spec.to_ds_config(self.model_spec.dtype, self.micro_batch_size, self.world_size)
        if self.ds_spec.zero_stage == 3:
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds_config = HfDeepSpeedConfig(ds_config)  # from_pretrained then builds partitioned weights
        model = apply_lora(self.build_model(), self.model_spec)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        self.deepspeed, self.scheduler = build_deepspeed(model, self.model_spec, self.optim_spec, self.ds_spec,
                                                   self.micro_batch_size, self.world_size, total_steps)
        return {"rank": self.rank, "trainable_parameters": trainable, "parameters": total}

    def _seed_everything(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    # ---- collectives helpers -----------------------------------------------------------------------------
    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return all_reduce(values, "SUM", self.deepspeed.device)

    def all_reduce_max(self, values: list[float]) -> list[float]:
        return all_reduce(values, "MAX", self.deepspeed.device)

    def peak_memory(self) -> dict:
        """This rank's peak memory above what its process held before the model (memory/probe.py)."""
        return self.memory.peak()

    def optimizer_step(self) -> None:
        """`engine.step()` after a micro-batch's backward. At an accumulation boundary DeepSpeed skips the update
        when a gradient is inf / nan (fp16 overflow, or any non-finite gradient under ZeRO 1-3 and bf16): the
        weights, the optimizer state and the LR schedule stay as they were. A plain fp32 ZeRO-0 engine has no such
        check (its optimizer is the torch one, and DeepSpeed keeps no gradient norm for it), so here the norm is
        taken first (the gradients are averaged over ranks then: every rank sees the global norm) and a
        non-finite one flags the optimizer to skip in the same way (`skip_flagged_steps`). Skips are counted
        (`steps_skipped`) and logged."""
        e = self.deepspeed
        boundary = e.is_gradient_accumulation_boundary()
        if boundary and e.zero_optimization_stage() == 0 and not (e.fp16_enabled() or e.bfloat16_enabled()):
            norms = [p.grad.detach().float().norm() for p in e.module.parameters() if p.grad is not None]
            self._grad_norm = torch.stack(norms).norm().item() if norms else 0.0
            e.optimizer.overflow = not math.isfinite(self._grad_norm)
        e.step()
        if boundary:
            applied = bool(e.was_step_applied())
            self.step_counts["applied" if applied else "skipped"] += 1
            if not applied and self.rank == 0:
                log.warning("%s: optimizer step %d skipped: a gradient is inf or nan (the weights did not change)",
                            type(self).__name__, e.global_steps + e.skipped_steps)

    def step_info(self) -> dict:
        grad_norm = self.deepspeed.get_global_grad_norm()
        if grad_norm is None:
            grad_norm = self._grad_norm
        return {"lr": self.scheduler.get_last_lr()[0], "applied": bool(self.deepspeed.was_step_applied()),
                "steps_skipped": float(self.step_counts["skipped"]),
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "peak_memory_gib": peak_memory_gib()}

    # ---- checkpoints -------------------------------------------------------------------------------------
    def save_checkpoint(self, directory: str, client_state: dict) -> None:
        """Write into `directory` (a temporary folder the driver renames once every rank returned)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.deepspeed.save_checkpoint(str(path), tag="state", client_state=client_state,
                                    exclude_frozen_parameters=self.model_spec.lora.enabled)
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        torch.save(rng, path / f"rng_rank{self.rank}.pt")

    def load_checkpoint(self, directory: str, tag: str = "state") -> dict:
        """Load what save_checkpoint wrote. `tag` names the universal copy (learners/resharding.py) when another
        number of ranks wrote it; each rank then restores the RNG state of the rank of its number, if there was one."""
        path = Path(directory)
        universal = tag != "state"
        self.deepspeed._config.load_universal_checkpoint = universal  # read by the engine and its ZeRO optimizer
        try:
            _, client_state = self.deepspeed.load_checkpoint(str(path), tag=tag, load_optimizer_states=True,
                                                          load_lr_scheduler_states=True,
                                                          load_module_strict=not self.model_spec.lora.enabled)
        finally:
            self.deepspeed._config.load_universal_checkpoint = False
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=False)
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
        return client_state or {}

    # ---- export ------------------------------------------------------------------------------------------
    def gathered_groups(self, bucket_bytes: int, copy: bool = True,
                        only: Callable[[str], bool] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights on rank 0 in groups of about `bucket_bytes` that never split a decoder layer, in the module's
        order (empty lists on the other ranks, which must iterate along: under ZeRO-3 each group is gathered by
        every rank together). Only one group is ever materialised at a time, so no rank holds more than a bucket
        beyond its own shard. With
        copy=False rank 0 gets the live parameters, valid only until it asks for the next group. `only` keeps the
        parameters whose names it accepts (and then no buffers)."""
        import deepspeed

        zero3 = self.deepspeed.zero_optimization_stage() == 3
        params, groups = self._weight_groups(bucket_bytes, only)
        for names in groups:
            group = [params[n] for n in names]
            gather = deepspeed.zero.GatheredParameters(group, modifier_rank=None) if zero3 else nullcontext()
            with gather:
                if self.rank != 0:
                    yield []
                elif copy:
                    yield [(n, p.detach().cpu().clone()) for n, p in zip(names, group)]
                else:
                    yield [(n, p.detach()) for n, p in zip(names, group)]
        if only is None and (buffers := self._persistent_buffers()):
            yield [(n, b.detach().cpu().clone()) for n, b in buffers] if self.rank == 0 else []

    def gathered_group_count(self, bucket_bytes: int, only: Callable[[str], bool] | None = None) -> int:
        """How many groups `gathered_groups` yields with these arguments (nothing is gathered to count them)."""
        return len(self._weight_groups(bucket_bytes, only)[1]) + int(only is None and bool(self._persistent_buffers()))

    def _weight_groups(self, bucket_bytes: int, only: Callable[[str], bool] | None
                       ) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
        """The parameters `only` keeps (by name), and their names in each group of about `bucket_bytes` (a layer's
        tensors stay in one group; LoRA: they fold), in the module's order."""
        zero3 = self.deepspeed.zero_optimization_stage() == 3
        params = {n: p for n, p in self.deepspeed.module.named_parameters() if only is None or only(n)}

        def nbytes(p: torch.Tensor) -> int:
            numel = p.ds_numel if zero3 and hasattr(p, "ds_numel") else p.numel()
            return numel * p.element_size()

        parts = whole_layers(lora_units(list(params)))
        sizes = ((i, sum(nbytes(params[n]) for n in unit)) for i, unit in enumerate(parts))
        return params, [[n for i in units for n in parts[i]] for units in group_by_size(sizes, bucket_bytes)]

    def _persistent_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """Buffers the module saves (rotary caches and the like are rebuilt, not saved)."""
        module = self.deepspeed.module
        persistent = set(module.state_dict().keys())
        return [(n, b) for n, b in module.named_buffers() if n in persistent]

    def engine_weight_groups(self, bucket_bytes: int, adapters_only: bool = False
                             ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """What the generation engines load: `gathered_groups(copy=False)`, with a LoRA model's adapters folded into
        the weights they adapt under the base model's names (models/lora_weights.py); with `adapters_only`, the
        LoRA adapters alone under peft's file names (for an engine that applies them itself)."""
        if adapters_only:
            for group in self.gathered_groups(bucket_bytes, copy=False, only=is_adapter):
                yield [(adapter_file_name(n), t) for n, t in group]
            return
        for group in self.gathered_groups(bucket_bytes, copy=False):
            yield lora_folded(self.deepspeed.module, group) if group and self.model_spec.lora.enabled else group

    def engine_weight_group_count(self, bucket_bytes: int, adapters_only: bool = False) -> int:
        """How many groups `engine_weight_groups` yields."""
        return self.gathered_group_count(bucket_bytes, is_adapter if adapters_only else None)

    def gathered_state_dict(self, bucket_bytes: int = 2**28) -> dict[str, torch.Tensor] | None:
        """Full weights on rank 0 (None elsewhere); a collective under ZeRO-3."""
        state = {name: t for group in self.gathered_groups(bucket_bytes) for name, t in group}
        return state if self.rank == 0 else None

    def export_hf(self, directory: str) -> str | None:
        """Save a Hugging Face checkpoint that plain `from_pretrained` loads (LoRA merged, or the adapter alone
        if lora.merge_on_export is false). Written aside and renamed: a crash never leaves half a model."""
        state = self.gathered_state_dict()
        if self.rank != 0:
            return None
        from rlhf_ray.learners.export import save_hf_model

        return save_hf_model(self.deepspeed.module, state, self.model_spec, Path(directory))

    def ping(self) -> int:
        return self.rank


class SupervisedRank(LearnerRank):
    """A rank of an SFT or RM job: the tokenised phase data, and which rows it trains on at each step."""

    def __init__(self, *, pad_token_id: int, global_batch_size: int, eval_batch_size: int, **kwargs):
        super().__init__(**kwargs)
        self.pad_token_id = pad_token_id
        self.global_batch_size = global_batch_size
        self.eval_batch_size = eval_batch_size
        self.train_rows: list[dict] = []
        self.eval_rows: list[dict] = []

    def set_data(self, train_rows: list[dict], eval_rows: list[dict]) -> int:
        self.train_rows, self.eval_rows = train_rows, eval_rows
        return len(train_rows)

    def step_indices(self, step: int) -> list[list[int]]:
        """Indices into the training rows of this rank's micro-batches at optimizer step `step`."""
        from rlhf_ray.learners.schedule import micro_batches

        return micro_batches(len(self.train_rows), self.global_batch_size, self.micro_batch_size, self.world_size,
                             self.rank, step, self.seed)

    def step_micro_batches(self, step: int) -> list[list[dict]]:
        return [[self.train_rows[i] for i in idx] for idx in self.step_indices(step)]

    def eval_batches(self) -> list[tuple[list[int], bool]]:
        """This rank's share of the eval split as (indices, counted) batches, eval_batch_size at most: every rank gets
        as many batches (ZeRO-3 gathers parameters in each forward), the ones past its share are a discarded copy of
        the first row (counted False)."""
        from rlhf_ray.learners.schedule import eval_batches_in_step

        plan = eval_batches_in_step(len(self.eval_rows), self.rank, self.world_size, self.eval_batch_size)
        return [(indices, True) if indices is not None else ([0], False) for indices in plan]
