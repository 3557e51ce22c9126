"""Multi-turn GRPO with a calculator tool: does SmolLM2-135M-Instruct learn to call the tool well and answer right?

Runs configs/recipes/smollm2-calculator-grpo.yaml (demo/word-problems, the calculator environment, episode reward)
for `--iterations` iterations and reports the held-out numbers the job measures before and after training: tool
calls per episode, tool-call validity (well-formed calls / calls), turns per episode and task accuracy (the last
number of the episode against the ground truth), greedy and sampled; and the per-rollout training curves.

Run: python benchmarks/bench_calculator.py [--iterations 12] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, pyplot, run_job, save_figure, today, versions, write_section  # noqa: E402

SECTION = "## Multi-turn GRPO with a calculator tool (SmolLM2-135M-Instruct)"
RECIPE = ROOT / "configs/recipes/smollm2-calculator-grpo.yaml"
KEYS = ("task_accuracy", "tool_calls_per_episode", "tool_call_validity", "turns_per_episode")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--write", type=Path, help="markdown file whose section is replaced")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        summary, rows = run_job("ppo", RECIPE, [f"output_dir={out}", f"ppo.iterations={args.iterations}",
                                                f"ppo.eval_prompts={args.eval_prompts}", "checkpoint.every_steps=0"],
                                timeout=3 * 3600)
    curves = [r for r in rows if "env/episode_reward" in r]
    result = {"summary": summary, "curves": [{k: r.get(k) for k in ("step", "env/episode_reward",
                                                                    "env/tool_calls_per_episode",
                                                                    "env/tool_call_validity",
                                                                    "env/turns_per_episode", "time/iteration")}
                                              for r in curves]}
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / "benchmarks/results/calculator.json").write_text(json.dumps(result, indent=2))
    text = render(result, args)
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)
    return 0


def fmt(value) -> str:
    return "n/a" if value is None or value != value else f"{value:.3f}"


def render(result: dict, args) -> str:
    s, curves = result["summary"], result["curves"]
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'vllm', 'transformers')}. Date: {today()}.", "",
             f"Command: `python benchmarks/bench_calculator.py --iterations {args.iterations} --eval-prompts "
             f"{args.eval_prompts} --write docs/benchmarks.md` "
             f"(the recipe `configs/recipes/smollm2-calculator-grpo.yaml`, {args.iterations} iterations of 8 prompts x "
             f"4 episodes, up to 3 turns each; {s.get('eval_prompts')} held-out prompts). One run.", "",
             "| held-out | greedy before | greedy after | sampled before | sampled after |", "|---|---|---|---|---|"]
    for key in KEYS:
        lines.append(f"| {key.replace('_', ' ')} | {fmt(s.get(f'{key}_before'))} | {fmt(s.get(f'{key}_after'))} | "
                     f"{fmt(s.get(f'sampled_{key}_before'))} | {fmt(s.get(f'sampled_{key}_after'))} |")
    lines += ["", "Training rollouts (episode reward = share of episodes answered right):", "",
              "| iteration | episode reward | tool calls / episode | tool-call validity | turns / episode |",
              "|---|---|---|---|---|"]
    for r in curves:
        lines.append(f"| {r['step']} | {fmt(r['env/episode_reward'])} | {fmt(r['env/tool_calls_per_episode'])} | "
                     f"{fmt(r['env/tool_call_validity'])} | {fmt(r['env/turns_per_episode'])} |")
    plt = pyplot()
    if plt is not None and curves:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        steps = [r["step"] for r in curves]
        for key, label in (("env/episode_reward", "episode reward"), ("env/tool_calls_per_episode", "tool calls")):
            ax.plot(steps, [r[key] for r in curves], marker="o", label=label)
        ax.set_xlabel("iteration")
        ax.legend()
        lines += ["", save_figure(fig, ROOT / "docs/benchmarks.md", "calculator_grpo.png")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
