"""How much of the policy's and critic's training compute is padding on the SmolLM2 recipes, with micro-batches
cut by rows (every micro_batch_size rows in prompt order), by a token budget (`max_tokens_per_micro_batch`: rows
sorted by length), and packed (`pack_sequences`: each micro-batch one row of its real tokens, attention block by
block, a GRPO prompt once for its answers) by rows and by the budget, side by side in one run.

Each recipe (configs/recipes/smollm2-grpo.yaml, smollm2-ppo.yaml) runs as a real `rlhf-ray ppo` job in a fresh
process for a few iterations, without evaluation or checkpoints, as written and with every role's budget at
micro_batch_size x (max_prompt_len + max_new_tokens): the row path's worst case, so the budget bounds memory as the
rows did; each of the two also packed. `policy/padding_fraction` and `critic/padding_fraction` are the share of the tokens of
every training forward (each micro-batch trimmed to its own longest prompt and answer) that are pads; a forward's
cost grows with its tokens, so that share of the training time is spent on pads.

Run: python benchmarks/bench_padding.py [--iterations N] [--write benchmarks/HISTORY.md]
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, publish, recipe_args, run_job, steady, today, versions  # noqa: E402

SECTION = "## Padding in training forwards (SmolLM2 recipes)"
RECIPES = {"GRPO": ROOT / "configs/recipes/smollm2-grpo.yaml", "PPO (critic)": ROOT / "configs/recipes/smollm2-ppo.yaml"}


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else float("nan")


def roles(spec: dict) -> list[str]:
    return ["policy", "reference"] + (["critic"] if spec.get("critic") else []) + \
        (["reward"] if "model" in (spec.get("reward") or {}) else [])


def budget_overrides(config: Path) -> list[str]:
    """Every role's token budget at its micro_batch_size x the longest row."""
    spec = yaml.safe_load(config.read_text())
    longest = spec["data"]["max_prompt_len"] + spec["generation"]["sampling"]["max_new_tokens"]
    default = {"policy": 4, "critic": 4, "reference": 8, "reward": 8}
    return [f"{r}.max_tokens_per_micro_batch={(spec.get(r) or {}).get('micro_batch_size', default[r]) * longest}"
            for r in roles(spec)]


def packed_overrides(config: Path) -> list[str]:
    return [f"{r}.pack_sequences=true" for r in roles(yaml.safe_load(config.read_text()))]


def cuts(config: Path) -> dict[str, list[str]]:
    return {"rows": [], "token budget": budget_overrides(config), "packed rows": packed_overrides(config),
            "packed, token budget": [*budget_overrides(config), *packed_overrides(config)]}


def main() -> int:
    args = recipe_args(__doc__, iterations=3)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in RECIPES.items():
            for cut, extra in cuts(config).items():
                t = time.perf_counter()
                _, rows = run_job("ppo", config, [f"output_dir={Path(tmp) / name.split()[0] / cut.replace(' ', '')}",
                                                  f"ppo.iterations={args.iterations}", "ppo.eval_prompts=0",
                                                  "checkpoint.every_steps=0", *extra])
                print(f"{name}, {cut}: {time.perf_counter() - t:.0f} s {extra}", flush=True)
                results[(name, cut)] = {"policy": mean(rows, "policy/padding_fraction"),
                                        "critic": mean(rows, "critic/padding_fraction"),
                                        "train": steady(rows, "compute/train_seconds"),
                                        "policy_s": steady(rows, "compute/policy_seconds"),
                                        "iteration": steady(rows, "time/iteration"),
                                        "length": mean(rows, "answer/length"), "budget": extra}
    text = render(results, args)
    return publish(text, args.write, SECTION)


def render(results: dict, args) -> str:
    def pct(x: float) -> str:
        return "-" if math.isnan(x) else f"{100 * x:.0f}%"

    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'deepspeed', 'transformers', 'vllm')}. "
             f"Date: {today()}.", "",
             f"Command: `python benchmarks/bench_padding.py --iterations {args.iterations} --write "
             "benchmarks/HISTORY.md`: each recipe as written (fp32, 2 cores), no evaluation, with micro-batches by "
             "rows, with every role's `max_tokens_per_micro_batch` at micro_batch_size x the longest row (the rows' "
             "worst case: the same memory bound), and each of the two with every role's `pack_sequences`; medians "
             "of the iterations after the first for the times, means over every iteration for the rest. Padding: "
             "the share of the training forwards' tokens that are pads.", "",
             "| recipe | micro-batches | policy padding | critic padding | mean answer tokens | "
             "training s / iteration | iteration s |", "|---|---|---:|---:|---:|---:|---:|"]
    for (name, cut), r in results.items():
        lines.append(f"| {name} | {cut} | {pct(r['policy'])} | {pct(r['critic'])} | {r['length']:.1f} | "
                     f"{r['train']:.1f} | {r['iteration']:.1f} |")
    packed = [r for (_, cut), r in results.items() if cut.startswith("packed")]
    worst = max(fraction for r in packed for fraction in (r["policy"], r["critic"])
                if not math.isnan(fraction))  # a recipe without a critic has no critic fraction
    lines += ["", f"Goal (issue 38): padding under 5% of every role's training tokens: {pct(worst)} at worst packed "
              f"({'met' if worst < 0.05 else 'missed'}); and the iteration faster by what the padding cost "
              "(training time per iteration against the rows' and the ratio):"]
    for name in dict.fromkeys(n for n, _ in results):
        base = results[(name, "rows")]
        lines.append(f"- {name}: rows {base['train']:.1f} s (padding {pct(base['policy'])}); " + "; ".join(
            f"{cut} {r['train']:.1f} s ({base['train'] / r['train']:.2f}x, iteration {base['iteration']:.1f} -> "
            f"{r['iteration']:.1f} s)" for (n, cut), r in results.items() if n == name and cut != "rows") + ".")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
