"""Partial rollouts on a long-tailed workload: samples trained per second, and how busy the engine and the learner
are, for sync PPO, async (`ppo.rollouts_ahead`) and async with `generation.partial_rollouts`, in one run on one
machine.

The workload: GRPO (4 answers per prompt, 8 prompts per rollout) with a tiny random Llama (models/tiny.py) whose
generation config names 16 of its 1024 token ids as stop ids, so every answer token ends the answer with a
probability of about 1/64: answer lengths are geometric, capped at 256 tokens (measured on one rollout: mean 54,
median 45, longest 193). A rollout's longest group then takes several times its average one: the long tail that
answers of reasoning and tool use have. Every mode runs the same job (same prompts, seeds and iterations) as a
real `rlhf-ray ppo` job in a fresh process; the iterations after the first two count.

- samples/s: answers trained on per second of iteration wall time;
- engine busy: the engine's generation seconds over the wall time (one engine);
- learner busy: the policy learner's training seconds over the wall time.

Accuracy (`--accuracy`): does training on partial rollouts learn as well as sync PPO? GRPO with the rule as reward
on the pipeline quickstart's task (configs/quickstart/grpo-http.yaml's job with the rule in process: the tiny SFT
model sorting numbers), the same number of updates in sync mode and with partial rollouts, 3 seeds; held-out
accuracy (greedy and sampled) before -> after. Needs the pipeline quickstart's SFT model
(`bash scripts/quickstart.sh --pipeline` makes it). With `--smollm2`: the README quickstart's own job
(configs/quickstart/grpo.yaml: SmolLM2-135M-Instruct, vLLM, demo/arithmetic, 10 updates, 100 held-out prompts).

SmolLM2 (`--smollm2`): the quickstart's GRPO job on SmolLM2-135M-Instruct with vLLM, answers of up to 192 tokens
at temperature 1 (its own length distribution), async against partial rollouts, one run each.

Run: python benchmarks/bench_partial_rollouts.py [--write benchmarks/HISTORY.md] [--quick] [--accuracy] [--smollm2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, pyplot, run_job, save_figure, today, versions, write_section  # noqa: E402

SECTION = "## Partial rollouts on long-tailed answers"
ACCURACY_SECTION = "## Partial rollouts: held-out accuracy against sync"
SMOLLM2_ACCURACY_SECTION = "## Partial rollouts: held-out accuracy against sync on the quickstart task"
SMOLLM2_SECTION = "## Partial rollouts on SmolLM2's own answer lengths"
SMOLLM2_CONFIG, SMOLLM2_NEW = ROOT / "configs/quickstart/grpo.yaml", 192
ACCURACY_CONFIG = ROOT / "configs/quickstart/grpo-http.yaml"
ACCURACY_MODES = {"sync": ["ppo.mode=sync"],
                  "partial (ahead 2, staleness 4)": [*["ppo.mode=async", "generation.partial_rollouts=true"],
                                                     "ppo.rollouts_ahead=2", "ppo.max_staleness=4",
                                                     "ppo.buffer_capacity=2", "ppo.tis_cap=2.0"]}
CONFIG = ROOT / "configs/quickstart/ppo.yaml"
STOP_IDS, MAX_NEW, SKIP = 16, 256, 2
PROMPTS, ANSWERS = 8, 4
ASYNC, PARTIAL = ["ppo.mode=async"], ["ppo.mode=async", "generation.partial_rollouts=true"]
MODES = {"sync": ["ppo.mode=sync"],
         "async (ahead 1, staleness 1)": ASYNC,
         "async (ahead 2, staleness 2)": [*ASYNC, "ppo.rollouts_ahead=2", "ppo.max_staleness=2"],
         "partial (ahead 1, staleness 1)": PARTIAL,
         "partial (ahead 2, staleness 4)": [*PARTIAL, "ppo.rollouts_ahead=2", "ppo.max_staleness=4"]}
BASELINE, RECOMMENDED = "async (ahead 1, staleness 1)", "partial (ahead 2, staleness 4)"
DEFAULT_SEEDS = "1234,2,3"


def long_tailed_model(folder: Path) -> Path:
    """The tiny random model, with STOP_IDS ordinary token ids added to its generation config's stop ids."""
    import torch
    from transformers import AutoTokenizer

    from rlhf_ray.models.tiny import build_tiny_model

    build_tiny_model(folder, preset="tiny")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    order = torch.randperm(len(tokenizer), generator=torch.Generator().manual_seed(0)).tolist()
    extra = [i for i in order if i not in tokenizer.all_special_ids][:STOP_IDS]
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = [tokenizer.eos_token_id, *extra]
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def job(model: Path, out: Path, iterations: int, extra: list[str]) -> list[str]:
    return [f"policy.model.path={model}", f"output_dir={out}", f"ppo.iterations={iterations}",
            "ppo.eval_prompts=0", "checkpoint.every_steps=0", "generation.engine=hf",
            f"generation.sampling.max_new_tokens={MAX_NEW}", f"generation.sampling.n_samples_per_prompt={ANSWERS}",
            f"ppo.rollout_batch_size={PROMPTS}", "ppo.advantage_estimator=grpo", "critic=null", "reward.model.path=null",
            "reward.function=rlhf_ray.data.demo_sort:score", "reward.placement.colocate_with=policy",
            "reward.placement.num_cpus=0.1", "ppo.tis_cap=2.0", *extra]


