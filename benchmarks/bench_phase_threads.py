"""Threads per phase for a policy that scores old log-probs beside the reference, side by side.

The PPO stage of configs/recipes/smollm2-sft-grpo.yaml from its SFT model (SmolLM2-135M fp32, 2 cores, 8 prompts x
8 answers an iteration) with ppo.train_batch_size 16: 4 optimizer steps a rollout, so the policy computes old
log-probs in the experience phase, beside the reference. Three runs, one after the other:
- as shipped: the policy trains on both cores and scores on one (jobs/threads.py: threads per phase);
- `policy.placement.threads: 1`: what the job did before, one thread for both phases (the crowd of its busiest);
- `policy.placement.threads: 2`: two threads in both phases, so the policy's scoring shares the cores with the
  reference's (3 threads on 2 cores).
The same seed: the first rollout is the same in all three; later ones differ with the weights. Medians over the
iterations after the first.

Run: python benchmarks/bench_phase_threads.py [--sft SFT_MODEL] [--iterations 4] [--write benchmarks/HISTORY.md]
(without --sft the recipe's SFT stage runs first, ~5 minutes on 2 cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_grpo_stage import timed_variants, timing_args  # noqa: E402
from common import machine, publish, steady, today, versions  # noqa: E402

SECTION = "## Threads per phase in sync PPO"
RUNS = {"per phase (now): trains on 2, scores on 1": [],
        "1 thread in both phases (before)": ["policy.placement.threads=1"],
        "2 threads in both phases": ["policy.placement.threads=2"]}
"""Label: the overrides of the run."""


def main() -> int:
    args = timing_args(__doc__)
    runs = timed_variants(args.sft, args.iterations,
                          {label: ["ppo.train_batch_size=16", *extra] for label, extra in RUNS.items()})
    return publish(render(runs, args.iterations), args.write, SECTION)


def render(runs: dict[str, list[dict]], iterations: int) -> str:
    now = runs[next(iter(RUNS))]
    same_start = len({round(rows[0]["reward/mean"], 6) for rows in runs.values()}) == 1
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'deepspeed', 'vllm')}. Date: {today()}.", "",
             f"Command: `python benchmarks/bench_phase_threads.py --iterations {iterations} --write "
             "benchmarks/HISTORY.md`. The PPO stage of configs/recipes/smollm2-sft-grpo.yaml from its SFT model "
             "(SmolLM2-135M fp32, 2 cores, 8 prompts x 8 answers an iteration) with ppo.train_batch_size 16: 4 "
             "optimizer steps a rollout, so the policy scores old log-probs in the experience phase beside the "
             "reference, then trains alone. Run as shipped (threads per phase, jobs/threads.py), with the policy "
             "on 1 thread in both phases (what the job did before: the crowd of its busiest phase) and on 2 in "
             "both (its scoring then shares the 2 cores with the reference's thread), one after the other; medians "
             f"of iterations 2-{iterations}.", "",
             "| policy threads | iteration s | training s | experience s | old log-probs s | reference s | "
             "iteration ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, metrics in runs.items():
        lines.append(f"| {label} | {steady(metrics, 'time/iteration'):.1f} | "
                     f"{steady(metrics, 'compute/train_seconds'):.1f} | {steady(metrics, 'time/experience'):.1f} | "
                     f"{steady(metrics, 'compute/policy_seconds'):.1f} | "
                     f"{steady(metrics, 'compute/reference_seconds'):.1f} | "
                     f"{steady(metrics, 'time/iteration') / steady(now, 'time/iteration'):.2f} |")
    lines += ["", "Ratios: the run's median over the first run's. The first iteration's rollout "
              f"{'was' if same_start else 'was not'} the same in all three (its mean reward equal); the updates "
              "then differ, and with them the weights and later rollouts."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
