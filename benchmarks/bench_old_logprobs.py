"""Old log-probs from the policy's forward or from the engine, side by side.

The PPO stage of configs/recipes/smollm2-sft-grpo.yaml from its SFT model (SmolLM2-135M fp32, 2 cores, 8 prompts x
8 answers an iteration) with ppo.train_batch_size 16: 4 optimizer steps a rollout, so the PPO ratio needs old
log-probs. Three runs, one after the other:
- `ppo.old_logprobs: policy` (the default): the policy runs a forward over the rollout beside the reference;
- `ppo.old_logprobs: engine`: the log-probs vLLM returned with its samples; the reference scores alone;
- the same without a KL term (`ppo.kl_coef: 0`, `reference: null`): nothing but the reward function scores.
The same seed: the first rollout is the same in all three; later ones differ with the weights. Medians over the
iterations after the first. The first run's generate/mismatch_kl is the gap the engine's log-probs bring into the
ratio (the fp32 vLLM against the fp32 learner).

Run: python benchmarks/bench_old_logprobs.py [--sft SFT_MODEL] [--iterations 4] [--write benchmarks/HISTORY.md]
(without --sft the recipe's SFT stage runs first, ~5 minutes on 2 cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_grpo_stage import timed_variants, timing_args  # noqa: E402
from common import machine, publish, steady, today, versions  # noqa: E402

SECTION = "## Old log-probs from the engine"
RUNS = {"policy forward (default)": [],
        "engine": ["ppo.old_logprobs=engine"],
        "engine, no KL term, no reference": ["ppo.old_logprobs=engine", "ppo.kl_coef=0", "reference=null"]}
"""Label: the overrides of the run."""


def main() -> int:
    args = timing_args(__doc__)
    runs = timed_variants(args.sft, args.iterations,
                          {label: ["ppo.train_batch_size=16", *extra] for label, extra in RUNS.items()})
    return publish(render(runs, args.iterations), args.write, SECTION)


def render(runs: dict[str, list[dict]], iterations: int) -> str:
    first = runs[next(iter(RUNS))]
    same_start = len({round(rows[0]["reward/mean"], 6) for rows in runs.values()}) == 1
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'deepspeed', 'vllm')}. Date: {today()}.", "",
             f"Command: `python benchmarks/bench_old_logprobs.py --iterations {iterations} --write "
             "benchmarks/HISTORY.md`. The PPO stage of configs/recipes/smollm2-sft-grpo.yaml from its SFT model "
             "(SmolLM2-135M fp32, 2 cores, 8 prompts x 8 answers an iteration) with ppo.train_batch_size 16: 4 "
             "optimizer steps a rollout, so the ratio needs old log-probs. Run with the policy's forward for them "
             "(the default, beside the reference), with the engine's (`ppo.old_logprobs: engine`: the reference "
             "scores alone) and with the engine's and no KL term (`ppo.kl_coef: 0`, `reference: null`), one after "
             f"the other; medians of iterations 2-{iterations}.", "",
             "| old log-probs | iteration s | generation s | experience s | training s | reference s | "
             "iteration ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, metrics in runs.items():
        reference = steady(metrics, "compute/reference_seconds")
        lines.append(f"| {label} | {steady(metrics, 'time/iteration'):.1f} | "
                     f"{steady(metrics, 'time/engine_generate'):.1f} | {steady(metrics, 'time/experience'):.1f} | "
                     f"{steady(metrics, 'compute/train_seconds'):.1f} | "
                     f"{'-' if reference != reference else f'{reference:.1f}'} | "
                     f"{steady(metrics, 'time/iteration') / steady(first, 'time/iteration'):.2f} |")
    gap = [m["generate/mismatch_kl"] for m in first if "generate/mismatch_kl" in m]
    lines += ["", "Ratios: the run's median over the first run's. The engine/learner mismatch the engine's log-probs "
              f"bring into the ratio, measured in the first run: generate/mismatch_kl {max(gap):.1e} at most over its "
              f"{len(gap)} iterations. The first iteration's rollout {'was' if same_start else 'was not'} the same in "
              "all three (its mean reward equal); the updates then differ, and with them the weights and later "
              "rollouts."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