def measure(rows: list[dict]) -> dict:
    steps = [r for r in rows if "time/iteration" in r][SKIP:]
    wall = sum(r["time/iteration"] for r in steps)
    return {"samples_per_s": PROMPTS * ANSWERS * len(steps) / wall, "iteration_s": wall / len(steps),
            "engine_busy": sum(r["time/engine_busy"] for r in steps) / wall,
            "learner_busy": sum(r["compute/train_seconds"] for r in steps) / wall,
            "answer_length": sum(r["answer/length"] for r in steps) / len(steps),
            "streamed": sum(r.get("generate/streamed_groups", 0) for r in steps) / len(steps),
            "restarted": sum(r.get("generate/restarted_answers", 0) for r in steps) / (PROMPTS * ANSWERS * len(steps)),
            "stale_tokens": sum(1 - r["experience/tokens_staleness_0"] for r in steps) / len(steps),
            "iterations": len(steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="markdown file whose section is replaced")
    parser.add_argument("--quick", action="store_true", help="fewer iterations, one round")
    parser.add_argument("--rounds", type=int, default=3, help="each mode runs this many times, alternating")
    parser.add_argument("--accuracy", action="store_true", help="the held-out accuracy comparison instead")
    parser.add_argument("--seeds", default=DEFAULT_SEEDS, help="--accuracy: seeds, comma-separated")
    parser.add_argument("--smollm2", action="store_true", help="on SmolLM2 (the quickstart's job) instead")
    args = parser.parse_args()
    if args.accuracy:
        return accuracy(args)
    if args.smollm2:
        return smollm2(args)
    iterations, rounds = (6, 1) if args.quick else (30, args.rounds)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = long_tailed_model(tmp / "model")
        for r in range(rounds):
            for mode, extra in MODES.items():
                began = time.perf_counter()
                out = tmp / f"{mode.replace(' ', '')}-{r}"
                _, rows = run_job("ppo", CONFIG, job(model, out, iterations, extra))
                results[mode].append(measure(rows))
                print(f"{mode} (round {r + 1}): {time.perf_counter() - began:.0f} s, "
                      f"{results[mode][-1]['samples_per_s']:.1f} samples/s", flush=True)
    text = render(results, args, iterations)
    if args.write:
        write_section(args.write, SECTION, text)
    print(text)
    return 0


def smollm2(args) -> int:
    """The quickstart's GRPO job (SmolLM2-135M-Instruct, vLLM, demo/arithmetic through the chat template) with
    answers of up to SMOLLM2_NEW tokens at temperature 1: the model answers most sums in a line and rambles on
    some, a long tail of its own."""
    iterations = 4 if args.quick else 8
    modes = {mode: MODES[mode] for mode in (BASELINE, "async (ahead 2, staleness 2)", RECOMMENDED)}
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for number, (mode, extra) in enumerate(modes.items()):
            began = time.perf_counter()
            _, rows = run_job("ppo", SMOLLM2_CONFIG, [
                f"output_dir={Path(tmp) / f'run-{number}'}", f"ppo.iterations={iterations}",
                "ppo.eval_prompts=0", "checkpoint.every_steps=0", "generation.sampling.temperature=1.0",
                f"generation.sampling.max_new_tokens={SMOLLM2_NEW}", "ppo.tis_cap=2.0", *extra])
            results[mode].append(measure(rows))
            print(f"{mode}: {time.perf_counter() - began:.0f} s, {results[mode][-1]['samples_per_s']:.2f} samples/s",
                  flush=True)
    mid = median_of(results)
    lines = [SMOLLM2_SECTION, "",
             f"{today()}, {machine()}; {versions('torch', 'transformers', 'ray', 'vllm')}. `python benchmarks/"
             f"bench_partial_rollouts.py --smollm2{' --quick' if args.quick else ''}"
             f"{' --write benchmarks/HISTORY.md' if args.write else ''}`: `{SMOLLM2_CONFIG.relative_to(ROOT)}`'s job "
             f"(SmolLM2-135M-Instruct, vLLM, fp32, demo/arithmetic, 4 answers x 8 prompts per rollout) at temperature "
             f"1.0 with answers of up to {SMOLLM2_NEW} tokens; {iterations} iterations per mode, the first {SKIP} "
             "left out; one run per mode.", "", *table(results), "",
             f"{RECOMMENDED} against {BASELINE}: "
             f"{mid(RECOMMENDED, 'samples_per_s') / mid(BASELINE, 'samples_per_s'):.2f}x samples/s."]
    text = "\n".join(lines) + "\n"
    if args.write:
        write_section(args.write, SMOLLM2_SECTION, text)
    print(text)
    return 0


def accuracy(args) -> int:
    import statistics

    if args.smollm2:
        config, section, overrides, held_out = SMOLLM2_CONFIG, SMOLLM2_ACCURACY_SECTION, [], 100
        what = "the README quickstart: SmolLM2-135M-Instruct, vLLM, demo/arithmetic, 10 updates of 8 prompts x 4 answers"
    else:
        sft = ROOT / "outputs/quickstart/sft/model"
        if not sft.is_dir():
            raise SystemExit(f"{sft} is missing: run `bash scripts/quickstart.sh --pipeline` first")
        config, section, held_out = ACCURACY_CONFIG, ACCURACY_SECTION, 64
        overrides = ["reward.http=null", "reward.function=rlhf_ray.data.demo_sort:score"]
        what = ("the pipeline quickstart's SFT model, demo/sort, GRPO, 100 updates of 16 prompts x 4 answers, "
                "with the rule in process")
    rows: dict[str, list[dict]] = {mode: [] for mode in ACCURACY_MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds.split(","):
            for mode, extra in ACCURACY_MODES.items():
                out = Path(tmp) / f"{mode.split()[0]}-{seed}"
                summary, _ = run_job("ppo", config, [
                    f"seed={seed}", f"output_dir={out}", "checkpoint.resume=false", *overrides, *extra])
                rows[mode].append({"seed": seed, **summary})
                print(mode, seed, {k: summary[k] for k in ("task_accuracy_after", "sampled_task_accuracy_after",
                                                           "seconds")}, flush=True)
    lines = [section, "",
             f"{today()}, {machine()}; {versions('torch', 'transformers', 'ray', 'vllm')}. `python benchmarks/"
             f"bench_partial_rollouts.py --accuracy{' --smollm2' if args.smollm2 else ''}"
             f"{' --seeds ' + args.seeds if args.seeds != DEFAULT_SEEDS else ''}"
             f"{' --write benchmarks/HISTORY.md' if args.write else ''}`: "
             f"`{config.relative_to(ROOT)}`'s job ({what}) in sync mode and with partial rollouts; held-out "
             f"accuracy on {held_out} prompts (greedy; sampled: 4 samples each), before -> after.", "",
             "| mode | seed | greedy | sampled | job seconds |", "|---|---|---|---|---|"]
    for mode, runs in rows.items():
        for r in runs:
            lines.append(f"| {mode} | {r['seed']} | {r['task_accuracy_before']:.3f} -> {r['task_accuracy_after']:.3f} "
                         f"| {r['sampled_task_accuracy_before']:.3f} -> {r['sampled_task_accuracy_after']:.3f} | "
                         f"{r['seconds']:.0f} |")
    lines.append("")
    for mode, runs in rows.items():
        for key in ("task_accuracy_after", "sampled_task_accuracy_after"):
            values = [r[key] for r in runs]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            lines.append(f"- {mode}, {key.replace('_after', '').replace('_', ' ')} after: mean {statistics.mean(values):.3f}, "
                         f"sd {spread:.3f} over {len(values)} seeds")
    (base, base_runs), (other, other_runs) = rows.items()
    for key in ("task_accuracy_after", "sampled_task_accuracy_after"):
        gaps = [o[key] - b[key] for b, o in zip(base_runs, other_runs)]
        lines.append(f"- {other} minus {base}, same seed, {key.replace('_after', '').replace('_', ' ')}: "
                     + ", ".join(f"{g:+.3f}" for g in gaps) + f" (mean {statistics.mean(gaps):+.3f})")
    p = statistics.mean(r["task_accuracy_after"] for runs in rows.values() for r in runs)
    lines.append(f"- one greedy held-out accuracy over {held_out} prompts has a standard error of about "
                 f"{(p * (1 - p) / held_out) ** 0.5:.3f} at these values (sqrt(p (1 - p) / {held_out}))")
    text = "\n".join(lines) + "\n"
    if args.write:
        write_section(args.write, section, text)
    print(text)
    return 0


def median_of(results: dict[str, list[dict]]):
    import statistics

    return lambda mode, key: statistics.median(r[key] for r in results[mode])


def table(results: dict[str, list[dict]]) -> list[str]:
    mid = median_of(results)
    lines = ["| mode | samples/s | vs async | iteration (s) | engine busy | learner busy | streamed groups | "
             "answers restarted | tokens >= 1 version old | answer length |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = mid(BASELINE, "samples_per_s")
    for mode in results:
        lines.append(f"| {mode} | {mid(mode, 'samples_per_s'):.1f} | {mid(mode, 'samples_per_s') / base:.2f}x | "
                     f"{mid(mode, 'iteration_s'):.2f} | {mid(mode, 'engine_busy'):.0%} | "
                     f"{mid(mode, 'learner_busy'):.0%} | {mid(mode, 'streamed'):.0%} | {mid(mode, 'restarted'):.0%} | "
                     f"{mid(mode, 'stale_tokens'):.0%} | {mid(mode, 'answer_length'):.0f} |")
    return lines


def render(results: dict[str, list[dict]], args, iterations: int) -> str:
    mid = median_of(results)

    lines = [SECTION, "",
             f"{today()}, {machine()}; {versions('torch', 'transformers', 'ray')}. "
             f"`python benchmarks/bench_partial_rollouts.py{' --quick' if args.quick else ''}"
             f"{' --write benchmarks/HISTORY.md' if args.write else ''}`: GRPO on a tiny random Llama whose answers "
             f"end with probability ~1/64 per token (geometric lengths capped at {MAX_NEW}; 4 answers x 8 prompts "
             f"per rollout), hf engine, 2 cores shared by every role; {iterations} iterations per run, the first "
             f"{SKIP} left out; each mode run {len(next(iter(results.values())))} time(s), alternating, medians.",
             "", *table(results)]
    partial = mid(RECOMMENDED, "samples_per_s") / mid(BASELINE, "samples_per_s")
    busy = mid(RECOMMENDED, "engine_busy")
    lines += ["", "Engine busy sums the generation seconds of the rollouts trained in the counted iterations over their "
                  "wall time (with partial rollouts, a rollout counts its own turn and the generation between calls "
                  "before it); a rollout generated partly before the window makes it pass 100%. Answers restarted: "
                  "answers in flight started again because their first token was over ppo.max_staleness versions "
                  "old (per answer trained).",
              "", f"Goal (issue 39): partial rollouts >= 1.3x today's async ({BASELINE}) samples/s, engine busy >= "
                  f"90%. Measured with {RECOMMENDED}: {partial:.2f}x, engine busy {busy:.0%}: "
                  + ("met." if partial >= 1.3 and busy >= 0.9 else "missed.")
              + " Per round, the two side by side: " + ", ".join(
                  f"{p['samples_per_s'] / b['samples_per_s']:.2f}x" for p, b in zip(results[RECOMMENDED],
                                                                                    results[BASELINE])) + "."]
    plt = pyplot()
    if plt is not None and args.write:
        fig, ax = plt.subplots(figsize=(7, 3))
        modes = list(results)
        ax.barh([m.replace(" (", "\n(") for m in modes], [mid(m, "samples_per_s") for m in modes],
                color=["#888", "#4a7", "#4a7", "#27c", "#27c"])
        ax.invert_yaxis()
        ax.set_xlabel("samples trained / s")
        ax.set_title("GRPO, long-tailed answers (tiny model, 2 cores)")
        lines += ["", save_figure(fig, args.write, "partial_rollouts.png")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
