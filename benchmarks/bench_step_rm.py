"""Does a reward model check the steps? SmolLM2's reward models on the bundled word problems (issue 41): one trained
on demo/word-problems pairs (the rejected answer differs only in its final number) and one on
demo/word-problems-steps pairs (the rejected answer gets one intermediate step wrong and stays consistent after
it), each scored on held-out pairs of both kinds. Both start from the same SFT model; the reward-model sections
are the recipes' own (configs/recipes/smollm2-pipeline.yaml and smollm2-pipeline-steps.yaml).

    .venv/bin/python benchmarks/bench_step_rm.py --sft SFT_MODEL [--seed 1] [--write benchmarks/HISTORY.md]

A reward model's accuracy on the other kind of pairs is the first evaluation of a one-step RM job from it on those
pairs (taken before its step). Results are kept in benchmarks/results/step_rm/seed-N.json.

A change to the one-step reward model, tried on its own (kept in benchmarks/results/step_rm/experiments/, not in the
table): the recipe's rm section with `--set` overrides, its evaluations every `train.eval_every_steps`:

    .venv/bin/python benchmarks/bench_step_rm.py --sft SFT_MODEL --seed 3 --experiment NAME \
        --set train.max_steps=null --set train.epochs=3 --set train.eval_every_steps=56
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, run_watched, today, versions, write_section  # noqa: E402

HEADING = "## A reward model that checks the steps (SmolLM2-135M-Instruct)"
RESULTS = ROOT / "benchmarks" / "results" / "step_rm"
RECIPES = {"final number": ("configs/recipes/smollm2-pipeline.yaml", "demo/word-problems"),
           "one step": ("configs/recipes/smollm2-pipeline-steps.yaml", "demo/word-problems-steps")}


def rm_job(section: dict, model: str, dataset: str, out: Path, seed: int, overrides: tuple[str, ...] = ()) -> dict:
    """`rlhf-ray rm` with a recipe's reward-model section on `dataset`'s pairs (and `--set` overrides); its summary."""
    config = {**section, "kind": "rm", "output_dir": str(out), "seed": seed, "cluster": {"num_cpus": 2},
              "model": {**section["model"], "path": model}}
    config["data"] = {**section["data"], "datasets": [{"name": dataset, "chat_template": True}]}
    if (out / "summary.json").is_file():  # finished by an earlier invocation in the same --workdir
        return {**json.loads((out / "summary.json").read_text()), "wall_seconds": None, "eval_pairs": eval_pairs(out)}
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, "-m", "rlhf_ray.cli", "rm", "--config", str(path), "--set", "cluster.dashboard=false",
               *(arg for override in overrides for arg in ("--set", override))]
    seconds, _ = run_watched(command, out.parent / f"{out.name}.log", timeout=3600)
    return {**json.loads((out / "summary.json").read_text()), "wall_seconds": seconds, "eval_pairs": eval_pairs(out)}


def eval_pairs(out: Path) -> int:
    """How many held-out pairs the job's evaluations scored."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return int(next(r["eval_pairs"] for r in reversed(rows) if "eval_pairs" in r))


