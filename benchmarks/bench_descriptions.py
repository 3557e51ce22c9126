"""Does the learned-reward pipeline make a real model better by a truth its reward model never saw (issue 80)?
SmolLM2-135M-Instruct on `demo/descriptions` (configs/recipes/smollm2-descriptions.yaml): SFT -> pairs of the SFT
model's answers labelled by the gold score through a Bradley-Terry draw -> reward model -> PPO with a GAE critic
against it. The gold score is PPO's held-out check, never its reward.

    .venv/bin/python benchmarks/bench_descriptions.py --seeds 1,2,3 [--write docs/benchmarks.md]
    .venv/bin/python benchmarks/bench_descriptions.py --overoptimisation all,60,200 --seeds 1 [--iterations 30] [--kl 0]
        [--lr 3e-5] [--new-tokens 96]

The first runs the recipe as written, seed by seed (part 2: gold +0.15 over the SFT model, greedy and sampled, in
at most 30 minutes of PPO). The second (part 3, Gao et al. 2022 at our scale) trains reward models on the first N
of one seed's labelled training pairs (one epoch each) and runs PPO against each (the recipe's iterations, or
--iterations), evaluating every 3 iterations: the proxy (reward-model) score and the gold score of held-out answers against sqrt(KL to the SFT
policy). All runs of a seed share its SFT stage and its labelled pairs (copied in; the pipeline reuses them), so
a size below `all` needs the seed's all-pair run in the same --work (earlier in the list, or from before).

Each run's result is kept in benchmarks/results/descriptions/<name>.json with the hash of the settings it ran, so
a later invocation reports it while the recipe still holds those settings; --report-only runs nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, pyplot, run_watched, save_figure, settings_hash, today, write_section  # noqa: E402

RECIPE = ROOT / "configs/recipes/smollm2-descriptions.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "descriptions"
HEADING = "## A learned reward measured by a truth it never saw (SmolLM2-135M-Instruct, demo/descriptions)"
GOAL_GAIN, GOAL_MINUTES = 0.15, 30.0
RM_BATCH = 8  # the recipe's rm global batch


@dataclass(frozen=True)
class Run:
    """One pipeline run of a seed. All None: the recipe as written (part 2). Part 3 (Gao et al. at our scale): the
    reward model on the first `pairs` labelled pairs for one epoch, PPO for `iterations` at KL coefficient `kl`,
    policy learning rate `lr` and answers of up to `tokens` tokens (the recipe's where None)."""
    seed: int
    pairs: int | None = None
    iterations: int | None = None
    kl: float | None = None
    lr: float | None = None
    tokens: int | None = None

    @classmethod
    def of(cls, result: dict) -> "Run":
        return cls(result["seed"], *(result.get(k) for k in ("pairs", "iterations", "kl", "lr", "tokens")))

    @property
    def is_recipe(self) -> bool:
        return self == Run(self.seed)

    def overrides(self) -> list[str]:
        found = [] if self.kl is None else [f"ppo.ppo.kl_coef={self.kl}"]
        if self.pairs is not None:
            found += [f"pairs.prompts={self.pairs}", f"rm.train.max_steps={math.ceil(self.pairs / RM_BATCH)}"]
        if self.iterations is not None:
            found += [f"ppo.ppo.iterations={self.iterations}", "ppo.ppo.eval_every=3",
                      "ppo.checkpoint.every_steps=1000"]
        if self.lr is not None:
            found += [f"ppo.policy.optim.lr={self.lr}"]
        if self.tokens is not None:
            found += [f"ppo.generation.sampling.max_new_tokens={self.tokens}"]
        return found

    def settings(self) -> str:
        return settings_hash(RECIPE.read_text(), self.overrides())

    @property
    def name(self) -> str:
        """seed1: the recipe as written; pairs60-seed1: its reward model on 60 pairs; pairs60-it30-kl0-seed1: and PPO
        for 30 iterations at KL coefficient 0; ...-lr3e-05-tok96-seed1: at policy lr 3e-5 with 96-token answers."""
        parts = [f"pairs{self.pairs}"] if self.pairs is not None else []
        parts += [f"it{self.iterations}"] if self.iterations is not None else []
        parts += [f"kl{self.kl:g}"] if self.kl is not None else []
        parts += [f"lr{self.lr:g}"] if self.lr is not None else []
        parts += [f"tok{self.tokens}"] if self.tokens is not None else []
        return "-".join([*parts, f"seed{self.seed}"])


def share_stages(run: Run, work: Path, out: Path) -> None:
    """Copy the seed's finished SFT stage and its labelled pairs (the first `run.pairs` training pairs of them, every
    held-out pair) from an earlier run of the seed on all the pairs (the recipe's own, else a part-3 run on all the
    pairs), so the runs differ only where they mean to."""
    donors = [work / Run(run.seed).name, *sorted(work.glob(f"*it*-seed{run.seed}"))]
    donors = [d for d in donors if d != out and not d.name.startswith("pairs") and (d / "sft" / "summary.json").is_file()
              and (d / "rm" / "pairs" / "eval.jsonl").is_file()]
    if not donors:
        if run.pairs is not None:  # alone, the pipeline would label the first N prompts' pairs: fewer, other pairs
            raise SystemExit(f"{run.name}: no finished run of seed {run.seed} on all the pairs in {work} to take "
                             "the first pairs from; run `--overoptimisation all,...` for the seed in this --work")
        return
    donor = donors[0]
    if not (out / "sft").exists():
        shutil.copytree(donor / "sft", out / "sft", ignore=shutil.ignore_patterns("checkpoints"))
    source, target = donor / "rm" / "pairs", out / "rm" / "pairs"
    if not target.exists():
        target.mkdir(parents=True)
        train = source.joinpath("train.jsonl").read_text().splitlines()
        kept = train if run.pairs is None else train[:run.pairs]
        target.joinpath("train.jsonl").write_text("".join(line + "\n" for line in kept))
        shutil.copy(source / "eval.jsonl", target / "eval.jsonl")
        facts = json.loads((source / "pairs.json").read_text()) | {"train": len(kept)}
        target.joinpath("pairs.json").write_text(json.dumps(facts, indent=2))


def run(spec: Run, work: Path) -> dict:
    out = work / spec.name
    share_stages(spec, work, out)
    overrides = [f"seed={spec.seed}", f"output_dir={out}", "cluster.dashboard=false", "logging.progress=false",
                 *spec.overrides()]
    command = [sys.executable, "-m", "rlhf_ray.cli", "pipeline", "--config", str(RECIPE)]
    for item in overrides:
        command += ["--set", item]
    seconds, peak = run_watched(command, work / f"{out.name}.log", timeout=4 * 3600)
    summary = json.loads((out / "summary.json").read_text())
    # a rerun reuses the stages an earlier run finished: their time counts as if run now
    seconds += sum(part.get("seconds", 0) for part in summary.values() if isinstance(part, dict) and part.get("reused"))
    metrics = [json.loads(line) for line in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    result = {"summary": summary, "metrics": metrics, "seconds": seconds, "peak_gib": peak, **asdict(spec),
              "settings": spec.settings(), "date": today(), "machine": machine()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out.name}.json").write_text(json.dumps(result) + "\n")
    for folder in out.glob("*/checkpoints"):
        shutil.rmtree(folder, ignore_errors=True)
    return result


def kept() -> list[dict]:
    found = []
    for file in sorted(RESULTS.glob("*.json")):
        r = json.loads(file.read_text())
        if r["settings"] == Run.of(r).settings():
            found.append(r)
        else:
            print(f"not reported: {file} ran other settings than {RECIPE.name} holds now", flush=True)
    return found


def ppo_minutes(r: dict) -> float:
    return sum(row["time/iteration"] for row in r["metrics"] if "time/iteration" in row) / 60


def curve(r: dict) -> list[tuple[int, float, float, float, float, float]]:
    """Per held-out evaluation: (iteration, sqrt(KL), proxy greedy, gold greedy, proxy sampled, gold sampled, its
    standard error over the prompts).
    KL: the iteration's rollouts' mean per-token KL to the SFT policy times their mean answer length (a sequence's
    KL in nats; 0 before training)."""
    by_step = {row["step"]: row for row in r["metrics"] if "kl/mean" in row}
    points = []
    for row in r["metrics"]:
        if "eval/reward" not in row:
            continue
        step = row["step"]
        train = by_step.get(step)
        kl = 0.0 if train is None else max(0.0, train["kl/mean"] * train["answer/length"])
        points.append((step, math.sqrt(kl), row["eval/reward"], row["eval/task_accuracy"],
                       row.get("eval/sampled_reward", float("nan")), row.get("eval/sampled_task_accuracy", float("nan")),
                       row.get("eval/sampled_task_accuracy_se", float("nan"))))
    return points


def setting(r: dict) -> tuple:
    """A part-3 run's PPO settings, pairs and seed aside: runs that share them differ only in their reward model."""
    return tuple(r.get(k) for k in ("iterations", "kl", "lr", "tokens"))


def mean_se(values: list[float]) -> str:
    """Mean ± one standard error over seeds (the mean alone for one)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return f"{m:.3f}"
    se = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values))
    return f"{m:.3f} ± {se:.3f}"


def by_size(runs: list[dict]) -> list[str]:
    """Part 3 over seeds, one row per reward-model size: the sampled gold score's peak along the run, where it
    peaked, how far it fell from there by the end, and what the proxy did meanwhile (from the gold's peak to the
    end); a row per size with the seeds it has."""
    sizes = sorted({r["pairs"] or 10**9 for r in runs})
    peaks: list[tuple[str, float]] = []
    lines = ["| training pairs | seeds | RM held-out accuracy | gold sampled at the start | gold sampled peak | "
             "sqrt(KL) at the peak | gold sampled at the end | fall from the peak | proxy sampled, from the gold's peak "
             "to the end | runs whose gold fell by over a standard error while the proxy rose |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        group = sorted((r for r in runs if (r["pairs"] or 10**9) == size), key=lambda r: r["seed"])
        rows, bars = [], []
        for r in group:
            points = curve(r)
            peak = max(points, key=lambda q: q[5])
            rows.append((r["summary"]["rm"]["eval_accuracy"], points[0][5], peak[5], peak[1], points[-1][5],
                         peak[5] - points[-1][5], points[-1][4] - peak[4]))
            bars.append(math.hypot(peak[6], points[-1][6]))
        label = "all" if size == 10**9 else str(size)
        cols = list(zip(*rows))
        fell = sum(fall > bar and rise > 0 for fall, rise, bar in zip(cols[-2], cols[-1], bars))
        lines.append(f"| {label} | {', '.join(str(r['seed']) for r in group)} | " +
                     " | ".join(mean_se(list(c)) for c in cols[:-1]) + f" | {sum(cols[-1]) / len(cols[-1]):+.3f} | "
                     f"{fell} of {len(group)} |")
        peaks.append((label, sum(cols[2]) / len(cols[2])))
    rising = all(a[1] < b[1] for a, b in zip(peaks, peaks[1:]))
    lines += ["", f"- The gold score's peak {'rises' if rising else 'does not rise'} with the reward model's pairs: "
              + ", ".join(f"{label} pairs {peak:.3f}" for label, peak in peaks) + " (means over the seeds)."]
    return lines


def report(results: list[dict], doc: Path | None) -> str:
    dates = sorted({r["date"] for r in results})
    machines = {}
    for r in results:
        machines.setdefault(r["machine"], []).append(Run.of(r).name)
    where = "; ".join(f"{m} ({', '.join(names)})" for m, names in machines.items()) if len(machines) > 1 \
        else next(iter(machines))
    lines = [HEADING, "",
             f"Measured {' to '.join(dict.fromkeys([dates[0], dates[-1]]))} on {where} by `benchmarks/bench_descriptions.py` (results kept in "
             "benchmarks/results/descriptions/). The gold score (`rlhf_ray.data.descriptions:gold`, docs/jobs.md "
             "\"Preference pairs with a hidden truth\") is evaluated on 100 held-out prompts about topics no stage "
             "trained on; `before` is the SFT model. ± is one standard error over the prompts.", ""]
    recipe = sorted((r for r in results if Run.of(r).is_recipe), key=lambda r: r["seed"])
    if recipe:
        lines += ["| seed | pairs (train / held-out / ties) | RM held-out accuracy (ceiling) | gold greedy before -> "
                  "after | gold sampled before -> after | RM score greedy before -> after | PPO iterations min | PPO stage min | "
                  "total min |",
                  "|---:|---|---|---|---|---|---:|---:|---:|"]
        verdicts = []
        for r in recipe:
            s, ppo = r["summary"], r["summary"]["ppo"]
            p = s["rm"].get("pairs", {})
            g0, g1 = ppo["task_accuracy_before"], ppo["task_accuracy_after"]
            s0, s1 = ppo["sampled_task_accuracy_before"], ppo["sampled_task_accuracy_after"]
            lines.append(f"| {r['seed']} | {p.get('train')} / {p.get('eval')} / {p.get('ties')} | "
                         f"{s['rm']['eval_accuracy']:.3f} ({p.get('gold_eval_accuracy', float('nan')):.3f}) | "
                         f"{g0:.3f} ± {ppo['task_accuracy_se_before']:.3f} -> {g1:.3f} ± "
                         f"{ppo['task_accuracy_se_after']:.3f} | {s0:.3f} -> {s1:.3f} | "
                         f"{ppo['reward_before']:.2f} -> {ppo['reward_after']:.2f} | {ppo_minutes(r):.1f} | "
                         f"{ppo['seconds'] / 60:.1f} | {r['seconds'] / 60:.1f} |")
            met = g1 - g0 >= GOAL_GAIN and s1 - s0 >= GOAL_GAIN and ppo["seconds"] / 60 <= GOAL_MINUTES
            verdicts.append(f"- seed {r['seed']}: gold {g1 - g0:+.3f} greedy, {s1 - s0:+.3f} sampled in a PPO stage "
                            f"of {ppo['seconds'] / 60:.1f} minutes ({ppo_minutes(r):.1f} of them iterations, the rest "
                            f"start-up and held-out evaluations): {'met' if met else 'missed'} (goal: +{GOAL_GAIN} "
                            f"greedy and sampled within {GOAL_MINUTES:.0f} min).")
        if len(recipe) < 3:
            verdicts.append(f"- {len(recipe)} of 3 seeds run.")
        lines += ["", *verdicts, ""]
    gao = sorted((r for r in results if r not in recipe), key=lambda r: (r["seed"], r["pairs"] or 0, r.get("kl") or 0))
    per_run = []
    if gao:
        per_run += ["Reward models on fewer pairs (part 3), each against its own PPO run from the same SFT model; the "
                  "sampled gold score's peak over the evaluations, and how far it fell from there by the end while "
                  "the sampled proxy moved as the last column says:", "",
                  "| run | training pairs | RM held-out accuracy (ceiling) | gold greedy before -> after | "
                  "proxy greedy before -> after | sqrt(KL) at the end | gold sampled: peak (sqrt(KL)) -> end | "
                  "proxy sampled from the gold's peak to the end |", "|---|---:|---|---|---|---:|---|---|"]
        for r in [*recipe[:1], *gao]:
            s, ppo = r["summary"], r["summary"]["ppo"]
            p = s["rm"].get("pairs", {})
            points = curve(r)
            peak = max(points, key=lambda q: q[5])
            end = points[-1]
            per_run.append(f"| {Run.of(r).name} | "
                         f"{r['pairs'] or p.get('train')} | "
                         f"{s['rm']['eval_accuracy']:.3f} ({p.get('gold_eval_accuracy', float('nan')):.3f}) | "
                         f"{ppo['task_accuracy_before']:.3f} -> {ppo['task_accuracy_after']:.3f} | "
                         f"{ppo['reward_before']:.2f} -> {ppo['reward_after']:.2f} | {end[1]:.2f} | "
                         f"{peak[5]:.3f} ({peak[1]:.2f}) -> {end[5]:.3f} | {peak[4]:.2f} -> {end[4]:.2f} |")
        per_run.append("")
    main = max({setting(r) for r in gao}, key=lambda k: sum(setting(r) == k for r in gao)) if gao else None
    part3 = [r for r in gao if setting(r) == main]
    if part3:
        iterations, kl, lr, tokens = main
        lines += [f"Part 3 over seeds: PPO for {iterations} iterations at KL coefficient {kl:g}, policy learning rate "
                  f"{lr:g}, answers of up to {tokens} tokens, against reward models on the first N labelled pairs "
                  "of each seed (mean ± one standard error over the seeds; the fall is the peak minus the end; a run's fall "
                  "counts in the last column where it exceeds the standard error of the difference, the two "
                  "evaluations' standard errors over the prompts taken as independent: a rough bar):", "",
                  *by_size(part3), ""]
    curves = [(r, curve(r)) for r in (recipe + gao)]
    plotted = [(r, points) for r, points in curves if r in part3]
    if plotted and doc is not None:  # part 3's main setting: a colour per reward-model size, a marker per seed
        plt = pyplot()
        fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
        sizes = sorted({r["pairs"] or 10**9 for r, _ in plotted})
        colours = dict(zip(sizes, ("tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple")))
        markers = dict(zip(sorted({r["seed"] for r, _ in plotted}), "osD^v"))
        for r, points in plotted:
            size = r["pairs"] or 10**9
            label = f"{'all' if size == 10**9 else size} pairs, seed {r['seed']}"
            xs = [p[1] for p in points]
            style = {"color": colours.get(size), "marker": markers[r["seed"]], "label": label}
            for row, (proxy, gold) in enumerate(((2, 3), (4, 5))):
                axes[row][0].plot(xs, [p[proxy] - points[0][proxy] for p in points], **style)
                axes[row][1].plot(xs, [p[gold] for p in points], **style)
        for row, how in enumerate(("greedy", "sampled at T = 1")):
            axes[row][0].set(title=f"proxy: reward-model score - its start ({how}, held-out)")
            axes[row][1].set(title=f"gold score ({how}, held-out)")
        for ax in axes[1]:
            ax.set(xlabel="sqrt(KL to the SFT policy, nats)")
        for ax in axes.flat:
            ax.legend(fontsize=7)
        lines += [save_figure(fig, doc, "descriptions_overoptimisation.png"), ""]
    if curves:
        per_evaluation = ["# Every kept run and its held-out evaluations", "",
                          "Written by `benchmarks/bench_descriptions.py` beside its section in docs/benchmarks.md.", "",
                          *per_run, "Per evaluation: iteration: sqrt(KL), proxy greedy, gold greedy, proxy sampled, "
                          "gold sampled.", ""]
        for r, points in curves:
            per_evaluation.append(f"- {Run.of(r).name}: " + "; ".join(
                f"{p[0]}: {p[1]:.2f}, {p[2]:.2f}, {p[3]:.3f}, {p[4]:.2f}, {p[5]:.3f}" for p in points))
        if doc is not None:
            (RESULTS / "curves.md").write_text("\n".join(per_evaluation) + "\n")
            lines += ["Every run's own row (reward model, gold and proxy before and after, the gold's peak) and every "
                      "evaluation's numbers: [benchmarks/results/descriptions/curves.md]"
                      "(../benchmarks/results/descriptions/curves.md).", ""]
        else:
            lines += [*per_evaluation[4:], ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--overoptimisation", default=None,
                        help="pair counts, e.g. all,60,200 (part 3; 'all': every labelled pair, the recipe's reward "
                             "model; name it first, the others take the first N of its pairs)")
    parser.add_argument("--iterations", type=int, default=None, help="PPO iterations of the part-3 runs")
    parser.add_argument("--kl", type=float, default=None, help="KL coefficient of the part-3 runs (recipe's: 0.02)")
    parser.add_argument("--lr", type=float, default=None, help="policy learning rate of the part-3 runs (recipe's: 1e-5)")
    parser.add_argument("--new-tokens", type=int, default=None, help="answer length of the part-3 runs (recipe's: 64)")
    parser.add_argument("--work", default=None, help="where the runs write (default: a temporary folder)")
    parser.add_argument("--write", default=None, help="docs/benchmarks.md: replace this section there")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-descriptions-"))
    if not args.report_only:
        for seed in map(int, args.seeds.split(",")):
            if args.overoptimisation is None:
                run(Run(seed), work)
                continue
            for size in args.overoptimisation.split(","):
                run(Run(seed, None if size == "all" else int(size), args.iterations, args.kl, args.lr,
                        args.new_tokens), work)
    results = kept()
    if not results:
        print("no kept results")
        return 1
    doc = Path(args.write) if args.write else None
    text = report(results, doc)
    print(text)
    if doc is not None:
        write_section(doc, HEADING, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
