"""What leaving out the reference saves in a run without a KL term (`reference: null` with `ppo.kl_coef: 0`).

Two SmolLM2 jobs on the bundled word problems, each run twice in a row in fresh processes (with the reference,
then without): GRPO without KL (configs/recipes/smollm2-grpo.yaml, ppo.kl_coef 0), where the reference's forward
is the whole experience step, and on-policy distillation (the PPO stage of configs/recipes/smollm2-distill.yaml,
the packaged SmolLM2 as its own teacher: the teacher's weights do not change what a forward costs), where the
reference runs beside the teacher's and the policy's forwards. Medians over the iterations after the first; the
rewards of each iteration are compared too (the same seed, and nothing the update reads differs).

Run: python benchmarks/bench_no_reference.py [--iterations 3] [--write benchmarks/HISTORY.md]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, publish, recipe_args, run_job, steady, today, versions  # noqa: E402

SECTION = "## Runs without a KL term: no reference"
GRPO = ROOT / "configs/recipes/smollm2-grpo.yaml"
DISTILL = ROOT / "configs/recipes/smollm2-distill.yaml"
GRPO_PROMPTS, DISTILL_PROMPTS = 4, 16  # half the recipes' rollouts: the same work per answer, half the minutes


def distill_stage(folder: Path) -> Path:
    """The distillation recipe's PPO stage as a job of its own, the student its own teacher."""
    recipe = yaml.safe_load(DISTILL.read_text())
    stage = {"kind": "ppo", "seed": recipe["seed"], "cluster": recipe["cluster"], **recipe["ppo"]}
    stage["teacher"]["model"] = {"gguf_file": "package:smollm2", "dtype": "fp32"}
    path = folder / "distill-ppo.yaml"
    path.write_text(yaml.safe_dump(stage, sort_keys=False))
    return path


def main() -> int:
    args = recipe_args(__doc__, iterations=3)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        jobs = {"GRPO, kl_coef 0": (GRPO, ["ppo.kl_coef=0", f"ppo.rollout_batch_size={GRPO_PROMPTS}"]),
                "on-policy distillation": (distill_stage(tmp), [f"ppo.rollout_batch_size={DISTILL_PROMPTS}"])}
        for name, (config, extra) in jobs.items():
            runs = {}
            for label, reference in (("with", []), ("without", ["reference=null"])):
                began = time.perf_counter()
                out = tmp / f"{name.split(',')[0].replace(' ', '-')}-{label}"
                _, metrics = run_job("ppo", config, [f"output_dir={out}", f"ppo.iterations={args.iterations}",
                                                     "ppo.eval_prompts=0", "ppo.eval_every=0",
                                                     "checkpoint.every_steps=0", *extra, *reference])
                print(f"{name} {label} the reference: {time.perf_counter() - began:.0f} s", flush=True)
                runs[label] = [m for m in metrics if "time/iteration" in m]
            rows.append((name, runs))
    return publish(render(rows, args.iterations), args.write, SECTION)


def render(rows: list, iterations: int) -> str:
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'vllm')}. Date: {today()}.", "",
             f"Command: `python benchmarks/bench_no_reference.py --iterations {iterations} --write benchmarks/HISTORY.md`. "
             "SmolLM2-135M fp32 on 2 cores, each job run with the reference and then with `reference: null`, "
             f"{iterations} iterations each, medians of iterations 2-{iterations}. GRPO: the smollm2-grpo recipe "
             f"with ppo.kl_coef 0 ({GRPO_PROMPTS} prompts x 4 answers per iteration); distillation: the smollm2-distill "
             f"recipe's PPO stage ({DISTILL_PROMPTS} answers per iteration, steps of 8), the packaged SmolLM2 as its "
             "own teacher.", "",
             "| job | reference | iteration s | experience step s | reference forward s | iteration ratio | "
             "same rewards |", "|---|---|---:|---:|---:|---:|---|"]
    for name, runs in rows:
        with_, without = runs["with"], runs["without"]
        same = [round(a["reward/mean"], 6) for a in with_] == [round(b["reward/mean"], 6) for b in without]
        for label, metrics in runs.items():
            reference = f"{steady(metrics, 'compute/reference_seconds'):.1f}" if label == "with" else "-"
            ratio = steady(metrics, "time/iteration") / steady(with_, "time/iteration")
            lines.append(f"| {name} | {label} | {steady(metrics, 'time/iteration'):.1f} | "
                         f"{steady(metrics, 'time/experience'):.1f} | {reference} | {ratio:.2f} | "
                         f"{'yes' if same else 'no'} |")
    lines += ["", "Iteration ratio: the run's median iteration over the same job's with the reference. Same "
              "rewards: every iteration's reward/mean equal in both runs (the sampled answers were the same)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
