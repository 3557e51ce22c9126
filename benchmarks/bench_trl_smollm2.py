"""TRL's GRPOTrainer and rlhf-ray's GRPO recipe side by side on a real model, in one run on one machine:
SmolLM2-135M-Instruct on demo/word-problems, the same prompts per step, samples per prompt, answer length,
learning rate, KL coefficient (k3, in the loss), reward (the last-number checker against each problem's `answer`
column) and number of steps; fp32 on both sides. Reports time per step split into generation / experience /
training / sync (TRL: generation = its `generate` call, the rest of the step = scoring + training), samples per
second, peak memory of each process tree, and held-out greedy accuracy of both final models, scored by one
evaluator (vLLM greedy, the rule).

Needs the bench extra: RLHF_RAY_EXTRAS=cpu,test,smollm2,bench bash scripts/setup.sh
Run: python benchmarks/bench_trl_smollm2.py [--write docs/benchmarks.md] [--steps 10] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ROOT, greedy_accuracy, machine, pyplot, run_watched, save_figure, steady, today,  # noqa: E402
                    trl_step_timer, versions, write_section)

SECTION = "## GRPO against TRL on SmolLM2-135M-Instruct"
RECIPE = ROOT / "configs/recipes/smollm2-grpo.yaml"
PROMPTS, SAMPLES, LR, KL, EVAL = 8, 4, 1e-5, 0.04, 200
VARIANTS = [("ours", "rlhf-ray", []),  # (run name, table label, overrides on top of the recipe)
            ("ours-packed", "rlhf-ray, packed", ["policy.pack_sequences=true", "reference.pack_sequences=true"])]


def trl_child(model_dir: str, rows_file: str, steps: int, new_tokens: int, out: str) -> dict:
    """One TRL GRPOTrainer run in this process: per-step wall times and generation times; saves the final model."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_ray.data.answers import last_number_reward

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rows = json.loads(Path(rows_file).read_text())

    def reward(prompts, completions, answer, **_):
        return last_number_reward(prompts, completions, answer=answer)

    marks: list[float] = []
    generate: list[float] = []

    config = GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES,
                        max_completion_length=new_tokens, learning_rate=LR, beta=KL, max_steps=steps,
                        num_iterations=1, temperature=1.0, use_cpu=True, bf16=False, gradient_checkpointing=False,
                        logging_steps=1, report_to="none", save_strategy="no", seed=1, disable_dropout=True,
                        dataloader_num_workers=0, lr_scheduler_type="constant", weight_decay=0.0)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          callbacks=[trl_step_timer(marks)])
    unwrapped = trainer.model
    original = unwrapped.generate

    def timed_generate(*a, **k):
        start = time.perf_counter()
        result = original(*a, **k)
        generate.append(time.perf_counter() - start)
        return result

    unwrapped.generate = timed_generate
    trainer.train()
    trainer.save_model(str(Path(out) / "model"))
    import trl

    return {"step_seconds": [b - a for a, b in zip(marks, marks[1:])], "generate_seconds": generate,
            "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
            "kl": [h["kl"] for h in trainer.state.log_history if "kl" in h], "trl": trl.__version__}


def plot(trl: dict, runs: dict, before: float, trl_after: float, doc: Path) -> str:
    """Reward and KL per step for TRL and each of our runs, and held-out greedy accuracy before and after."""
    plt = pyplot()
    if plt is None:
        return "(matplotlib missing: no plot)"
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    steps = range(1, len(trl["rewards"]) + 1)
    axes[0].plot(steps, trl["rewards"], "o-", label="TRL GRPOTrainer")
    axes[1].plot(range(1, len(trl["kl"]) + 1), trl["kl"], "o-")
    axes[2].plot([0, len(trl["rewards"])], [before, trl_after], "o-")
    for label, run in runs.items():
        rows = [r for r in run["metrics"] if "reward/mean" in r]
        axes[0].plot(range(1, len(rows) + 1), [r["reward/mean"] for r in rows], "s-", label=label)
        axes[1].plot(range(1, len(rows) + 1), [r["kl/mean"] for r in rows], "s-")
        axes[2].plot([0, len(rows)], [before, run["after"]], "s-")
    titles = ["rollout reward (share right)", "KL to the reference (k3, token mean)",
              f"held-out greedy accuracy ({EVAL} problems)"]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    return save_figure(fig, doc, "grpo_vs_trl_smollm2.png")