def measure(sft: str, seed: int, work: Path) -> dict:
    result: dict = {"date": today(), "machine": machine(), "sft": sft, "seed": seed, "trained": {}, "crossed": {}}
    for kind, (recipe, dataset) in RECIPES.items():
        section = yaml.safe_load((ROOT / recipe).read_text())["rm"]
        trained = rm_job(section, sft, dataset, work / f"rm-{kind.replace(' ', '-')}", seed)
        result["trained"][kind] = trained
        other_kind = next(k for k in RECIPES if k != kind)
        other = rm_job(section, str(work / f"rm-{kind.replace(' ', '-')}" / "model"), RECIPES[other_kind][1],
                       work / f"rm-{kind.replace(' ', '-')}-on-{other_kind.replace(' ', '-')}", seed, overrides=("train.max_steps=1",))
        result["crossed"][kind] = other["eval_accuracy_first"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"seed-{seed}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def experiment(sft: str, seed: int, name: str, overrides: list[str], work: Path) -> dict:
    """The one-step reward model with `overrides` on its recipe's rm section: its summary, training losses and
    held-out accuracy at each evaluation, kept as experiments/seed-N-NAME.json."""
    recipe, dataset = RECIPES["one step"]
    section = yaml.safe_load((ROOT / recipe).read_text())["rm"]
    out = work / f"rm-one-step-{name}"
    summary = rm_job(section, sft, dataset, out, seed, overrides=tuple(overrides))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {"date": today(), "machine": machine(), "seed": seed, "sft": sft,
              "what": f"{recipe}'s rm section on {dataset}, with these --set overrides",
              "changes": overrides, "summary": summary,
              "eval_accuracy": [[r["step"], r["eval_accuracy"]] for r in rows if "eval_accuracy" in r],
              "train_loss": [r["train/loss"] for r in rows if "train/loss" in r]}
    kept = RESULTS / "experiments" / f"seed-{seed}-{name}.json"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{name}: held-out accuracy on one-step pairs at steps "
          + ", ".join(f"{step}: {acc:.2f}" for step, acc in result["eval_accuracy"]) + f" (kept in {kept})")
    return result


def report(results: list[dict]) -> str:
    rows = ["| seed | reward model trained on | steps | minutes | held-out accuracy on its own pairs (start -> end) | "
            "held-out accuracy on the other pairs |", "|---:|---|---:|---:|---|---:|"]
    for r in results:
        for kind, t in r["trained"].items():
            other = next(k for k in RECIPES if k != kind)
            rows.append(f"| {r['seed']} | {kind} pairs ({RECIPES[kind][1]}) | {t['steps']} | "
                        f"{t['seconds'] / 60:.1f} | {t['eval_accuracy_first']:.2f} -> {t['eval_accuracy']:.2f} | "
                        f"{r['crossed'][kind]:.2f} on {other} pairs |")
    pairs = sorted({t["eval_pairs"] for r in results for t in r["trained"].values()})
    runs = "; ".join(f"seed {r['seed']}: {r['date']}, {r['machine']}" for r in results)
    return "\n".join([
        HEADING, "",
        f"Runs: {runs}. Versions: {versions('torch', 'ray', 'deepspeed', 'transformers')}.", "",
        "Command: `python benchmarks/bench_step_rm.py --sft SFT_MODEL --seed N --write benchmarks/HISTORY.md` (kept in "
        "benchmarks/results/step_rm/). Both reward models start from the same SFT model (the SFT stage of "
        "configs/recipes/smollm2-sft-grpo.yaml for that seed) and use their recipe's reward-model section "
        "(smollm2-pipeline.yaml: 16 steps of 8 pairs; smollm2-pipeline-steps.yaml: 40 steps). `final number` pairs: "
        "the rejected answer repeats the chosen one's steps and differs in its last number; `one step` pairs: one "
        "step's arithmetic is wrong and every later step and the answer agree with it. Accuracy: the share of the "
        f"held-out pairs ({', '.join(map(str, pairs))} per job: the RM jobs' evaluation split) whose chosen answer "
        "scores higher. On the other pairs: the first evaluation of a "
        "one-step reward-model job from the trained model on those pairs (before its step).", "", *rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft", help="the SFT model the reward models start from")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir")
    parser.add_argument("--experiment", metavar="NAME", help="run the one-step reward model with --set overrides")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="with --experiment: an override of the recipe's rm section (repeatable)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--write")
    args = parser.parse_args()
    if args.overrides and not args.experiment:
        parser.error("--set needs --experiment NAME (the recipe's own runs take no overrides)")
    if not args.report_only:
        if not args.sft:
            parser.error("--sft is required to run")
        work = Path(args.workdir or tempfile.mkdtemp(prefix="step-rm-"))
        work.mkdir(parents=True, exist_ok=True)
        if args.experiment:
            experiment(args.sft, args.seed, args.experiment, args.overrides, work)
            return 0
        measure(args.sft, args.seed, work)
    results = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("seed-*.json"))]
    if not results:
        print("no results yet")
        return 1
    text = report(results)
    print(text)
    if args.write:
        write_section(Path(args.write), HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
