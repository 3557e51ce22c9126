"""Does RL add to SFT? SmolLM2-135M-Instruct on the bundled word problems: SFT on worked answers, then RL from
the SFT model (issue 41). Each recipe is a pipeline run as a user runs it (`rlhf-ray pipeline --config ...`), seed
by seed; the RL stage's held-out accuracy `before` is the SFT model's, on the same 300 held-out problems, so the
gain is RL's alone. Reported: greedy and sampled accuracy before -> after with standard errors, RL minutes (the
iterations' wall time), peak memory of the process tree, and per iteration the rollouts' reward (share right).

    .venv/bin/python benchmarks/bench_rl_after_sft.py [--recipes sft-grpo] [--seeds 1,2,3] [--write benchmarks/HISTORY.md]

Each run's result is kept in benchmarks/results/rl_after_sft/<recipe>-<seed>.json (with the hashes of the recipe
file and of the settings it ran: the recipe with the run's overrides), so a later invocation reports runs made
earlier, on this machine or another, while their settings are still the recipe's; --report-only runs nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ROOT, file_hash, machine, pyplot, run_watched, save_figure, settings_hash, today,  # noqa: E402
                    versions, write_section)

HEADING = "## RL after SFT on word problems (SmolLM2-135M-Instruct)"
RECIPES = {"sft-grpo": "configs/recipes/smollm2-sft-grpo.yaml",
           "sft-ppo": "configs/recipes/smollm2-sft-ppo.yaml",
           "pipeline-steps": "configs/recipes/smollm2-pipeline-steps.yaml",
           "distill": "configs/recipes/smollm2-distill.yaml",
           "distill-warmup": "configs/recipes/smollm2-distill-warmup.yaml"}
STARTS_FROM = {"sft-grpo": "SFT model", "sft-ppo": "SFT model", "pipeline-steps": "SFT model",
               "distill": "base (student)", "distill-warmup": "warmed-up student"}
RESULTS = ROOT / "benchmarks" / "results" / "rl_after_sft"
GOAL_POINTS, GOAL_MINUTES = 8.0, 20.0


def recipe_hash(config: str) -> str:
    return file_hash(ROOT / config)


def recipe_settings(config: str, overrides: list[str] | None = None) -> str:
    """Which settings a run of this recipe with these overrides has: a kept result counts for the recipe as it is
    now when its settings equal the recipe's own (its file hash says which file version it started from)."""
    return settings_hash((ROOT / config).read_text(), overrides or [])


def sft_section(name: str) -> dict:
    return yaml.safe_load((ROOT / RECIPES[name]).read_text())["sft"]


def share_sft(name: str, seed: int, work: Path, out: Path) -> None:
    """Every recipe's SFT stage is the same job (same section, same seed): a finished one of another recipe of this
    seed is copied in, and the pipeline reuses it (its minutes are counted as if run again). So the recipes of a
    seed start from the very same SFT model, and distillation's teacher is the model sft-grpo starts from. `out`:
    the pipeline's output folder (a tagged experiment reuses its recipe's own SFT stage too)."""
    target = out / "sft"
    if target.exists():
        return
    for other in RECIPES:
        done = work / f"{other}-{seed}" / "sft"
        if done != target and sft_section(other) == sft_section(name) and (done / "summary.json").is_file():
            shutil.copytree(done, target, ignore=shutil.ignore_patterns("checkpoints"))
            print(f"{name} seed {seed}: reusing the SFT stage of {other} seed {seed}", flush=True)
            return


