"""The PPO stage of configs/recipes/smollm2-sft-grpo.yaml as a job of its own, for the timing benchmarks that run
it side by side (bench_learner_precision.py; before 2026-12-05 also three retired one-off experiments)."""

from __future__ import annotations

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

