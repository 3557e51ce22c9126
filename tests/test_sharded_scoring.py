"""Sharded reference and reward models (ZeRO-3 inference, `sharded: true`): two replicas each hold about half the
weights, and their log-probs / scores equal a single process's, also when the replicas get unequal rows (one of
them keeps step with a dropped forward) and when rows share a prompt."""

from __future__ import annotations

import dataclasses

import json

import pytest
import ray
import torch

from rlhf_ray.actors.scoring import ReferenceWorker, RewardWorker
from rlhf_ray.algorithms.experience import pack_rollouts, row_bounds
from tests.test_ppo_job import ppo_job

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("shared_ray")]  # one embedded Ray for the module


def _sharded_group(cls, **kwargs):
    from rlhf_ray.actors.group import ActorGroup, Slots, Timeouts
    from rlhf_ray.config.placement import PlacementSpec
    from rlhf_ray.distributed import actor_env
    from rlhf_ray.learners.learner_group import rendezvous

    group = ActorGroup(cls, cls.__name__.lower(), 2, Slots(0.5, env_vars=actor_env(PlacementSpec(num_cpus=0.5))),
                       kwargs={**kwargs, "sharded": True}, timeouts=Timeouts(call_s=300))
    return group, group.call("setup", *rendezvous(group, 120), 300.0, timeout=300)


def _whole(cls, **kwargs) -> int:
    return sum(p.numel() * p.element_size() for p in cls(rank=0, world_size=1, **kwargs).model.parameters())


def _split_call(group, method, batch, rows):
    refs = [getattr(actor, method).remote(batch, lo, hi) for actor, (lo, hi) in zip(group.actors, row_bounds(rows, 2))]
    return torch.cat([ray.get(out.ref) for out in group.gather(refs, method)])


def test_two_replicas_hold_half_the_weights_each_and_score_like_one_process(sft_model, rm_model):
    from transformers import AutoTokenizer

    from rlhf_ray import cluster
    from rlhf_ray.config.placement import ClusterSpec
    from rlhf_ray.data.tokens import TokenConventions

    sft, rm = sft_model, rm_model
    # 3 rows over 2 replicas, micro-batches of 1: replica 0 runs 2 forwards, replica 1 one and one to keep step;
    # rows 0 and 1 share a prompt (a single process would run that prompt's forward once)
    batch = dataclasses.replace(pack_rollouts([[5, 6, 7, 8], [5, 6, 7, 8], [9, 10]], [[11, 12], [13], [14, 15, 16]],
                                              pad_id=0), ended=torch.tensor([True, False, True]))
    ref_kwargs = dict(model={"path": str(sft), "dtype": "fp32"}, micro_batch_size=1, temperature=0.7)
    tokenizer = AutoTokenizer.from_pretrained(rm)
    rm_kwargs = dict(model={"path": str(rm), "dtype": "fp32"}, micro_batch_size=1,
                     tokens=TokenConventions.from_tokenizer(tokenizer, str(rm)))
    single_ref = ReferenceWorker(rank=0, world_size=1, **ref_kwargs)
    with cluster.connect(ClusterSpec(num_cpus=2, dashboard=False)):
        want_logp = ReferenceWorker.logprobs.computes(single_ref, batch, 0, 3)
        single_rm = RewardWorker(rank=0, world_size=1, **rm_kwargs)
        want_scores = RewardWorker.score.computes(single_rm, batch, 0, 3)
        for cls, kwargs, method, want in ((ReferenceWorker, ref_kwargs, "logprobs", want_logp),
                                          (RewardWorker, rm_kwargs, "score", want_scores)):
            group, info = _sharded_group(cls, **kwargs)
            try:
                whole = _whole(cls, **kwargs)
                for rank in info:  # about half each (norm scales and biases stay whole: below the ZeRO-3 threshold)
                    assert 0.45 * whole < rank["held_bytes"] < 0.6 * whole, (rank, whole)
                got = _split_call(group, method, ray.put(batch), 3)
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
                # with a 6-token budget replica 0 runs its rows (6 and 5 tokens) apart and replica 1 its one row:
                # the replicas agree on two forwards (an all-reduce), and the numbers stay
                ray.get([a.__ray_call__.remote(lambda actor: setattr(actor, "max_tokens", 6)) for a in group.actors])
                got = _split_call(group, method, ray.put(batch), 3)
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            finally:
                group.kill()


def test_ppo_runs_with_a_sharded_reference_and_reward_model(tmp_path, sft_model, rm_model):
    """As a user runs it: `sharded: true` with two replicas for the reference and the reward model. The reference
    starts as the policy, so the first iteration's KL between them is ~0: the sharded log-probs are the policy's."""
    sft, rm = sft_model, rm_model
    job = ppo_job(tmp_path, sft, rm, "ppo.iterations=2", "ppo.eval_prompts=8",
                  "reference.sharded=true", "reference.placement.replicas=2", "reference.placement.colocate_with=null",
                  "reference.placement.num_cpus=0.125", "reward.sharded=true", "reward.placement.replicas=2",
                  "reward.placement.colocate_with=null", "reward.placement.num_cpus=0.125")
    from rlhf_ray.jobs.ppo import run_ppo

    summary = run_ppo(job)
    assert summary["iterations"] == 2
    rows = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "kl/mean" in r]
    assert len(steps) == 2 and abs(steps[0]["kl/mean"]) < 1e-5, steps[0]
    assert all(r["actors/restarts"] == 0 for r in steps)
