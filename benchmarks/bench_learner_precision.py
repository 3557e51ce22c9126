"""Learner precision on CPU: a bf16 policy learner against the fp32 one the SmolLM2 recipes use, side by side.

1. Speed: two real PolicyLearners (DeepSpeed ZeRO-0, 2 threads) on SmolLM2-135M-Instruct, one fp32 (torch AdamW),
   one bf16 (DeepSpeed's BF16_Optimizer: fp32 master weights and optimizer state), each train a GRPO rollout of
   the sft-grpo recipe's shape (64 answers to 8 prompts, 4 mini-batches of 16: benchmarks/policy_learner.py) and
   score it (the old log-probs' forward, what the reference's costs too), alternating call by call in the order
   ABBA so that neither gets the quieter half of the run.
2. What bf16 costs in the numbers: per-token log-probs of the worked answers to held-out demo/word-problems (the
   SFT targets, through SmolLM2's chat template) from the fp32 model; the same weights rounded to bf16 but computed
   in fp32 (what an fp32 engine computes after a weight sync from a bf16 learner); and computed in bf16 (the bf16
   learner). The gap between the last two is the engine/learner mismatch a run with a bf16 policy and fp32
   engines trains with; the gap between the first two is what the rounding of the weights alone moves.
3. In a job: the PPO stage of configs/recipes/smollm2-sft-grpo.yaml from its SFT model with
   `ppo.train_batch_size: 16`, as written (fp32) and with `policy.model.dtype: bf16` (the reference, which copies
   the policy's model section, then bf16 too; the engines stay fp32), one after the other; medians of the
   iterations after the first, and the gap the job reports between engine and policy log-probs.

Run: python benchmarks/bench_learner_precision.py [--calls 4] [--problems 64] [--sft SFT_MODEL] [--iterations 4]
     [--write benchmarks/HISTORY.md]   (without --sft the recipe's SFT stage runs first; --iterations 0 skips part 3)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "2"  # what the recipe's policy trains on with 2 cores (jobs/threads.py)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, publish, run_job, steady, today, versions  # noqa: E402
from policy_learner import (ANSWERS, MINI_BATCH, PROMPTS, import_smollm2, join_single_rank_group,  # noqa: E402
                            mini_batch_plan, policy_learner)
from sft_grpo_stage import ppo_stage  # noqa: E402

SECTION = "## Learner precision on CPU: bf16 against fp32"
DTYPES = ("fp32", "bf16")


def learner_calls(model_dir: Path, calls: int) -> dict[str, list[dict[str, float]]]:
    """Train and score seconds of each precision's learner, `calls` of each, ABBA."""
    join_single_rank_group()
    learners = {dtype: policy_learner(model_dir, dtype) for dtype in DTYPES}
    plan = mini_batch_plan(len(learners["fp32"][1]))
    for dtype, (learner, _) in learners.items():  # warm-up: optimizer state allocated, kernels chosen
        learner.train(plan)
    results = {dtype: [] for dtype in DTYPES}
    for call in range(calls):
        for dtype in (DTYPES if call % 2 == 0 else DTYPES[::-1]):
            learner, experience = learners[dtype]
            metrics = learner.train(plan).metrics()
            began = time.perf_counter()
            learner.over_my_rows(experience, learner._logprobs)
            scored = time.perf_counter() - began
            results[dtype].append({"train": metrics["policy/seconds"], "score": scored,
                                   "applied": metrics["policy/steps_applied"]})
            print(f"call {call + 1}, {dtype}: train {metrics['policy/seconds']:.1f} s "
                  f"({metrics['policy/steps_applied']:.0f} steps applied), score {scored:.1f} s", flush=True)
    return results


def answer_rows(tokenizer, problems: int) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) of held-out word problems with their worked answers, chat-templated."""
    from rlhf_ray.data import word_problems
    from rlhf_ray.data.adapters import apply_chat_template

    rows = []
    for sample in word_problems.load().eval[:problems]:
        rendered = apply_chat_template(sample, tokenizer)
        prompt = tokenizer(rendered.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(rendered.chosen, add_special_tokens=False)["input_ids"]
        rows.append((prompt + answer, len(prompt)))
    return rows


def answer_logprobs(model, rows: list[tuple[list[int], int]]) -> list:
    """Each row's answer-token log-probs (fp32 tensors) under `model`, one row at a time (no padding)."""
    import torch

    from rlhf_ray.algorithms.logprobs import token_logprobs

    out = []
    with torch.no_grad():
        for ids, prompt_len in rows:
            tokens = torch.tensor([ids])
            logits = model(input_ids=tokens).logits[:, prompt_len - 1:-1]
            out.append(token_logprobs(logits, tokens[:, prompt_len:])[0].float())
    return out


def logprob_gaps(model_dir: Path, problems: int) -> dict[str, dict[str, float]]:
    """|log-prob difference| per answer token (mean, p99, max) between the three ways of computing them."""
    import torch
    from transformers import AutoTokenizer

    from rlhf_ray.config.model import ModelSpec
    from rlhf_ray.models.loading import load_causal_lm

    rows = answer_rows(AutoTokenizer.from_pretrained(str(model_dir)), problems)
    model = load_causal_lm(ModelSpec(path=str(model_dir), dtype="fp32")).eval()
    fp32 = answer_logprobs(model, rows)
    model = model.to(torch.bfloat16)
    bf16 = answer_logprobs(model, rows)
    rounded = answer_logprobs(model.to(torch.float32), rows)  # bf16-rounded weights, fp32 compute

    def gap(a, b) -> dict[str, float]:
        diff = torch.cat([(x - y).abs() for x, y in zip(a, b)])
        return {"mean": diff.mean().item(), "p99": diff.quantile(0.99).item(), "max": diff.max().item(),
                "tokens": len(diff)}

    return {"weights rounded to bf16, fp32 compute vs fp32 model": gap(rounded, fp32),
            "bf16 compute vs fp32 compute of the same bf16 weights (a bf16 learner, fp32 engines)": gap(bf16, rounded),
            "bf16 model vs fp32 model": gap(bf16, fp32)}


