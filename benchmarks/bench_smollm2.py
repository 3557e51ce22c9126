"""Does RL make a real model better? SmolLM2-135M-Instruct on the bundled arithmetic word problems
(demo/word-problems), run through the recipes in configs/recipes/ as a user would (`rlhf-ray ppo|pipeline`),
seed by seed: held-out greedy and sampled accuracy before and after (summary.json, the correctness rule), wall
time, peak memory of the whole process tree (PSS, polled), and per iteration the reward, KL and train/inference
log-prob gap (metrics.jsonl), plotted against iterations.

    .venv/bin/python benchmarks/bench_smollm2.py [--write benchmarks/HISTORY.md] [--runs grpo] [--seeds 1,2,3]
        [--iterations N] [--set key=value ...]

Each run's result (summary, metrics rows, minutes, peak) is kept in benchmarks/results/smollm2/<recipe>-<seed>.json,
committed with the docs, so a later invocation on another machine still reports it; the job's own output folder
stays in --workdir.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, pyplot, run_watched, save_figure, today, versions, write_section  # noqa: E402

HEADING = "## A real model on a verifiable task: SmolLM2-135M-Instruct"
RECIPES = {"grpo": ("ppo", "configs/recipes/smollm2-grpo.yaml"),
           "ppo": ("ppo", "configs/recipes/smollm2-ppo.yaml"),
           "pipeline": ("pipeline", "configs/recipes/smollm2-pipeline.yaml")}
RESULTS = ROOT / "benchmarks" / "results" / "smollm2"


def recipe_hash(config: str) -> str:
    return hashlib.sha256((ROOT / config).read_bytes()).hexdigest()[:12]


def run_measured(kind: str, config: str, overrides: list[str], out: Path, timeout: float) -> dict:
    """One job in a fresh process; its summary, metrics rows, wall seconds and peak PSS of the process tree.
    The result is kept in RESULTS (with the recipe's hash), so later runs of other seeds or recipes report it too."""
    command = [sys.executable, "-m", "rlhf_ray.cli", kind, "--config", str(ROOT / config)]
    for item in ["cluster.dashboard=false", "logging.progress=false", f"output_dir={out}", *overrides]:
        command += ["--set", item]
    seconds, peak = run_watched(command, out.parent / f"{out.name}.log", timeout=timeout)
    stage = out / "ppo" if kind == "pipeline" else out
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (stage / "metrics.jsonl").read_text().splitlines()]
    # a pipeline rerun reuses the stages an earlier run finished: their time counts as if run now
    seconds += sum(part.get("seconds", 0) for part in summary.values() if isinstance(part, dict) and part.get("reused"))
    result = {"summary": summary.get("ppo", summary), "stages": summary if kind == "pipeline" else None,
              "metrics": metrics, "seconds": seconds, "peak_gib": peak, "recipe": recipe_hash(config),
              "overrides": overrides, "date": today(), "machine": machine()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out.name}.json").write_text(json.dumps(result) + "\n")
    return result


def kept_results() -> dict:
    """Every kept result whose recipe file is unchanged since it ran, by (recipe, seed). A result marked
    `restored` was rebuilt from the docs' table after its run's files were lost: it has the table's numbers but no
    per-iteration metrics."""
    found = {}
    for name, (_, config) in RECIPES.items():
        for file in sorted(RESULTS.glob(f"{name}-*.json")):
            r = json.loads(file.read_text())
            if r.get("recipe") == recipe_hash(config):
                found[(name, int(file.stem.rsplit("-", 1)[1]))] = r
            else:
                print(f"not reported: {file} ran an older {config}", flush=True)
    return found


def fmt(x, digits=3) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def training_minutes(r: dict) -> float:
    """The PPO iterations' wall time, plus the pipeline's SFT and reward-model stages (they train too)."""
    if "restored" in r:
        return r["restored"]["training_min"]
    iterations = sum(row["time/iteration"] for row in r["metrics"] if "time/iteration" in row)
    return (iterations + sum(r["stages"][k]["seconds"] for k in ("sft", "rm") if r.get("stages"))) / 60


