"""Mini-batches of whole answer groups against mini-batches of rows drawn one by one, side by side.

The PPO stage of configs/recipes/smollm2-sft-grpo.yaml (SmolLM2-135M fp32, 8 prompts x 8 answers an iteration) with
ppo.train_batch_size 16, so each rollout trains in 4 optimizer steps: run once as shipped (the replay buffer plans
mini-batches of whole groups: 2 prompts x 8 answers, each prompt's forward shared by its answers) and once with the
rows of a mini-batch drawn one by one, as before (up to 16 prompts in a mini-batch of 16, each run for one answer);
the second run forces it by giving the driver's rollout feed a group size of 1; a third trains the same 64
answers in one step (train_batch_size 64), for what the extra steps cost. The same seed: the first rollout
is the same in both; later ones differ with the weights. Medians over the iterations after the first.

Run: python benchmarks/bench_minibatch_groups.py [--sft SFT_MODEL] [--iterations 4] [--write benchmarks/HISTORY.md]
(without --sft the recipe's SFT stage runs first, ~5 minutes on 2 cores).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, publish, run_job, steady, today, versions  # noqa: E402
from sft_grpo_stage import ppo_stage, timing_args  # noqa: E402

SECTION = "## Mini-batches of whole answer groups"
TRAIN_BATCH = 16
MODES = {"whole groups": ("whole", TRAIN_BATCH), "rows one by one": ("rows", TRAIN_BATCH),
         "one step (train_batch_size 64)": ("whole", 64)}
"""Label: (mini-batch plan, ppo.train_batch_size). The last: the same 64 answers in one optimizer step."""


ROWS_ONE_BY_ONE = ("import sys\n"
                   "from rlhf_ray.jobs.ppo import rollouts\n"
                   "import dataclasses\n"
                   "of = rollouts.FeedSettings.of\n"
                   "rollouts.FeedSettings.of = classmethod(lambda cls, job: dataclasses.replace(of(job), group_size=1))\n"
                   "from rlhf_ray.cli import main\n"
                   "sys.exit(main(sys.argv[1:]))\n")
"""The CLI with the driver's rollout feed planning mini-batches row by row (the plan before whole groups)."""


def run_mode(mode: str, config: Path, out: Path, overrides: list[str]) -> list[dict]:
    """The PPO job in a fresh process; `rows`: mini-batches planned row by row."""
    entry = ("-c", ROWS_ONE_BY_ONE) if mode == "rows" else ("-m", "rlhf_ray.cli")
    _, metrics = run_job("ppo", config, [f"output_dir={out}", *overrides], entry=entry)
    return metrics


def main() -> int:
    args = timing_args(__doc__)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        config, overrides = ppo_stage(Path(tmp), args.sft, args.iterations)
        for label, (mode, batch) in MODES.items():
            began = time.perf_counter()
            metrics = run_mode(mode, config, Path(tmp) / f"{mode}-{batch}",
                               [*overrides, f"ppo.train_batch_size={batch}"])
            print(f"{label}: {time.perf_counter() - began:.0f} s", flush=True)
            runs[label] = [m for m in metrics if "time/iteration" in m]
    return publish(render(runs, args.iterations), args.write, SECTION)


def render(runs: dict[str, list[dict]], iterations: int) -> str:
    whole = runs["whole groups"]
    first_same = round(whole[0]["reward/mean"], 6) == round(runs["rows one by one"][0]["reward/mean"], 6)
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'deepspeed', 'vllm')}. Date: {today()}.", "",
             f"Command: `python benchmarks/bench_minibatch_groups.py --iterations {iterations} --write "
             "benchmarks/HISTORY.md`. The PPO stage of configs/recipes/smollm2-sft-grpo.yaml from its SFT model "
             f"(SmolLM2-135M fp32, 2 cores, 8 prompts x 8 answers an iteration) with ppo.train_batch_size "
             f"{TRAIN_BATCH}: 4 optimizer steps per rollout, micro-batches of 16. Run once with the mini-batches the "
             "replay buffer plans now (whole groups: 2 prompts x 8 answers, each prompt's forward shared by its "
             "answers) and once with rows drawn one by one (the plan before; forced in the driver), one after the "
             "other; then, for what the extra optimizer steps cost, the same 64 answers in one step "
             "(train_batch_size 64: no old-log-prob forward either, the update is on-policy); medians of iterations "
             f"2-{iterations}.", "",
             "| mini-batches | iteration s | training s | old log-probs s | generation s | training ratio | "
             "iteration ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, metrics in runs.items():
        old_logprobs = steady(metrics, 'compute/policy_seconds')
        lines.append(f"| {label} | {steady(metrics, 'time/iteration'):.1f} | "
                     f"{steady(metrics, 'compute/train_seconds'):.1f} | "
                     f"{'-' if math.isnan(old_logprobs) else f'{old_logprobs:.1f}'} | "
                     f"{steady(metrics, 'time/engine_generate'):.1f} | "
                     f"{steady(metrics, 'compute/train_seconds') / steady(whole, 'compute/train_seconds'):.2f} | "
                     f"{steady(metrics, 'time/iteration') / steady(whole, 'time/iteration'):.2f} |")
    lines += ["", "Ratios: the run's median over the whole-groups run's. The first iteration's rollout "
              f"{'was' if first_same else 'was not'} the same in both runs (its mean reward equal); the updates "
              "then differ, and with them the weights and later rollouts."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