STAGE_COLUMNS = {"iteration s": "time/iteration", "training s": "compute/train_seconds",
                 "experience s": "time/experience", "old log-probs s": "compute/policy_seconds",
                 "reference s": "compute/reference_seconds", "engine/policy log-prob gap": "generate/logprob_gap"}
"""Table column: the metric it is the median of."""


def stage_runs(folder: Path, sft: Path | None, iterations: int) -> dict[str, list[dict]]:
    """The recipe's PPO stage (4 optimizer steps a rollout) with the policy in each precision: metrics per
    iteration."""
    config, overrides = ppo_stage(folder, sft, iterations)
    runs = {}
    for dtype in DTYPES:
        began = time.perf_counter()
        _, metrics = run_job("ppo", config, [f"output_dir={folder / dtype}", *overrides, "ppo.train_batch_size=16",
                                             f"policy.model.dtype={dtype}"])
        print(f"stage, policy {dtype}: {time.perf_counter() - began:.0f} s", flush=True)
        runs[dtype] = [m for m in metrics if "time/iteration" in m]
    return runs


def render_stage(runs: dict[str, list[dict]]) -> list[str]:
    fp32 = steady(runs["fp32"], "time/iteration")
    iterations = len(runs["fp32"])
    lines = ["", f"In a job: the PPO stage of configs/recipes/smollm2-sft-grpo.yaml from its SFT model with "
             "`ppo.train_batch_size: 16` (8 prompts x 8 answers, 4 optimizer steps a rollout; vLLM engines in fp32), "
             "as written and with `policy.model.dtype: bf16` (the reference copies the policy's model section, so it "
             f"is bf16 too), one after the other; medians of iterations 2-{iterations}:", "",
             "| policy dtype | " + " | ".join(STAGE_COLUMNS) + " | iteration ratio |",
             "|---|" + "---:|" * (len(STAGE_COLUMNS) + 1)]
    for dtype, metrics in runs.items():
        cells = [f"{steady(metrics, key):.4f}" if "gap" in key else f"{steady(metrics, key):.1f}"
                 for key in STAGE_COLUMNS.values()]
        lines.append(f"| {dtype} | " + " | ".join(cells) + f" | {steady(metrics, 'time/iteration') / fp32:.2f} |")
    return lines


def render(calls: dict[str, list[dict[str, float]]], gaps: dict[str, dict[str, float]], problems: int,
           stage: dict[str, list[dict]]) -> str:
    train = {d: statistics.median(r["train"] for r in rows) for d, rows in calls.items()}
    score = {d: statistics.median(r["score"] for r in rows) for d, rows in calls.items()}
    spread = {d: max(r["train"] for r in rows) - min(r["train"] for r in rows) for d, rows in calls.items()}
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'deepspeed', 'transformers')}. Date: {today()}.", "",
             "Command: `python benchmarks/bench_learner_precision.py --write benchmarks/HISTORY.md`. Two real "
             "PolicyLearners on SmolLM2-135M-Instruct (DeepSpeed ZeRO-0, 2 threads), fp32 (torch AdamW, what the "
             "SmolLM2 recipes train in) and bf16 (`model.dtype: bf16`: DeepSpeed's BF16_Optimizer, fp32 master "
             f"weights and optimizer state), each training {PROMPTS * ANSWERS} synthetic answers to {PROMPTS} "
             f"prompts in 4 mini-batches of {MINI_BATCH} (4 optimizer steps a call, the sft-grpo recipe with "
             "`ppo.train_batch_size: 16`) and scoring them (the old log-probs' forward), alternating call by call "
             f"(ABBA); medians over {len(calls['fp32'])} calls each.", "",
             "| policy dtype | train call s | spread s | score s | train ratio | score ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for d in DTYPES:
        lines.append(f"| {d} | {train[d]:.1f} | {spread[d]:.1f} | {score[d]:.1f} | {train[d] / train['fp32']:.2f} | "
                     f"{score[d] / score['fp32']:.2f} |")
    lines += ["", "Ratios: the dtype's median over fp32's.", "",
              f"What bf16 moves: per-token log-probs of the worked answers to {problems} held-out "
              "demo/word-problems (the SFT targets, chat-templated), one answer at a time, |difference| in nats:", "",
              "| compared | tokens | mean | p99 | max |", "|---|---:|---:|---:|---:|"]
    for label, g in gaps.items():
        lines.append(f"| {label} | {g['tokens']} | {g['mean']:.4f} | {g['p99']:.3f} | {g['max']:.3f} |")
    if stage:
        lines += render_stage(stage)
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4, help="train calls per precision")
    parser.add_argument("--problems", type=int, default=64, help="held-out word problems for the log-prob gaps")
    parser.add_argument("--sft", type=Path, help="the sft-grpo recipe's SFT model (default: train it first)")
    parser.add_argument("--iterations", type=int, default=4, help="PPO iterations per job run (0: no job runs)")
    parser.add_argument("--write", type=Path, help="markdown file whose section is replaced")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = import_smollm2(Path(tmp))
        gaps = logprob_gaps(model_dir, args.problems)
        print(gaps, flush=True)
        calls = learner_calls(model_dir, args.calls)
        stage = stage_runs(Path(tmp), args.sft, args.iterations) if args.iterations else {}
    return publish(render(calls, gaps, args.problems, stage), args.write, SECTION)


if __name__ == "__main__":
    sys.exit(main())
