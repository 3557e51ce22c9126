"""The pretrain job end to end on a real local Ray: `rlhf-ray preprocess` writes two corpora from shipped text, two
ZeRO-3 CPU ranks train the tiny model on their weighted mix, held-out perplexity falls on both, and a run stopped
half-way resumes, on 2 ranks or on 1, with the samples and losses of an uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_ray.cli import EXIT_OK, main
from rlhf_ray.config import load_job
from rlhf_ray.jobs.pretrain_job import run_pretrain
from tests.conftest import ROOT

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("shared_ray")]  # one embedded Ray for the module


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, tiny_model) -> list[Path]:
    """The shipped arithmetic text, and worked word problems of demo/word-problems, through `rlhf-ray preprocess`."""
    from rlhf_ray.config import DatasetSpec
    from rlhf_ray.data.registry import load_raw

    root = tmp_path_factory.mktemp("corpora")
    problems = root / "word_problems.txt"
    samples = load_raw(DatasetSpec(name="demo/word-problems")).train[:400]
    problems.write_text("\n\n".join(s.prompt + s.chosen for s in samples))
    out = []
    for name, text in (("arithmetic", ROOT / "rlhf_ray/assets/tokenizer_corpus.txt"), ("problems", problems)):
        prefix = root / name
        assert main(["preprocess", "--input", str(text), "--tokenizer", str(tiny_model), "--out", str(prefix),
                     "--max-len", "48", "--workers", "1", "--quiet"]) == EXIT_OK
        out.append(prefix)
    return out


def pretrain_job(tmp_path: Path, tiny_model: Path, corpora: list[Path], *overrides: str):
    return load_job(ROOT / "configs/quickstart/pretrain.yaml",
                    [f"model.path={tiny_model}", f"output_dir={tmp_path}", "cluster.dashboard=false",
                     "logging.progress=false", f"data.corpora=[{{path: {corpora[0]}, weight: 3}}, "
                                                f"{{path: {corpora[1]}, weight: 1}}]",
                     "deepspeed.zero_stage=3", "train.max_steps=12", "train.eval_every_steps=6",
                     "checkpoint.every_steps=0", *overrides])


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, corpora) -> dict:
    """An uninterrupted 12-step run on 2 ranks, and one stopped after step 5 (its checkpoint is copied by the tests
    that resume it)."""
    root = tmp_path_factory.mktemp("pretrain")
    straight = run_pretrain(pretrain_job(root / "straight", tiny_model, corpora))
    stopped = run_pretrain(pretrain_job(root / "stopped", tiny_model, corpora), stop_after=5)
    assert stopped["stopped_at_step"] == 5
    return {"root": root, "straight": straight}


def test_pretrain_lowers_heldout_perplexity_on_every_corpus(runs):
    straight, out = runs["straight"], runs["root"] / "straight"
    assert straight["corpora"]["arithmetic"]["heldout_samples"] % 2 == 1  # odd: ranks evaluate unequal shares
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for name in ("arithmetic", "problems"):
        first = logged[0][f"eval_perplexity/{name}"]
        assert straight[f"eval_perplexity/{name}"] < 0.3 * first, (name, first, straight)
    assert straight["eval_perplexity"] < 0.3 * straight["eval_perplexity_first"]
    speeds = [r["train/tokens_per_s"] for r in logged if "train/tokens_per_s" in r]
    assert len(speeds) == 12 and all(s > 0 for s in speeds)


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_stopped_run_resumes_with_the_next_samples_on_the_same_or_another_rank_count(runs, tiny_model, corpora,
                                                                                       tmp_path, ranks):
    """Saved by 2 ZeRO-3 ranks, resumed on 2 (DeepSpeed's own checkpoint) or on 1 (converted to the universal
    format): every later step's loss is the uninterrupted run's (the same samples, weights, Adam moments and LR);
    on 1 rank the global batch is summed in another order, hence the tolerance."""
    out = tmp_path / "resumed"
    shutil.copytree(runs["root"] / "stopped", out)
    resumed = run_pretrain(pretrain_job(out, tiny_model, corpora, f"placement.replicas={ranks}",
                                        f"deepspeed.gradient_accumulation_steps={2 // ranks}"))
    a, b = losses(runs["root"] / "straight"), losses(out)
    assert list(b) == list(range(1, 13))
    tolerance = 1e-6 if ranks == 2 else 1e-5
    for step in range(6, 13):
        assert b[step] == pytest.approx(a[step], rel=tolerance), step
    assert resumed["eval_perplexity"] == pytest.approx(runs["straight"]["eval_perplexity"], rel=tolerance)
    assert (out / "checkpoints/step-00000005/state_universal").is_dir() == (ranks != 2)
    wa = load_file(str(runs["root"] / "straight/model/model.safetensors"))
    wb = load_file(str(out / "model/model.safetensors"))
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=1e-6 if ranks == 2 else 1e-5, msg=key)
