"""The PPO stage of configs/recipes/smollm2-sft-grpo.yaml as a job of its own, for the timing benchmarks that run
it side by side (bench_minibatch_groups.py, bench_phase_threads.py, bench_old_logprobs.py)."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import yaml

from common import ROOT, run_job

RECIPE = ROOT / "configs/recipes/smollm2-sft-grpo.yaml"


def stage_config(folder: Path, name: str) -> Path:
    """One stage of the recipe as a job config of its own."""
    recipe = yaml.safe_load(RECIPE.read_text())
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"kind": name, "seed": recipe["seed"], "cluster": recipe["cluster"],
                                    **recipe[name]}, sort_keys=False))
    return path


def timing_args(doc: str) -> argparse.Namespace:
    """--sft SFT_MODEL, --iterations N, --write FILE: the arguments of a timing run of the recipe's PPO stage."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--sft", type=Path, help="the recipe's SFT model (default: train it first)")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--write", type=Path, help="markdown file whose section is replaced")
    return parser.parse_args()


def ppo_stage(folder: Path, sft: Path | None, iterations: int) -> tuple[Path, list[str]]:
    """The recipe's PPO stage as a job config in `folder`, and the overrides of a timing run from its SFT model
    (trained into `folder` first when `sft` is None): `iterations` iterations, no evaluation, no checkpoints, and
    the fixed batch these timings compare (8 prompts x 8 answers, all trained: the recipe has sampled 16 prompts
    and trained only the groups that teach since 2026-12-01, a number of rows that varies by iteration), with the
    policy's own old log-probs (the recipe has taken the engine's since 2026-12-01)."""
    if sft is None:
        run_job("sft", stage_config(folder, "sft"), [f"output_dir={folder / 'sft'}"])
        sft = folder / "sft" / "model"
    return stage_config(folder, "ppo"), [f"policy.model.path={sft}", f"ppo.iterations={iterations}",
                                         "ppo.eval_prompts=0", "ppo.eval_every=0", "checkpoint.every_steps=0",
                                         "ppo.dynamic_sampling.enabled=false", "ppo.train_batch_size=64",
                                         "ppo.old_logprobs=policy"]


def timed_variants(sft: Path | None, iterations: int, variants: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Each variant (label: overrides after the timing run's) of the recipe's PPO stage, one after the other, each
    in a fresh process: label -> its iterations' metric lines."""
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        config, overrides = ppo_stage(Path(tmp), sft, iterations)
        for i, (label, extra) in enumerate(variants.items()):
            began = time.perf_counter()
            _, metrics = run_job("ppo", config, [f"output_dir={Path(tmp) / f'run{i}'}", *overrides, *extra])
            print(f"{label}: {time.perf_counter() - began:.0f} s", flush=True)
            runs[label] = [m for m in metrics if "time/iteration" in m]
    return runs
