"""docs/extending.md's worked examples, run: an advantage estimator of one's own (an Estimator in a module of one's
own, named by `ppo.advantage_estimator: module:name`), validated like the built-in ones and run by a real
GRPO-style job; and a generation engine of one's own (`generation.engine: module:Class`) serving a real generation
worker."""

from __future__ import annotations

import json
import time

import pytest
import torch

from rlhf_ray.actors.hf_engine import HFEngine
from rlhf_ray.algorithms.advantages import AdvantageInputs, broadcast_to_tokens
from rlhf_ray.config.estimators import Estimator


def sign_in_group(x: AdvantageInputs):
    """+1 for an answer that scored above its group's mean, -1 below, 0 at it: only the direction, not the size."""
    grouped = x.sequence_rewards.float().view(-1, x.group_size)
    signs = torch.sign(grouped - grouped.mean(-1, keepdim=True)).view(-1)
    return broadcast_to_tokens(signs, x.action_mask), None


SIGNS = Estimator(sign_in_group, groups=True, summary="the sign of each answer's score against its group's mean")
NAME = "tests.test_extending:SIGNS"


def test_a_toy_estimator_named_by_its_module_computes_the_advantages():
    from rlhf_ray.algorithms.experience import make_experience
    from rlhf_ray.config.ppo import PPOSpec

    spec = PPOSpec(advantage_estimator=NAME, kl_coef=0.0)
    assert spec.estimator.summary == SIGNS.summary
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    scores = torch.tensor([2.0, 0.0, 1.0, 1.0])  # two groups of two: one with a winner, one tied
    targets = make_experience(scores, None, None, None, mask, torch.ones(4, dtype=torch.bool), spec, 2)
    assert targets.advantages.tolist() == [[1, 1, 0], [-1, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert targets.returns is None and targets.values is None


def test_an_estimator_is_checked_like_the_built_in_ones(write_yaml):
    from rlhf_ray.config.ppo import PPOSpec

    with pytest.raises(ValueError, match="unknown advantage estimator 'gea': use one of gae, grpo, rloo"):
        PPOSpec(advantage_estimator="gea")
    with pytest.raises(ValueError, match="tests.test_extending:sign_in_group is a function, not an"):
        PPOSpec(advantage_estimator="tests.test_extending:sign_in_group")
    with pytest.raises(ValueError, match="cannot import the advantage estimator 'tests.nowhere:X'"):
        PPOSpec(advantage_estimator="tests.nowhere:X")
    with pytest.raises(ValueError, match=f"advantage_estimator {NAME} does not use lam"):
        PPOSpec(advantage_estimator=NAME, lam=0.9)
    from tests.test_config import PPO, problems_of

    with_critic = write_yaml(PPO)
    (problem,) = problems_of(with_critic, [f"ppo.advantage_estimator={NAME}"])
    assert f"critic: advantage_estimator {NAME} uses no critic" in problem
    path = write_yaml(PPO.replace("critic:\n  micro_batch_size: 4\n", ""))
    (problem,) = problems_of(path, [f"ppo.advantage_estimator={NAME}"])
    assert f"{NAME} compares answers to the same prompt and needs at least 2" in problem
    (problem,) = problems_of(path, ["ppo.advantage_estimator=tests.test_extending:sign_in_group"])
    assert "ppo.advantage_estimator" in problem and "is a function, not an" in problem


@pytest.mark.system
@pytest.mark.usefixtures("shared_ray")
def test_a_job_trains_with_the_toy_estimator(tmp_path, sft_model, rm_model):
    """Its function runs in the job's experience actor: every iteration's advantages are signs."""
    from rlhf_ray.jobs.ppo import run_ppo
    from tests.test_ppo_job import RULE_GRPO, ppo_job

    job = ppo_job(tmp_path, sft_model, rm_model, *[o for o in RULE_GRPO if "advantage_estimator" not in o],
                  f"ppo.advantage_estimator={NAME}", "ppo.iterations=2", "ppo.eval_prompts=0", "reference=null",
                  "ppo.kl_coef=0")
    assert job.critic is None
    assert run_ppo(job)["iterations"] == 2
    lines = [json.loads(x) for x in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    seen = [(r["advantage/min"], r["advantage/max"]) for r in lines if "advantage/max" in r]
    assert len(seen) == 2 and all(lo in (-1, 0) and hi in (0, 1) for lo, hi in seen), seen
    assert any(hi == 1 for _, hi in seen), "no group had answers that scored differently: nothing was tested"


class TimedHF(HFEngine):
    """The hf engine, timing its calls: an engine of one's own, named `tests.test_extending:TimedHF`."""

    name = "timed-hf"

    def generate(self, prompts, sampling, seed, greedy=False, stop=None, budgets=None):
        start = time.perf_counter()
        samples = super().generate(prompts, sampling, seed, greedy, stop, budgets)
        self.seconds = getattr(self, "seconds", 0.0) + time.perf_counter() - start
        return samples


@pytest.mark.system
@pytest.mark.usefixtures("shared_ray")
def test_an_engine_named_by_its_module_serves_a_generation_worker(sft_model, tmp_path):
    from transformers import AutoTokenizer

    from rlhf_ray.actors.generator import GenerationWorker
    from rlhf_ray.actors.group import ActorGroup, Slots, Timeouts
    from rlhf_ray.config.generation import GenerationSpec
    from rlhf_ray.config.model import ModelSpec
    from rlhf_ray.data.tokens import TokenConventions

    engine = "tests.test_extending:TimedHF"
    spec = GenerationSpec.model_validate({"engine": engine, "sampling": {"max_new_tokens": 8, "n_samples_per_prompt": 2}})
    with pytest.raises(ValueError, match="no module 'tests.nowhere' can be imported here"):
        GenerationSpec(engine="tests.nowhere:X")
    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    group = ActorGroup(GenerationWorker, "generation", 1, Slots(1),
                       kwargs=dict(model=ModelSpec(path=str(sft_model), dtype="fp32").model_dump(),
                                   generation=spec.model_dump(), engine=engine,
                                   tokens=TokenConventions.from_tokenizer(tokenizer, sft_model)),
                       timeouts=Timeouts(call_s=300)).wait_ready(300)
    try:
        assert group.call("engine_name") == ["timed-hf"]
        prompts = [tokenizer(" Human: Sort 3 1 2 Assistant:")["input_ids"]]
        samples = group.call("generate", prompts, 1)[0]
        assert len(samples) == 2 and all(1 <= len(s["answer_ids"]) <= 8 for s in samples)
        assert all(len(s["logprobs"]) == len(s["answer_ids"]) for s in samples)
    finally:
        group.kill()
