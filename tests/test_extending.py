"""docs/extending.md's worked examples, run: an advantage estimator of one's own (an Estimator in a module of one's
own, named by `ppo.advantage_estimator: module:name`), validated like the built-in ones and run by a real
GRPO-style job, which is scored by a reward function of one's own (`reward.function: module:function`); a
generation engine of one's own (`generation.engine: module:Class`) serving a real generation worker; and a job
kind of one's own, added to JOB_KINDS, run as the CLI command the table makes of it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import pytest
import torch
from pydantic import Field

from rlhf_ray.actors.hf_engine import HFEngine
from rlhf_ray.algorithms.advantages import AdvantageInputs, broadcast_to_tokens
from rlhf_ray.config.estimators import Estimator
from rlhf_ray.config.jobs import JobBase
from rlhf_ray.config.paths import PathField


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


def short_and_right(prompts, answers, answer):      # `answer`: the dataset's column
    return [float(a.strip().endswith(str(t))) - 0.01 * len(a.split()) for a, t in zip(answers, answer)]


@pytest.mark.system
@pytest.mark.usefixtures("shared_ray")
def test_a_job_trains_with_the_toy_estimator_on_the_toy_reward(tmp_path, sft_model, rm_model):
    """The estimator's function runs in the job's experience actor: every iteration's advantages are signs. The
    reward function of docs/extending.md scores every answer, given the dataset's `answer` column."""
    from transformers import AutoTokenizer

    from rlhf_ray.jobs.ppo import run_ppo
    from tests.test_ppo_job import RULE_GRPO, ppo_job

    rule = [o for o in RULE_GRPO if "advantage_estimator" not in o and "reward.function" not in o]
    job = ppo_job(tmp_path, sft_model, rm_model, *rule, "reward.function=tests.test_extending:short_and_right",
                  f"ppo.advantage_estimator={NAME}", "ppo.iterations=2", "ppo.eval_prompts=0", "reference=null",
                  "ppo.kl_coef=0", "logging.samples_per_iteration=8")
    assert job.critic is None
    assert run_ppo(job)["iterations"] == 2
    lines = [json.loads(x) for x in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    seen = [(r["advantage/min"], r["advantage/max"]) for r in lines if "advantage/max" in r]
    assert len(seen) == 2 and all(lo in (-1, 0) and hi in (0, 1) for lo, hi in seen), seen
    assert any(hi == 1 for _, hi in seen), "no group had answers that scored differently: nothing was tested"
    eos = AutoTokenizer.from_pretrained(sft_model).eos_token
    samples = [json.loads(x) for x in (tmp_path / "ppo" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16
    for s in samples:  # the logged answer keeps its end-of-text; the function was given the text without it
        want = short_and_right([s["prompt"]], [s["answer"].replace(eos, "")], [s["columns"]["answer"]])[0]
        assert s["reward"] == pytest.approx(want), s
    assert any(s["reward"] > 0.5 for s in samples) and all(s["reward"] not in (0.0, 1.0) for s in samples)


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


class WordsJob(JobBase):
    """A job kind of one's own: the words of a text file, counted on the cluster by a Ray task per chunk of lines."""

    summary: ClassVar[str] = "count the words of a text file on the cluster"
    runner: ClassVar[str] = "tests.test_extending:count_words"

    kind: Literal["words"] = "words"
    text: Annotated[str, PathField()]
    """The text file (relative paths: to the folder the command runs in)."""
    lines_per_task: int = Field(100, ge=1)

    def placement_roles(self):
        return {}  # Ray tasks only: no actor groups to place


def count_words(job: WordsJob) -> dict:
    import ray

    from rlhf_ray import cluster

    lines = Path(job.text).read_text().splitlines()
    chunks = [lines[i:i + job.lines_per_task] for i in range(0, len(lines), job.lines_per_task)]
    with cluster.connect(job.cluster):
        count = ray.remote(lambda part: sum(len(line.split()) for line in part))
        words = sum(ray.get([count.remote(chunk) for chunk in chunks], timeout=job.cluster.call_timeout_s))
    summary = {"words": words, "tasks": len(chunks)}
    Path(job.output_dir).mkdir(parents=True, exist_ok=True)
    Path(job.output_dir, "summary.json").write_text(json.dumps(summary))
    return summary


@pytest.mark.system
@pytest.mark.usefixtures("shared_ray")
def test_a_job_kind_added_to_the_table_is_validated_and_run_by_its_own_command(tmp_path, monkeypatch, capsys):
    from rlhf_ray import cli
    from rlhf_ray.config.kinds import JOB_KINDS

    monkeypatch.setitem(JOB_KINDS, "words", WordsJob)
    monkeypatch.chdir(tmp_path)
    Path("text.txt").write_text("one two\nthree\n" * 150)
    Path("words.yaml").write_text("kind: words\ntext: text.txt\noutput_dir: out\n"
                                  "cluster: {num_cpus: 2, dashboard: false}\n")  # the shared Ray's shape
    assert cli.main(["validate", "words.yaml"]) == cli.EXIT_OK
    assert cli.main(["words", "--config", "words.yaml"]) == cli.EXIT_OK
    assert json.loads(Path("out/summary.json").read_text()) == {"words": 450, "tasks": 3}
    capsys.readouterr()
    assert cli.main(["words", "--config", "words.yaml", "--set", "lines_per_task=0"]) == cli.EXIT_BAD_CONFIG
    assert "lines_per_task" in capsys.readouterr().err
