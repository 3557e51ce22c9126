"""GRPO against TRL, learning per sample and time (issue 80, part 5): TRL's GRPOTrainer and rlhf-ray's quickstart
(configs/quickstart/grpo.yaml: SmolLM2-135M-Instruct learning two-number sums and differences, the last-number rule
as the reward) with the same model, training prompts, group size, temperature, answer length, learning rate and
schedule, Adam settings, gradient clipping, KL coefficient (k3, in the loss), loss averaging (token mean over the
batch: TRL's `dapo`, our `token_mean`), number of samples per step and number of steps, on several seeds. Held-out
greedy accuracy every few steps: ours by the job's own evaluation (vLLM, greedy, the rule on `ppo.eval_prompts`
held-out prompts), TRL's by the same vLLM greedy evaluator on its saved models (the starting model is scored by
both, a check that the two evaluators agree). Time: the steps' own wall time (evaluations and saves left out).

Our side is the quickstart as a user runs it, changed only where the comparison needs it: answers of up to 64
tokens (long enough to finish), ZeRO-2 (the default) instead of the quickstart's stage 0, the seed, the steps and
how often to evaluate.

Needs the bench extra: RLHF_RAY_EXTRAS=cpu,test,smollm2,bench bash scripts/setup.sh
Run: python benchmarks/bench_trl_smollm2.py --seeds 1,2,3 [--steps 10] [--eval-every 2] [--write docs/benchmarks.md]
Results are kept per seed and side in benchmarks/results/trl_grpo/ with the hash of the settings they ran; a later
invocation reports the ones that still match (--report-only runs nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ROOT, greedy_accuracy, machine, pyplot, run_watched, save_figure, settings_hash, today,  # noqa: E402
                    versions, write_section)

SECTION = "## GRPO against TRL on SmolLM2-135M-Instruct"
CONFIG = ROOT / "configs/quickstart/grpo.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "trl_grpo"
NEW_TOKENS = 64
CHANGED = [f"generation.sampling.max_new_tokens={NEW_TOKENS}", "policy.deepspeed.zero_stage=2"]
QUIET = ["cluster.dashboard=false", "logging.progress=false", "logging.tensorboard=false", "checkpoint.resume=false"]


def overrides(seed: int, steps: int, every: int) -> list[str]:
    """What a run changes in the quickstart (the settings hash covers these)."""
    return [*CHANGED, f"seed={seed}", f"ppo.iterations={steps}", f"ppo.eval_every={every}"]


def trl_child(spec: dict) -> dict:
    """One TRL GRPOTrainer run in this process, configured as our job is (spec): the steps' wall and generation
    seconds, rewards and KL per step; the policy saved after every `every`-th step and the last."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_ray.data.answers import last_number_reward

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rows = json.loads(Path(spec["rows"]).read_text())
    out, steps, every = Path(spec["out"]), spec["steps"], spec["every"]

    def reward(prompts, completions, answer, **_):
        return last_number_reward(prompts, completions, answer=answer)

    seconds: list[float] = []
    generate: list[float] = []

    class StepsAndSaves(TrainerCallback):  # a step's time is begin to end; the save after it is not in it
        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            seconds.append(time.perf_counter() - self.began)
            if state.global_step % every == 0 or state.global_step == steps:
                model.save_pretrained(out / f"step-{state.global_step}")

    config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=spec["prompts"] * spec["samples"],
                        num_generations=spec["samples"], max_completion_length=spec["new_tokens"],
                        temperature=spec["temperature"], learning_rate=spec["lr"], lr_scheduler_type=spec["scheduler"],
                        warmup_steps=spec["warmup"], weight_decay=spec["weight_decay"], adam_beta1=spec["betas"][0],
                        adam_beta2=spec["betas"][1], adam_epsilon=spec["eps"], max_grad_norm=spec["clip"],
                        beta=spec["kl"], epsilon=spec["clip_ratio"], loss_type="dapo", scale_rewards="group",
                        max_steps=steps, num_iterations=1, seed=spec["seed"], use_cpu=True, bf16=False,
                        gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
                        disable_dropout=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(rows), callbacks=[StepsAndSaves()])
    original = trainer.model.generate

    def timed_generate(*a, **k):
        start = time.perf_counter()
        result = original(*a, **k)
        generate.append(time.perf_counter() - start)
        return result

    trainer.model.generate = timed_generate
    trainer.train()
    import trl

    history = trainer.state.log_history
    return {"seconds": seconds, "generate": generate, "rewards": [h["reward"] for h in history if "reward" in h],
            "kl": [h["kl"] for h in history if "kl" in h], "trl": trl.__version__}


