"""Multi-turn GRPO with a calculator tool: does SmolLM2-135M-Instruct learn to call the tool well and answer right?

Runs configs/recipes/smollm2-calculator.yaml: SFT on worked tool-use conversations of the training problems
(demo/word-problems-calculator, `--sft-steps` steps), then GRPO with the calculator environment for `--iterations`
iterations, and reports the held-out numbers the PPO stage measures before (= after SFT) and after GRPO: tool calls
per episode, tool-call validity (well-formed calls / calls), turns per episode and task accuracy (the last number of
the episode against the ground truth), greedy and sampled; the base model's, from the run without SFT
(benchmarks/results/calculator_no_warm_start.json, same held-out prompts); and the per-rollout training curves.

Run: python benchmarks/bench_calculator.py [--iterations 12] [--sft-steps 20] [--seed 1] [--write docs/benchmarks.md]
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
RECIPE = ROOT / "configs/recipes/smollm2-calculator.yaml"
BASE = ROOT / "benchmarks/results/calculator_no_warm_start.json"
KEYS = ("task_accuracy", "tool_calls_per_episode", "tool_call_validity", "turns_per_episode")
CURVE_KEYS = ("step", "env/episode_reward", "env/tool_calls_per_episode", "env/tool_call_validity",
              "env/turns_per_episode", "time/iteration")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--sft-steps", type=int, default=20)
    parser.add_argument("--eval-prompts", type=int, default=40, help="40: the prompts the base model's run used")
    parser.add_argument("--write", type=Path, help="markdown file whose section is replaced")
    parser.add_argument("--seed", type=int, default=1, help="the GRPO stage's seed (SFT keeps the recipe's)")
    parser.add_argument("--output-dir", type=Path, help="keep the run here (default: a temporary folder); a finished "
                        "SFT stage there with the same settings is reused, as a pipeline does")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.output_dir or Path(tmp) / "run"
        summary, _ = run_job("pipeline", RECIPE, [
            f"output_dir={out}", f"sft.train.max_steps={args.sft_steps}", f"ppo.ppo.iterations={args.iterations}",
            f"ppo.ppo.eval_prompts={args.eval_prompts}", "ppo.checkpoint.every_steps=0", f"ppo.seed={args.seed}"],
            timeout=3 * 3600)
        rows = [json.loads(line) for line in (out / "ppo/metrics.jsonl").read_text().splitlines()]
    curves = [{k: r.get(k) for k in CURVE_KEYS} for r in rows if "env/episode_reward" in r]
    result = {"sft": summary["sft"], "summary": summary["ppo"], "curves": curves, "seed": args.seed,
              "sft_steps": args.sft_steps, "iterations": args.iterations}
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / f"benchmarks/results/calculator_seed{args.seed}.json").write_text(json.dumps(result, indent=2))
    base = json.loads(BASE.read_text())["summary"] if BASE.is_file() else {}
    text = render(result, base, args) + seeds_table()
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)
    return 0


def fmt(value) -> str:
    return "n/a" if value is None or value != value else f"{value:.3f}"


def render(result: dict, base: dict, args) -> str:
    from rlhf_ray.config import load_job

    s, curves, sft = result["summary"], result["curves"], result["sft"]
    ppo = load_job(RECIPE).ppo
    shape = (f"{ppo.ppo.rollout_batch_size} prompts x {ppo.generation.sampling.n_samples_per_prompt} episodes, lr "
             f"{ppo.policy.optim.lr:g}")
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'vllm', 'transformers')}. Date: {today()}.", "",
             f"Command: `python benchmarks/bench_calculator.py --iterations {args.iterations} --sft-steps "
             f"{args.sft_steps} --eval-prompts {args.eval_prompts} --seed {args.seed} --write docs/benchmarks.md` "
             f"(the pipeline `configs/recipes/smollm2-calculator.yaml`: SFT {args.sft_steps} steps of 8 worked "
             f"tool-use conversations, then GRPO {args.iterations} iterations of {shape}, up to 3 turns each; "
             f"{s.get('eval_prompts')} held-out prompts, never trained on by either stage). One run (GRPO seed "
             f"{args.seed}). Base model: the held-out numbers of the earlier run without SFT "
             f"(`{BASE.relative_to(ROOT)}`: the first {base.get('eval_prompts', 'n/a')} of seed 1's prompts).", "",
             f"SFT: held-out loss {fmt(sft.get('eval_loss_first'))} -> {fmt(sft.get('eval_loss_last'))}; "
             f"{fmt(sft.get('seconds'))} s. GRPO: {fmt(s.get('seconds'))} s.", "",
             "| held-out | base model | after SFT | after SFT + GRPO |", "|---|---|---|---|"]
    for prefix, how in (("", "greedy"), ("sampled_", "sampled")):
        for key in KEYS:
            k = f"{prefix}{key}"
            lines.append(f"| {key.replace('_', ' ')} ({how}) | {fmt(base.get(f'{k}_before'))} | "
                         f"{fmt(s.get(f'{k}_before'))} | {fmt(s.get(f'{k}_after'))} |")
    lines += ["", rollouts_line(result)]
    plt = pyplot()
    if plt is not None and curves:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        steps = [r["step"] for r in curves]
        for key, label in (("env/episode_reward", "episode reward"), ("env/tool_calls_per_episode", "tool calls"),
                           ("env/tool_call_validity", "tool-call validity")):
            ax.plot(steps, [r[key] for r in curves], marker="o", label=label)
        ax.set_xlabel("GRPO iteration")
        ax.legend()
        lines += ["", save_figure(fig, ROOT / "docs/benchmarks.md", "calculator_grpo.png")]
    return "\n".join(lines) + "\n"


def rollouts_line(result: dict) -> str:
    """The training rollouts' trend in one sentence; every iteration's numbers stay in the results file and the plot."""
    curves = result["curves"]

    def mean(key: str, part: list[dict]) -> str:
        values = [r[key] for r in part if r.get(key) is not None]
        return fmt(sum(values) / len(values) if values else None)

    head, tail = curves[:3], curves[-3:]
    return (f"GRPO training rollouts, the first three iterations against the last three (means): episode reward (the "
            f"share of episodes answered right) {mean('env/episode_reward', head)} -> "
            f"{mean('env/episode_reward', tail)}, tool-call validity {mean('env/tool_call_validity', head)} -> "
            f"{mean('env/tool_call_validity', tail)}, tool calls per episode "
            f"{mean('env/tool_calls_per_episode', head)} -> {mean('env/tool_calls_per_episode', tail)}. Every "
            f"iteration: `benchmarks/results/calculator_seed{result['seed']}.json` and the plot.")


def seeds_table() -> str:
    """Every GRPO seed run so far (benchmarks/results/calculator_seed*.json) on one line each."""
    runs = [json.loads(f.read_text()) for f in sorted((ROOT / "benchmarks/results").glob("calculator_seed*.json"))]
    if len(runs) < 2:
        return ""
    lines = ["", "Every GRPO seed (the same SFT model; each seed's own held-out prompts, since the held-out order is "
             "shuffled by the seed):", "",
             "| GRPO seed | greedy accuracy | sampled accuracy | sampled tool-call validity | GRPO s |",
             "|---:|---|---|---|---:|"]
    for r in runs:
        s = r["summary"]
        lines.append(f"| {r['seed']} | {fmt(s.get('task_accuracy_before'))} -> {fmt(s.get('task_accuracy_after'))} | "
                     f"{fmt(s.get('sampled_task_accuracy_before'))} -> {fmt(s.get('sampled_task_accuracy_after'))} | "
                     f"{fmt(s.get('sampled_tool_call_validity_before'))} -> "
                     f"{fmt(s.get('sampled_tool_call_validity_after'))} | {s.get('seconds', 0):.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