def run(name: str, seed: int, work: Path, overrides: list[str], tag: str | None = None) -> dict:
    config = RECIPES[name]
    out = work / f"{name}-{seed}" if tag is None else work / f"{name}-{seed}-{tag}"
    share_sft(name, seed, work, out)
    command = [sys.executable, "-m", "rlhf_ray.cli", "pipeline", "--config", str(ROOT / config)]
    for item in [f"seed={seed}", f"output_dir={out}", "cluster.dashboard=false", "logging.progress=false",
                 *overrides]:
        command += ["--set", item]
    seconds, peak = run_watched(command, work / f"{out.name}.log", timeout=3 * 3600)
    summary = json.loads((out / "summary.json").read_text())
    # a rerun reuses the stages an earlier run finished: their time counts as if run now
    seconds += sum(part.get("seconds", 0) for part in summary.values() if isinstance(part, dict) and part.get("reused"))
    metrics = [json.loads(line) for line in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    result = {"summary": summary, "metrics": metrics, "seconds": seconds, "peak_gib": peak,
              "recipe": recipe_hash(config), "settings": recipe_settings(config, overrides), "overrides": overrides,
              "date": today(), "machine": machine()}
    kept_in = RESULTS if tag is None else RESULTS / "experiments"
    kept_in.mkdir(parents=True, exist_ok=True)
    (kept_in / f"{out.name}.json").write_text(json.dumps(result) + "\n")  # NAME-SEED[-TAG], as its folder
    # the result is kept: the stages' DeepSpeed checkpoints (~6 GB a run) serve no later run (share_sft skips them)
    for folder in out.glob("*/checkpoints"):
        shutil.rmtree(folder, ignore_errors=True)
    return result


def kept() -> dict:
    found = {}
    for name, config in RECIPES.items():
        for file in sorted(RESULTS.glob(f"{name}-[0-9]*.json")):  # NAME-SEED (not distill-warmup-1 for distill)
            r = json.loads(file.read_text())
            if r["settings"] == recipe_settings(config):
                found[(name, int(file.stem.rsplit("-", 1)[1]))] = r
            else:
                print(f"not reported: {file} ran other settings than {config} holds now", flush=True)
    return found


def stderr(ppo: dict, key: str) -> float:
    """One standard error of summary key `key` (e.g. `sampled_task_accuracy_after`) over the held-out problems: the
    job's own (`..._se_after`, from the per-problem accuracies) where the run recorded it; for runs from before
    it did, sqrt(p (1 - p) / (n - 1)) over the n problems, exact for greedy answers (one per problem) and an upper
    bound for sampled ones (a problem's answers agreeing is the most their correlation can do)."""
    recorded = ppo.get(key.replace("_before", "_se_before").replace("_after", "_se_after"))
    if recorded is not None:
        return recorded
    p, n = ppo[key], ppo["eval_prompts"]
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")


def rl_minutes(r: dict) -> float:
    return sum(row["time/iteration"] for row in r["metrics"] if "time/iteration" in row) / 60


def teacher_tokens(r: dict, name: str = "distill") -> int:
    """Tokens the teacher scored over the run (every sampled answer token of every iteration), plus those it wrote
    for a warm-up stage."""
    stage = yaml.safe_load((ROOT / RECIPES[name]).read_text())["ppo"]
    per_iteration = stage["ppo"]["rollout_batch_size"] * stage["generation"]["sampling"]["n_samples_per_prompt"]
    warmup = r["summary"].get("warmup", {}).get("teacher_answers", {}).get("tokens", 0)
    return warmup + round(sum(row["answer/length"] * per_iteration for row in r["metrics"] if "answer/length" in row))


def verdict(name: str, seed: int, r: dict, results: dict) -> list[str]:
    ppo, stages = r["summary"]["ppo"], r["summary"]
    g0, g1 = ppo["task_accuracy_before"], ppo["task_accuracy_after"]
    s0, s1 = ppo.get("sampled_task_accuracy_before"), ppo.get("sampled_task_accuracy_after")
    gain, minutes = 100 * (g1 - g0), rl_minutes(r)
    if name == "sft-grpo":
        met = gain >= GOAL_POINTS and minutes <= GOAL_MINUTES and s1 > s0
        return [f"- sft-grpo seed {seed}: greedy {gain:+.1f} points over the SFT model in {minutes:.1f} RL minutes, "
                f"sampled {s0:.3f} -> {s1:.3f}: {'met' if met else 'missed'} (goal: >= +{GOAL_POINTS:.0f} points "
                f"within {GOAL_MINUTES:.0f} min, sampled rising)."]
    if name == "sft-ppo":
        grpo = results.get(("sft-grpo", seed))
        if grpo is None:
            beside = ""
        else:
            other = grpo["summary"]["ppo"]
            beside = (f"; sft-grpo of the same seed (the same SFT model): "
                      f"{100 * (other['task_accuracy_after'] - other['task_accuracy_before']):+.1f} in "
                      f"{rl_minutes(grpo):.1f}")
        return [f"- sft-ppo seed {seed}: greedy {gain:+.1f} points over the SFT model in {minutes:.1f} RL minutes, "
                f"sampled {s0:.3f} -> {s1:.3f} (no goal of its own: the +{GOAL_POINTS:.0f} goal is GRPO's{beside})."]
    if name == "pipeline-steps":
        rm = stages["rm"]
        return [f"- pipeline-steps seed {seed}: greedy {g0:.3f} -> {g1:.3f} ({gain:+.1f} points) with the "
                f"step-checking reward model: {'met' if g1 >= g0 else 'missed'} (goal: not below the SFT model); "
                f"the reward model's held-out accuracy on step-error pairs {rm['eval_accuracy_first']:.2f} -> "
                f"{rm['eval_accuracy']:.2f} ({rm['steps']} steps)."]
    teacher = results.get(("sft-grpo", seed))
    tokens = teacher_tokens(r, name)
    best = ppo.get("best")
    kept = "" if best is None else f"; its best evaluation {best['value']:.3f} at iteration {best['iteration']}"
    if teacher is None:
        return [f"- {name} seed {seed}: student {g0:.3f} -> {g1:.3f} greedy{kept} in {tokens:,} teacher tokens; the "
                "teacher's accuracy comes from sft-grpo's run of the same seed (its SFT model), not run yet."]
    t = teacher["summary"]["ppo"]["task_accuracy_before"]
    top = g1 if best is None else max(g1, best["value"])
    share = top / t if t else float("nan")
    return [f"- {name} seed {seed}: student {g0:.3f} -> {g1:.3f} greedy{kept}, {share:.0%} of the teacher's {t:.3f} "
            f"(the SFT model of the same seed, sft-grpo's `before`) in {tokens:,} teacher tokens"
            f"{' (the warm-up answers included)' if 'warmup' in r['summary'] else ''}: "
            f"{'met' if share >= 0.9 else 'missed'} (goal: >= 90%, in fewer teacher tokens than the off-policy "
            "baseline: section \"On-policy distillation against SFT on the teacher's samples\")."]


def report(results: dict) -> str:
    first = next(iter(results.values()))
    rows = ["| recipe | seed | starts from | greedy before | greedy after | gain (points) | sampled before | "
            "sampled after | RL iterations | RL min | total min | peak GiB |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    verdicts = []
    for (name, seed), r in sorted(results.items()):
        ppo = r["summary"]["ppo"]
        g0, g1 = ppo["task_accuracy_before"], ppo["task_accuracy_after"]
        s0, s1 = ppo.get("sampled_task_accuracy_before"), ppo.get("sampled_task_accuracy_after")
        se = {key: stderr(ppo, key) for key in ("task_accuracy_before", "task_accuracy_after",
                                                 "sampled_task_accuracy_before", "sampled_task_accuracy_after")}
        rows.append(f"| {name} | {seed} | {STARTS_FROM[name]} | {g0:.3f} ± {se['task_accuracy_before']:.3f} | "
                    f"{g1:.3f} ± {se['task_accuracy_after']:.3f} | {100 * (g1 - g0):+.1f} | "
                    f"{s0:.3f} ± {se['sampled_task_accuracy_before']:.3f} | "
                    f"{s1:.3f} ± {se['sampled_task_accuracy_after']:.3f} | {ppo['iterations']} | "
                    f"{rl_minutes(r):.1f} | "
                    f"{r['seconds'] / 60:.1f} | {r['peak_gib']:.1f} |")
        verdicts += verdict(name, seed, r, results)
    for name in RECIPES:
        done = sum(1 for (n, _) in results if n == name)
        if done < 3:
            verdicts.append(f"- {name}: {done} of 3 seeds run.")
    runs = "; ".join(f"{name} seed {seed}: {r['date']}, {r['machine']}" for (name, seed), r in sorted(results.items()))
    overridden = [f"{name} seed {seed} ran recipe file {r['recipe']} with "
                  + ", ".join(f"`{o}`" for o in r["overrides"])
                  for (name, seed), r in sorted(results.items()) if r["overrides"]]
    if overridden:
        runs += ". Kept because those settings are the recipe's now: " + "; ".join(overridden)
    return "\n".join([
        HEADING, "",
        f"Runs: {runs}. Versions: {versions('torch', 'ray', 'deepspeed', 'transformers', 'vllm')}.", "",
        "Command: `python benchmarks/bench_rl_after_sft.py --recipes NAME --seeds N --write benchmarks/HISTORY.md` "
        "(each run kept in benchmarks/results/rl_after_sft/ and reported by later invocations while the settings it "
        "ran, the recipe with its overrides, are the recipe's). A recipe is a pipeline, run as `rlhf-ray pipeline "
        "--config configs/recipes/smollm2-NAME.yaml --set seed=N`: SFT on worked answers first. sft-grpo: GRPO "
        "from the SFT model with the correctness rule as "
        "reward; sft-ppo: PPO from the SFT model with a critic (the SFT model with a new value head), one answer "
        "per prompt and the same rule as reward; pipeline-steps: a reward model on step-error pairs "
        "(demo/word-problems-steps), then PPO from the SFT model with it; distill: the base model distilled from "
        "the SFT model (the teacher), on-policy; distill-warmup: the base model fine-tuned on the teacher's answers "
        "to 240 training prompts (the warmup stage), then distilled on-policy at half distill's lr (its `before` is "
        "the warmed-up student). Held-out: "
        f"{first['summary']['ppo']['eval_prompts']} problems never trained on, greedy and sampled answers (2 per "
        "problem, rounded up to a multiple of the answers per prompt: 8 for GRPO's) at the training temperature, "
        "scored by the correctness rule; ± is one standard error over the problems (a problem's sampled answers "
        "count as one: they are not independent), as the job records it (`*_se_*` in summary.json); for runs from "
        "before it did, sqrt(p (1 - p) / (n - 1)), exact for greedy and an upper bound for sampled. `before` "
        "is the RL stage's evaluation before its first update (the SFT model, or the base student), so the gain is "
        "RL's alone. RL min: the RL iterations' wall time; total: the whole pipeline with model import, SFT, the "
        "reward model, actor start and both evaluations.",
        "", *rows, "", "Goals (issue 41):", *verdicts, "",
        "![rl_after_sft.png](img/rl_after_sft.png)"])


def plot(results: dict, doc: Path) -> None:
    """Left: the rollouts' share right per RL iteration (not pipeline-steps, whose reward is a model's score);
    right: distillation's reverse KL to the teacher per iteration."""
    plt = pyplot()
    fig, (right, kl) = plt.subplots(1, 2, figsize=(11, 3.5))
    for (name, seed), r in sorted(results.items()):
        rows = [row for row in r["metrics"] if "reward/mean" in row and "time/iteration" in row]
        steps = [row["step"] for row in rows]
        if name != "pipeline-steps":
            right.plot(steps, [row["reward/mean"] for row in rows], marker=".", label=f"{name} seed {seed}")
        if name.startswith("distill"):
            kl.plot(steps, [row["distill/reverse_kl"] for row in rows], marker=".", label=f"{name} seed {seed}")
    right.set(xlabel="RL iteration", ylabel="rollouts right (share)", title="rollouts right (the rule)")
    kl.set(xlabel="RL iteration", ylabel="nats per answer token", title="distill: student's reverse KL to the teacher")
    right.legend(fontsize=8)
    kl.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, doc, "rl_after_sft.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--tag", help="a tuning experiment (overrides that change training): kept apart in "
                                      "results/rl_after_sft/experiments/NAME-SEED-TAG.json, not in the table")
    parser.add_argument("--workdir", help="where the runs write (default: a temporary folder)")
    parser.add_argument("--report-only", action="store_true", help="run nothing; report the kept results")
    parser.add_argument("--write", help="replace this section of the given markdown file")
    args = parser.parse_args()
    if not args.report_only:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="rl-after-sft-"))
        work.mkdir(parents=True, exist_ok=True)
        for name in args.recipes.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                print(f"running {name} seed {seed} in {work}", flush=True)
                run(name, seed, work, args.overrides, args.tag)
    results = kept()
    if not results:
        print("no results yet", flush=True)
        return 1
    text = report(results)
    print(text)
    if args.write:
        doc = Path(args.write)
        plot(results, doc)
        write_section(doc, HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