def last_json(stdout: Path) -> dict:
    lines = [line for line in stdout.read_text().splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"no result line in {stdout}")
    return json.loads(lines[-1])


def prepare(seed: int, work: Path) -> tuple[dict, Path, Path]:
    """Our job's settings as TRL needs them, and its training and held-out prompts as text (the chat-rendered
    prompt our engines see) with their truths, written for the children."""
    from rlhf_ray.config import load_job
    from rlhf_ray.data.build import build_phase_data
    from rlhf_ray.data.tokens import TokenConventions
    from rlhf_ray.models.loading import load_tokenizer
    from rlhf_ray.models.sources import resolve_model_sources

    job = resolve_model_sources(load_job(CONFIG, [*CHANGED, f"seed={seed}", f"output_dir={work / 'unused'}"]))
    tokenizer = load_tokenizer(job.policy.model)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, work / "cache",
                            tokens=TokenConventions.from_tokenizer(tokenizer, job.policy.model.path))

    def rows(split):
        return [{"prompt": tokenizer.decode(r["prompt_ids"]), "answer": r["columns"]["answer"]} for r in split]

    train_file, eval_file = work / "train.json", work / "eval.json"
    train_file.write_text(json.dumps(rows(data.train)))
    eval_file.write_text(json.dumps(rows(data.eval[: job.ppo.eval_prompts])))
    optim, sampling, ppo = job.policy.optim, job.generation.sampling, job.ppo
    spec = {"model": job.policy.model.path, "prompts": ppo.rollout_batch_size, "samples": sampling.n_samples_per_prompt,
            "new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "lr": optim.lr,
            "scheduler": optim.lr_scheduler, "warmup": optim.warmup_steps, "weight_decay": optim.weight_decay,
            "betas": list(optim.betas), "eps": optim.eps, "clip": job.policy.deepspeed.gradient_clipping,
            "kl": ppo.kl_coef, "clip_ratio": ppo.clip_ratio, "seed": seed}
    assert ppo.kl_in_loss and ppo.kl_estimator == "k3" and ppo.loss_aggregation == "token_mean", \
        "TRL is configured for k3 KL in the loss and a batch token mean: the quickstart changed"
    return spec, train_file, eval_file


def run_seed(seed: int, steps: int, every: int, work: Path) -> dict:
    """Both sides of one seed: accuracy by step ({step: share right}), step seconds, TRL's generation seconds."""
    work.mkdir(parents=True, exist_ok=True)
    spec, train_file, eval_file = prepare(seed, work)
    settings = settings_hash(CONFIG.read_text(), overrides(seed, steps, every))

    def evaluate(model_dir: Path, name: str) -> float:
        stdout = work / f"eval-{name}.out"
        run_watched([sys.executable, __file__, "--eval-child", str(model_dir), spec["model"], str(eval_file)],
                    work / f"eval-{name}.log", stdout=stdout, timeout=1800)
        return last_json(stdout)["accuracy"]

    out = work / "trl"
    stdout = work / "trl.out"
    child = {**spec, "rows": str(train_file), "out": str(out), "steps": steps, "every": every}
    (work / "trl-spec.json").write_text(json.dumps(child))
    wall, peak = run_watched([sys.executable, __file__, "--child", str(work / "trl-spec.json")], work / "trl.log",
                             stdout=stdout, timeout=4 * 3600)
    trl = last_json(stdout) | {"wall": wall, "peak_gib": peak}
    trl["accuracy"] = {0: evaluate(Path(spec["model"]), "start")} | {
        s: evaluate(out / f"step-{s}", f"trl-{s}") for s in range(1, steps + 1) if s % every == 0 or s == steps}
    print(f"seed {seed} TRL: {sum(trl['seconds']):.0f} s of steps, accuracy {trl['accuracy']}", flush=True)

    command = [sys.executable, "-m", "rlhf_ray.cli", "ppo", "--config", str(CONFIG)]
    for item in [*overrides(seed, steps, every), f"output_dir={work / 'ours'}", *QUIET]:
        command += ["--set", item]
    wall, peak = run_watched(command, work / "ours.log", timeout=4 * 3600)
    metrics = [json.loads(line) for line in (work / "ours" / "metrics.jsonl").read_text().splitlines()]
    ours = {"seconds": [m["time/iteration"] for m in metrics if "time/iteration" in m],
            "generate": [m["time/engine_generate"] for m in metrics if "time/engine_generate" in m],
            "rewards": [m["reward/mean"] for m in metrics if "reward/mean" in m and "time/iteration" in m],
            "kl": [m["kl/mean"] for m in metrics if "kl/mean" in m],
            "accuracy": {m["step"]: m["eval/task_accuracy"] for m in metrics if "eval/task_accuracy" in m},
            "wall": wall, "peak_gib": peak}
    print(f"seed {seed} ours: {sum(ours['seconds']):.0f} s of steps, accuracy {ours['accuracy']}", flush=True)
    result = {"seed": seed, "steps": steps, "every": every, "settings": settings, "date": today(),
              "machine": machine(), "versions": versions("torch", "ray", "deepspeed", "transformers", "trl", "vllm"),
              "samples_per_step": spec["prompts"] * spec["samples"], "eval_prompts": len(json.loads(
                  eval_file.read_text())), "trl": trl, "ours": ours}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"seed{seed}.json").write_text(json.dumps(result) + "\n")
    return result


