"""The generation pool: K engine replicas behind one call. Prompts are split across engines in contiguous,
balanced chunks; results come back in input order; weight updates reach every engine from the same buckets."""

from __future__ import annotations

import logging
import time

from rlhf_ray.actors.engine import engine_env, resolve_engine
from rlhf_ray.actors.generator import GenerationWorker
from rlhf_ray.actors.group import ActorGroup
from rlhf_ray.data.split import stable_seed
from rlhf_ray.learners.group import threads

log = logging.getLogger(__name__)


class GenerationPool:
    def __init__(self, group: ActorGroup, engine: str):
        self.group, self.engine = group, engine

    @classmethod
    def start(cls, job, placement_group, bundle_indices: list[int], eos_token_id: int,
              pad_token_id: int) -> "GenerationPool":
        spec = job.generation
        engine, reason = resolve_engine(spec, job.policy.model)
        log.info("generation engine: %s (%s)", engine, reason)
        placement = spec.placement
        group = ActorGroup(GenerationWorker, "generation", placement.replicas, placement_group=placement_group,
                           bundle_indices=bundle_indices, num_cpus=placement.num_cpus, num_gpus=placement.num_gpus,
                           kwargs={"model": job.policy.model.model_dump(), "generation": spec.model_dump(),
                                   "engine": engine, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id},
                           call_timeout_s=job.cluster.call_timeout_s, start_timeout_s=job.cluster.startup_timeout_s,
                           env_vars=engine_env(engine, spec, threads(placement)))
        return cls(group.wait_ready(job.cluster.startup_timeout_s), engine)

    def _shards(self, prompts: list[list[int]], seed: int, greedy: bool) -> tuple[list[int], list[tuple]]:
        k = len(self.group)
        bounds = [round(i * len(prompts) / k) for i in range(k + 1)]
        return bounds, [(prompts[bounds[i]: bounds[i + 1]], stable_seed(seed, "engine", i), greedy) for i in range(k)]

    def generate(self, prompts: list[list[int]], seed: int, greedy: bool = False) -> list[dict]:
        """All samples, in prompt order, brought to the caller (evaluation; training uses `submit`)."""
        bounds, args = self._shards(prompts, seed, greedy)
        merged = []
        for i, rows in enumerate(self.group.call_each("generate", args)):
            merged += [{**row, "prompt_index": row["prompt_index"] + bounds[i]} for row in rows]
        return merged

    def submit(self, prompts: list[list[int]], seed: int) -> list:
        """Start a rollout without waiting (async mode overlaps it with training); `collect` its result."""
        _, args = self._shards(prompts, seed, False)
        return [actor.rollout.remote(*a[:2]) for actor, a in zip(self.group.actors, args)]

    def collect(self, pending: list) -> dict:
        """References to each engine's samples (engine order = prompt order) and what the metrics need."""
        parts = self.group.gather(pending, "rollout")
        versions = {p["version"] for p in parts}
        return {"refs": [p["ref"] for p in parts], "version": min(versions), "samples": sum(p["samples"] for p in parts),
                "tokens": sum(p["tokens"] for p in parts), "engine_seconds": max(p["seconds"] for p in parts)}

    def broadcast(self, bucket_refs: list, version: int) -> dict[str, float]:
        """Every engine loads the same buckets (object refs; the driver never holds the tensors)."""
        start = time.perf_counter()
        results = self.group.call("load_weights", bucket_refs, version)
        stale = [name for name, r in zip(self.group.names, results) if r["version"] != version]
        if stale:
            raise RuntimeError(f"{', '.join(stale)} did not reach policy version {version}")
        return {"seconds": time.perf_counter() - start, "engine_seconds": max(r["seconds"] for r in results)}

    def versions(self) -> list[int]:
        return self.group.call("get_version")
