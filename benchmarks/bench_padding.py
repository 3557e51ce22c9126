"""How much of the policy's and critic's training compute is padding, on the SmolLM2 recipes: the figure issue 38
asks for before micro-batches are packed by a token budget.

Each recipe (configs/recipes/smollm2-grpo.yaml, smollm2-ppo.yaml) runs as a real `rlhf-ray ppo` job in a fresh
process for a few iterations, without evaluation or checkpoints. `policy/padding_fraction` and
`critic/padding_fraction` are the share of the tokens of every training forward (each micro-batch trimmed to its
own longest prompt and answer) that are pads; a forward's cost grows with its tokens, so that share of the
training time is spent on pads.

Run: python benchmarks/bench_padding.py [--iterations N] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, run_job, steady, today, versions, write_section  # noqa: E402

SECTION = "## Padding in training forwards (SmolLM2 recipes)"
RECIPES = {"GRPO": ROOT / "configs/recipes/smollm2-grpo.yaml", "PPO (critic)": ROOT / "configs/recipes/smollm2-ppo.yaml"}


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--write", type=Path, help="markdown file whose section is replaced")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in RECIPES.items():
            t = time.perf_counter()
            _, rows = run_job("ppo", config, [f"output_dir={Path(tmp) / name.split()[0]}",
                                              f"ppo.iterations={args.iterations}", "ppo.eval_prompts=0",
                                              "checkpoint.every_steps=0"])
            print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
            results[name] = {"policy": mean(rows, "policy/padding_fraction"),
                             "critic": mean(rows, "critic/padding_fraction"),
                             "train": steady(rows, "compute/train_seconds"),
                             "iteration": steady(rows, "time/iteration"),
                             "length": mean(rows, "answer/length")}
    text = render(results, args)
    if args.write:
        write_section(args.write, SECTION, text)
    print(text)
    return 0


def render(results: dict, args) -> str:
    def pct(x: float) -> str:
        return "-" if math.isnan(x) else f"{100 * x:.0f}%"

    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'deepspeed', 'transformers', 'vllm')}. "
             f"Date: {today()}.", "",
             f"Command: `python benchmarks/bench_padding.py --iterations {args.iterations} --write "
             "docs/benchmarks.md`: each recipe as written (fp32, 2 cores), no evaluation, medians of the iterations "
             "after the first for the times, means over every iteration for the rest.", "",
             "| recipe | policy padding | critic padding | mean answer tokens | training s / iteration | "
             "iteration s |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {pct(r['policy'])} | {pct(r['critic'])} | {r['length']:.1f} | {r['train']:.1f} | "
                     f"{r['iteration']:.1f} |")
    worst = max(fraction for r in results.values() for fraction in (r["policy"], r["critic"])
                if not math.isnan(fraction))  # a recipe without a critic has no critic fraction
    lines += ["", f"Goal (issue 38): padding under 5% of every role's training tokens: {pct(worst)} at worst "
              f"({'met' if worst < 0.05 else 'missed'}). This is the figure before packing: micro-batches are rows "
              "in prompt order (a GRPO prompt's answers together, so the prompt's forward is shared), each trimmed "
              "to its own longest prompt and answer; the pads are the shorter prompts' left padding and the shorter "
              "answers' right padding. What would close it: micro-batches by a token budget with rows sorted by "
              "length (issue 38, part 2)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
