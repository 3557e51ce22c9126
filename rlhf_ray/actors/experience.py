"""Experience assembly as Ray tasks: rollouts and scores meet in the object store, not in the driver. The driver
passes references in and gets back a reference to the experience plus a few numbers for its metrics."""

from __future__ import annotations

import time

import ray
import torch

from rlhf_ray.algorithms.experience import make_experience, pack_rollouts
from rlhf_ray.config.ppo import PPOSpec


@ray.remote(num_cpus=0)
def assemble_batch(sample_refs: list, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Engine outputs (one list of samples per engine, in engine order) -> the padded rollout batch."""
    samples = [s for part in ray.get(sample_refs) for s in part]
    batch = pack_rollouts([s["prompt_ids"] for s in samples], [s["answer_ids"] for s in samples], pad_token_id)
    batch["ended"] = torch.tensor([s["finished"] for s in samples])
    batch["version"] = torch.tensor([s["version"] for s in samples])
    return batch


@ray.remote(num_cpus=0, num_returns=2)
def assemble_experience(batch: dict, score_refs: list, old_logp_refs: list, ref_logp_refs: list,
                        value_refs: list | None, ppo: dict, group_size: int) -> tuple[dict, dict]:
    """Per-role results (each a list of per-replica parts, in row order) -> (experience, metrics)."""
    start = time.perf_counter()

    def cat(refs):
        return torch.cat(ray.get(refs)) if refs else None

    scores, old_logp, ref_logp, values = cat(score_refs), cat(old_logp_refs), cat(ref_logp_refs), cat(value_refs)
    experience = make_experience(scores, old_logp, ref_logp, values, batch["action_mask"], batch["ended"],
                                 PPOSpec.model_validate(ppo), group_size)
    metrics = {"reward/mean": scores.float().mean().item(), "reward/std": scores.float().std().item(),
               "kl/mean": experience["kl"].mean().item(),
               "answer/length": batch["action_mask"].sum(-1).mean().item(),
               "answer/ended": batch["ended"].float().mean().item(),
               "compute/advantages_seconds": time.perf_counter() - start}
    return {**batch, **experience}, metrics
