"""The generation pool: K engine replicas behind one call. Prompts are split across engines in contiguous,
balanced chunks; results come back in input order; weight updates go to every engine from one object ref."""

from __future__ import annotations

import time

import ray
import torch

from rlhf_ray.actors.generator import GenerationWorker
from rlhf_ray.actors.group import ActorGroup
from rlhf_ray.data.split import stable_seed
from rlhf_ray.learners.group import actor_env


class GenerationPool:
    def __init__(self, group: ActorGroup):
        self.group = group

    @classmethod
    def start(cls, job, placement_group, bundle_indices: list[int]) -> "GenerationPool":
        placement = job.generation.placement
        group = ActorGroup(GenerationWorker, "generation", placement.replicas, placement_group=placement_group,
                           bundle_indices=bundle_indices, num_cpus=placement.num_cpus, num_gpus=placement.num_gpus,
                           kwargs={"model": job.policy.model.model_dump(), "generation": job.generation.model_dump(),
                                   "seed": job.seed},
                           call_timeout_s=job.cluster.call_timeout_s, start_timeout_s=job.cluster.startup_timeout_s,
                           env_vars=actor_env(placement))
        return cls(group.wait_ready(job.cluster.startup_timeout_s))

    def generate(self, prompts: list[list[int]], seed: int, greedy: bool = False) -> list[dict]:
        k = len(self.group)
        bounds = [round(i * len(prompts) / k) for i in range(k + 1)]
        args = [(prompts[bounds[i]: bounds[i + 1]], stable_seed(seed, "engine", i), greedy) for i in range(k)]
        results = self.group.call_each("generate", args)
        merged = []
        for i, rows in enumerate(results):
            for row in rows:
                merged.append({**row, "prompt_index": row["prompt_index"] + bounds[i]})
        return merged

    def broadcast(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Put the weights in the object store once; every engine loads the same object."""
        start = time.perf_counter()
        ref = ray.put(state)
        versions = self.group.call("load_weights", ref, version)
        assert all(v == version for v in versions), versions
        return {"seconds": time.perf_counter() - start,
                "bytes": float(sum(t.numel() * t.element_size() for t in state.values()))}

    def versions(self) -> list[int]:
        return self.group.call("get_version")