def table(results: dict) -> str:
    rows = ["| recipe | seed | greedy before | greedy after | sampled before | sampled after | iterations | "
            "training min | total min | peak GiB | log-prob gap (mean) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (name, seed), r in results.items():
        s, m = r["summary"], [row for row in r["metrics"] if "time/iteration" in row]
        train_min = training_minutes(r)
        gaps = [row["generate/logprob_gap"] for row in m if "generate/logprob_gap" in row]
        if "restored" in r and r["restored"].get("logprob_gap_mean") is not None:
            gaps = [r["restored"]["logprob_gap_mean"]]
        rows.append(f"| {name} | {seed} | {fmt(s.get('task_accuracy_before'))} | {fmt(s.get('task_accuracy_after'))} | "
                    f"{fmt(s.get('sampled_task_accuracy_before'))} | {fmt(s.get('sampled_task_accuracy_after'))} | "
                    f"{s['iterations']} | {train_min:.1f} | {r['seconds'] / 60:.1f} | {r['peak_gib']:.1f} | "
                    f"{fmt(sum(gaps) / len(gaps) if gaps else None, 4)} |")
    stages = [stage_line(name, seed, r["stages"]) for (name, seed), r in results.items() if r.get("stages")]
    return "\n".join(rows + ([""] + stages if stages else []))


def stage_line(name: str, seed: int, stages: dict) -> str:
    """The pipeline's first two stages in one line: SFT's held-out loss, the reward model's pair accuracy, and
    their minutes (their minutes count as training time against the 20-minute goal)."""
    sft, rm = stages["sft"], stages["rm"]
    return (f"- {name} seed {seed}: SFT {sft['steps']} steps in {sft['seconds'] / 60:.1f} min (held-out loss "
            f"{sft['eval_loss_first']:.3f} -> {sft['eval_loss_last']:.3f}); reward model {rm['steps']} steps in "
            f"{rm['seconds'] / 60:.1f} min (held-out pair accuracy {rm['eval_accuracy_first']:.2f} -> "
            f"{rm['eval_accuracy']:.2f}); the PPO row's `before` is the SFT model.")


def command(name: str, seed: int, r: dict) -> str:
    extra = " ".join(f"--set {o}" for o in r["overrides"] if not o.startswith(("seed=", "checkpoint.resume",
                                                                              "ppo.checkpoint.resume")))
    return f"python benchmarks/bench_smollm2.py --runs {name} --seeds {seed}" + (f" {extra}" if extra else "")


def verdicts(results: dict) -> str:
    """The goal, +20 points of held-out greedy accuracy within 20 minutes of training, row by row. A pipeline's
    gain counts from the starting model: the GRPO rows' `before` (the same model on the same held-out problems)."""
    base = next((r["summary"]["task_accuracy_before"] for (name, _), r in results.items() if name == "grpo"), None)
    lines = ["Goal: +20 points of held-out greedy accuracy within 20 minutes of training, 3 seeds per recipe."]
    for (name, seed), r in results.items():
        s = r["summary"]
        minutes = training_minutes(r)
        start = base if r.get("stages") and base is not None else s["task_accuracy_before"]
        gain = 100 * (s["task_accuracy_after"] - start)
        met = gain >= 20 and minutes <= 20
        origin = "from the starting model" if r.get("stages") else "from before"
        lines.append(f"- {name} seed {seed}: {gain:+.1f} points {origin} ({start:.3f} -> "
                     f"{s['task_accuracy_after']:.3f}) in {minutes:.1f} min: {'met' if met else 'missed'}.")
    seeds = {name: sum(1 for (n, _) in results if n == name) for name, _ in results}
    lines += [f"- {name}: {n} of 3 seeds run." for name, n in seeds.items() if n < 3]
    lines += [f"- {name}: not run yet." for name in RECIPES if name not in seeds]
    return "\n".join(lines)


def machines(results: dict) -> str:
    """Which machine each run ran on: one sentence if they all ran on one, else a list (minutes compare only
    within one machine)."""
    by_machine: dict[str, list[str]] = {}
    for (name, seed), r in results.items():
        by_machine.setdefault(r.get("machine", "unknown"), []).append(f"{name} seed {seed}")
    if len(by_machine) == 1:
        return f"Measured on {next(iter(by_machine))}."
    return "Measured on several machines of the same size (minutes compare within one machine only): " + "; ".join(
        f"{', '.join(runs)} on {where}" for where, runs in by_machine.items()) + "."


def plot(results: dict, doc: Path) -> str:
    plt = pyplot()
    if plt is None:
        return "(matplotlib missing: no plot)"
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    lost = [f"{name} seed {seed}" for (name, seed), r in results.items() if "restored" in r]
    for (name, seed), r in results.items():
        if "restored" in r:
            continue
        rows = [row for row in r["metrics"] if "reward/mean" in row]
        steps = [row["step"] for row in rows]
        axes[0].plot(steps, [row["reward/mean"] for row in rows], label=f"{name} seed {seed}")
        axes[1].plot(steps, [row.get("kl/mean", float("nan")) for row in rows])
        axes[2].plot(steps, [row.get("generate/logprob_gap", float("nan")) for row in rows])
    titles = ["rollout reward (rule: share right; pipeline: RM score)", "KL to the reference",
              "engine/learner log-prob gap"]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("iteration")
    axes[0].legend(fontsize=7)
    figure = save_figure(fig, doc, "smollm2_rl.png")
    if lost:
        figure += ("\n\nNot in the plot (their per-iteration metrics were lost with an earlier machine's work "
                   "folder; their rows come from this table as it was): " + ", ".join(lost) + ".")
    return figure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path)
    parser.add_argument("--runs", default="grpo", help="comma-separated: " + ", ".join(RECIPES) +
                        "; empty: run nothing, report the kept runs")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--iterations", type=int, help="override ppo.iterations")
    parser.add_argument("--set", action="append", default=[], help="extra override for every run")
    parser.add_argument("--timeout", type=float, default=5400)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench_smollm2",
                        help="kept after the run: each job's output folder and log")
    args = parser.parse_args()
    results = {}
    args.workdir.mkdir(parents=True, exist_ok=True)
    tmp = args.workdir
    for name in filter(None, args.runs.split(",")):
        kind, config = RECIPES[name]
        prefix = "ppo." if kind == "pipeline" else ""
        extra = list(args.set) + ([f"{prefix}ppo.iterations={args.iterations}"] if args.iterations else [])
        for seed in [int(s) for s in args.seeds.split(",")]:
            print(f"== {name} seed {seed}", flush=True)
            overrides = [f"seed={seed}", f"{prefix}checkpoint.resume=false", *extra]
            results[(name, seed)] = r = run_measured(kind, config, overrides, tmp / f"{name}-{seed}", args.timeout)
            print(json.dumps({k: v for k, v in r["summary"].items() if k != "data_report"}), flush=True)
            print(f"   {r['seconds']:.0f} s, peak {r['peak_gib']:.1f} GiB", flush=True)
    results = {**kept_results(), **results}
    text = table(results)
    print(text)
    if args.write:
        commands = "; ".join(f"{name} seed {seed}: `{command(name, seed, r)}` ({r['date']})"
                             for (name, seed), r in results.items())
        section = (f"{HEADING}\n\n{machines(results)} Versions: "
                   f"{versions('torch', 'ray', 'deepspeed', 'transformers', 'vllm')}. Each row is one run of "
                   f"`benchmarks/bench_smollm2.py`, kept in benchmarks/results/smollm2/ and reported by every later "
                   f"invocation while its recipe file is unchanged: {commands}.\n\n"
                   "The recipes as shipped (configs/recipes/smollm2-*.yaml), one process tree per run. Greedy "
                   "and sampled accuracy: the correctness rule on `ppo.eval_prompts` held-out problems (greedy; "
                   "`ppo.eval_samples` sampled answers each at the training temperature), before and after PPO. "
                   "Training min: the iterations' wall time (the pipeline's SFT and reward-model stages included); "
                   "total: the whole job with model import, actor start and both evaluations. Peak: PSS of the "
                   "job's process tree, polled.\n\n"
                   f"{text}\n\n{plot(results, args.write)}\n\n{verdicts(results)}\n")
        write_section(args.write, HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