def kept(steps: int, every: int) -> list[dict]:
    found = []
    for file in sorted(RESULTS.glob("seed*.json")):
        r = json.loads(file.read_text())
        r["trl"]["accuracy"] = {int(k): v for k, v in r["trl"]["accuracy"].items()}
        r["ours"]["accuracy"] = {int(k): v for k, v in r["ours"]["accuracy"].items()}
        if r["settings"] == settings_hash(CONFIG.read_text(), overrides(r["seed"], steps, every)):
            found.append(r)
        else:
            print(f"not reported: {file} ran other settings than {CONFIG.name} with --steps {steps} --eval-every "
                  f"{every} gives", flush=True)
    return found


def mean_and_se(values: list[float], prompts: int) -> tuple[float, float]:
    """Mean over seeds and its standard error: the prompts' binomial noise within each seed, and between seeds
    where there are several (the larger)."""
    mean = statistics.fmean(values)
    within = math.sqrt(sum(v * (1 - v) / prompts for v in values)) / len(values)
    between = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, max(within, between)


def elapsed(seconds: list[float], step: int) -> float:
    return sum(seconds[:step])


def report(results: list[dict], doc: Path | None) -> str:
    first = results[0]
    steps, prompts, samples = first["steps"], first["eval_prompts"], first["samples_per_step"]
    points = sorted(first["ours"]["accuracy"])
    seeds = ",".join(str(r["seed"]) for r in results)
    lines = [SECTION, "",
             f"Measured {first['date']} on {first['machine']} by `python benchmarks/bench_trl_smollm2.py --seeds "
             f"{seeds} --steps {steps} --eval-every {first['every']}`; {first['versions']}. Results kept in "
             "benchmarks/results/trl_grpo/.", "",
             f"The quickstart's task on both sides (`configs/quickstart/grpo.yaml`: SmolLM2-135M-Instruct, two-number "
             f"sums and differences): per step {samples} samples (the quickstart's prompts x answers per prompt, "
             f"temperature 0.7, up to {NEW_TOKENS} tokens), the last-number rule as the reward, group-normalised "
             "advantages, KL 0.04 to the starting model (k3, in the loss), token mean over the batch, one optimizer "
             "step at the quickstart's learning rate and cosine schedule, Adam betas (0.9, 0.95), gradient norm "
             "clipped at 1, fp32. TRL: GRPOTrainer in one process (transformers `generate`). Ours: the quickstart "
             "with ZeRO-2 (the default) and 64-token answers. Held-out: greedy accuracy on "
             f"{prompts} held-out problems (ours by the job's evaluation, TRL's saved models by the same vLLM greedy "
             "evaluator; the starting model's score from both is the check that they agree). ± is one standard "
             "error (prompts and seeds). Time: the steps' own wall time, evaluations and saves left out.", "",
             "| step | samples | TRL accuracy | ours accuracy | ours - TRL | TRL s | ours s |",
             "|---:|---:|---|---|---:|---:|---:|"]
    within_noise = []
    for step in points:
        t = mean_and_se([r["trl"]["accuracy"][step] for r in results], prompts)
        o = mean_and_se([r["ours"]["accuracy"][step] for r in results], prompts)
        noise = 2 * math.hypot(t[1], o[1])
        within_noise.append((step, o[0] - t[0], noise))
        lines.append(f"| {step} | {step * samples} | {t[0]:.3f} ± {t[1]:.3f} | {o[0]:.3f} ± {o[1]:.3f} | "
                     f"{o[0] - t[0]:+.3f} | {statistics.fmean(elapsed(r['trl']['seconds'], step) for r in results):.0f}"
                     f" | {statistics.fmean(elapsed(r['ours']['seconds'], step) for r in results):.0f} |")
    starts = [(r["seed"], r["trl"]["accuracy"][0], r["ours"]["accuracy"][0]) for r in results]
    trl_final = statistics.fmean(r["trl"]["accuracy"][steps] for r in results)
    trl_time = statistics.fmean(elapsed(r["trl"]["seconds"], steps) for r in results)
    reached = next((s for s in points if statistics.fmean(r["ours"]["accuracy"][s] for r in results) >= trl_final),
                   None)
    ours_time = None if reached is None else statistics.fmean(elapsed(r["ours"]["seconds"], reached) for r in results)
    below = [f"step {s} ({d:+.3f}, noise ±{n:.3f})" for s, d, n in within_noise if d < -n]
    step_trl = statistics.median(s for r in results for s in r["trl"]["seconds"][1:])
    step_ours = statistics.median(s for r in results for s in r["ours"]["seconds"][1:])
    lines += ["",
              "Evaluators agree on the starting model: " + "; ".join(
                  f"seed {s}: {a:.3f} (bench) vs {b:.3f} (job)" for s, a, b in starts) + ".", "",
              f"- Per sample, ours within noise of TRL at every point (two standard errors): "
              + ("met." if not below else "missed at " + ", ".join(below) + "."),
              f"- Time to TRL's final accuracy ({trl_final:.3f}, reached by TRL in {trl_time:.0f} s): "
              + ("not reached by ours within the steps: missed." if ours_time is None else
                 f"ours at step {reached}, {ours_time:.0f} s = {ours_time / trl_time:.2f} of TRL's time (goal <= 0.5:"
                 f" {'met' if ours_time <= 0.5 * trl_time else 'missed'})."),
              f"- Median step after the first: TRL {step_trl:.1f} s, ours {step_ours:.1f} s ({step_trl / step_ours:.2f}x "
              f"TRL's samples per second); peak memory of the process tree: TRL "
              f"{max(r['trl']['peak_gib'] for r in results):.1f} GiB, ours {max(r['ours']['peak_gib'] for r in results):.1f}"
              " GiB.", ""]
    plt = pyplot()
    if plt is not None and doc is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        for side, label, marker in (("trl", "TRL GRPOTrainer", "o"), ("ours", "rlhf-ray", "s")):
            for r in results:
                acc = r[side]["accuracy"]
                xs = sorted(acc)
                color = "C0" if side == "trl" else "C1"
                axes[0].plot([x * samples for x in xs], [acc[x] for x in xs], marker=marker, color=color, alpha=0.5,
                             label=label if r is results[0] else None)
                axes[1].plot([elapsed(r[side]["seconds"], x) / 60 for x in xs], [acc[x] for x in xs], marker=marker,
                             color=color, alpha=0.5, label=label if r is results[0] else None)
        axes[0].set(title=f"held-out greedy accuracy ({prompts} problems), per seed", xlabel="samples trained on")
        axes[1].set(title="the same against the steps' wall time", xlabel="minutes")
        axes[0].legend(fontsize=8)
        lines += [save_figure(fig, doc, "grpo_vs_trl_smollm2.png"), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--write", type=Path)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None, help="where runs write (default: a temporary folder)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--eval-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(trl_child(json.loads(Path(args.child).read_text()))))
        return 0
    if args.eval_child:
        model_dir, tokenizer, rows_file = args.eval_child
        rows = json.loads(Path(rows_file).read_text())
        print(json.dumps({"accuracy": greedy_accuracy(model_dir, tokenizer, rows, NEW_TOKENS)}))
        return 0
    if not args.report_only:
        work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-trl-grpo-"))
        for seed in [int(s) for s in args.seeds.split(",")]:
            run_seed(seed, args.steps, args.eval_every, work / f"seed{seed}")
    results = kept(args.steps, args.eval_every)
    if not results:
        print("no kept results match these settings")
        return 1
    text = report(results, args.write)
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