def run_measured(command: list[str], log: Path, env: dict | None = None) -> tuple[str, float, float]:
    """Run a command, polling its process tree's PSS; (stdout's last JSON line or '', wall s, peak GiB)."""
    stdout = log.with_suffix(".out")
    wall, peak = run_watched(command, log, env=env, stdout=stdout)
    lines = [line for line in stdout.read_text().splitlines() if line.startswith("{")]
    return (lines[-1] if lines else ""), wall, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--eval-child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench_trl_smollm2",
                        help="kept after the run: logs, both final models, and the finished parts' results (reused "
                             "by a rerun with the same settings)")
    args = parser.parse_args()
    if args.child:
        model_dir, rows_file, steps, new_tokens, out = args.child
        print(json.dumps(trl_child(model_dir, rows_file, int(steps), int(new_tokens), out)))
        return 0
    if args.eval_child:
        model_dir, tokenizer, rows_file, new_tokens = args.eval_child
        rows = json.loads(Path(rows_file).read_text())
        print(json.dumps({"accuracy": greedy_accuracy(model_dir, tokenizer, rows, int(new_tokens))}))
        return 0

    from rlhf_ray.config import load_job
    from rlhf_ray.data.build import build_phase_data
    from rlhf_ray.data.tokens import TokenConventions
    from rlhf_ray.models.loading import load_tokenizer
    from rlhf_ray.models.sources import resolve_model_sources

    tmp = args.workdir / f"steps{args.steps}-tokens{args.new_tokens}"
    tmp.mkdir(parents=True, exist_ok=True)
    job = resolve_model_sources(load_job(RECIPE, [f"output_dir={tmp / 'ours'}"]))
    model = job.policy.model.path
    tokenizer = load_tokenizer(job.policy.model)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, tmp / "cache",
                            tokens=TokenConventions.from_tokenizer(tokenizer, model))

    def rows(split):  # the chat-rendered prompt text (as our engines see it) and the truth
        return [{"prompt": tokenizer.decode(r["prompt_ids"]), "answer": r["columns"]["answer"]} for r in split]

    train_file, eval_file = tmp / "train.json", tmp / "eval.json"
    train_file.write_text(json.dumps(rows(data.train[: PROMPTS * args.steps])))
    eval_file.write_text(json.dumps(rows(data.eval[:EVAL])))

    def evaluate(model_dir, name) -> float:
        line, _, _ = run_measured([sys.executable, __file__, "--eval-child", str(model_dir), model,
                                   str(eval_file), str(args.new_tokens)], tmp / f"eval-{name}.log")
        return json.loads(line)["accuracy"]

    def cached(name, compute):  # a finished part's result is kept, so a failure later costs only the rest
        file = tmp / f"{name}.json"
        if not file.exists():
            file.write_text(json.dumps(compute()))
        return json.loads(file.read_text())

    before = cached("before", lambda: evaluate(model, "before"))
    print(f"held-out greedy accuracy before: {before:.3f}", flush=True)

    def run_trl():
        line, wall, peak = run_measured([sys.executable, __file__, "--child", model, str(train_file),
                                         str(args.steps), str(args.new_tokens), str(tmp / "trl")],
                                        tmp / "trl.log")
        return {**json.loads(line), "wall": wall, "peak": peak}

    trl = cached("trl", run_trl)
    if "kl" not in trl:  # kept by a version of this script that did not record TRL's KL
        (tmp / "trl.json").unlink()
        trl = cached("trl", run_trl)
    trl_after = cached("trl_after", lambda: evaluate(tmp / "trl" / "model", "trl"))
    print(f"trl: {trl['wall']:.0f} s, after {trl_after:.3f}", flush=True)

    overrides = [f"ppo.iterations={args.steps}", f"ppo.rollout_batch_size={PROMPTS}",
                 f"generation.sampling.n_samples_per_prompt={SAMPLES}", f"policy.optim.lr={LR}",
                 f"ppo.kl_coef={KL}", f"generation.sampling.max_new_tokens={args.new_tokens}",
                 "ppo.eval_prompts=0", "checkpoint.every_steps=0", "checkpoint.resume=false", "cluster.dashboard=false",
                 "logging.progress=false", "logging.tensorboard=false"]
    def run_ours(name: str, extra: list[str]) -> dict:
        command = [sys.executable, "-m", "rlhf_ray.cli", "ppo", "--config", str(RECIPE)]
        for item in overrides + [f"output_dir={tmp / name}"] + extra:
            command += ["--set", item]
        (tmp / name / "metrics.jsonl").unlink(missing_ok=True)
        _, wall, peak = run_measured(command, tmp / f"{name}.log")
        return {"wall": wall, "peak": peak,
                "metrics": [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]}

    runs = {}  # our recipe as written, and with every training forward packed (no padding computed)
    for name, label, extra in VARIANTS:
        run = cached(name, lambda: run_ours(name, extra))
        run["after"] = cached(f"{name}_after", lambda: evaluate(tmp / name / "model", name))
        runs[label] = run
        print(f"{label}: {run['wall']:.0f} s, after {run['after']:.3f}", flush=True)

    trl_step = statistics.median(trl["step_seconds"][1:])
    trl_gen = statistics.median(trl["generate_seconds"][1:]) if len(trl["generate_seconds"]) > 1 else float("nan")
    keys = ("time/iteration", "time/engine_generate", "time/experience", "time/train", "time/sync",
            "policy/padding_fraction")
    ours = {label: {k: steady(run["metrics"], k) for k in keys} for label, run in runs.items()}
    samples = PROMPTS * SAMPLES
    ratios = {label: trl_step / t["time/iteration"] for label, t in ours.items()}
    best = max(ratios, key=ratios.get)
    lines = [SECTION, "",
             f"Measured {today()} by `python benchmarks/bench_trl_smollm2.py --steps {args.steps} --new-tokens "
             f"{args.new_tokens}` on {machine()}; {versions('torch', 'ray', 'transformers', 'trl', 'vllm')}.", "",
             f"Per step on both sides: {PROMPTS} demo/word-problems prompts (chat template) x {SAMPLES} answers of up "
             f"to {args.new_tokens} tokens at temperature 1, the last-number checker against each problem's `answer` "
             f"column, KL {KL} to the reference (k3, in the loss), one optimizer step at lr {LR} (constant, no weight "
             f"decay), fp32, {args.steps} steps; times are medians of steps 2-{args.steps}. TRL: GRPOTrainer in one "
             "process, transformers `generate`, torch on every core. rlhf-ray: `configs/recipes/smollm2-grpo.yaml` "
             "(vLLM engine, policy, reference and reward-function actors on an embedded Ray, sync mode), as written "
             "and with `pack_sequences: true` on the policy and the reference (each micro-batch one row of its real "
             "tokens). The three runs follow each other in one invocation. Held-out: greedy accuracy on "
             f"{EVAL} held-out problems, every model scored by the same vLLM greedy evaluator.", "",
             "| | s/step | generation s | experience s | training s | sync s | policy padding | samples/s | "
             "TRL / ours | peak GiB | held-out greedy before -> after |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
             f"| TRL GRPOTrainer {trl['trl']} | {trl_step:.1f} | {trl_gen:.1f} | {trl_step - trl_gen:.1f} "
             f"(scoring + training) | | | | {samples / trl_step:.2f} | 1.00x | {trl['peak']:.1f} | "
             f"{before:.3f} -> {trl_after:.3f} |"]
    for label, t in ours.items():
        lines.append(f"| {label} | {t['time/iteration']:.1f} | {t['time/engine_generate']:.1f} | "
                     f"{t['time/experience']:.1f} | {t['time/train']:.1f} | {t['time/sync']:.1f} | "
                     f"{t['policy/padding_fraction']:.0%} | {samples / t['time/iteration']:.2f} | "
                     f"{ratios[label]:.2f}x | {runs[label]['peak']:.1f} | {before:.3f} -> {runs[label]['after']:.3f} |")
    t = ours[best]
    ended = steady(runs[best]["metrics"], "answer/ended")
    lines += ["",
              f"Goal (issue 38): 2x TRL's samples per second on this work: {ratios[best]:.2f}x at best ({best}; "
              f"{'met' if ratios[best] >= 2 else 'missed'}). Held-out accuracy after the same steps equal or better: "
              + ", ".join(f"{label} {runs[label]['after']:.3f}" for label in runs) + f" vs TRL {trl_after:.3f}.", "",
              f"Where the time goes ({best}): generation {t['time/engine_generate']:.1f} s (vLLM) against TRL's "
              f"{trl_gen:.1f} s (`generate`); the reference forward {t['time/experience']:.1f} s and the policy's "
              f"forward and backward {t['time/train']:.1f} s, together "
              f"{t['time/experience'] + t['time/train']:.1f} s against TRL's {trl_step - trl_gen:.1f} s of scoring "
              f"and training. Held-out accuracy moves by a few of {EVAL} problems in {args.steps} steps on every side "
              "(noise at this scale: the starting model answers few of these problems right" + (
                  f", and at {args.new_tokens} new tokens {1 - ended:.0%} of the answers stop before their final "
                  "number, so most rollouts score 0: the workload measures speed, not learning)." if ended < 0.5
                  else ")."), ""]
    text = "\n".join(lines)
    print(text)
    print(json.dumps({"trl": trl, "ours": ours}))
    if args.write:
        text += "\n" + plot(trl, runs, before, trl_after, args.write) + "\n"
        write_section(args.write, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
