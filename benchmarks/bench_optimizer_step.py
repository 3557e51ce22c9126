"""The optimizer step on CPU: torch's fused AdamW kernel against torch's default AdamW (what the learners use on
CPU), side by side in one process.

1. The step alone: SmolLM2-135M-Instruct's parameters in fp32 with random gradients, on 2 threads; the fused
   kernel, torch's default (on CPU a loop over the tensors) and its multi-tensor (foreach) variant; the gradient
   norm pass our ZeRO-0 learner takes before each step for the non-finite check. Median of 5 steps after one.
2. The hot path: a real PolicyLearner (DeepSpeed ZeRO-0 engine, fp32, 2 threads) trains 64 answers to 8 prompts
   (8 answers each: a GRPO rollout of configs/recipes/smollm2-sft-grpo.yaml's shape; prompts of 100 tokens, answers
   of 8-64) in 4 mini-batches of 16 (`ppo.train_batch_size: 16`, micro-batches of 16): 4 optimizer steps a call.
   The same learner alternates the kernel between calls in the order ABBA... (each parameter group's `fused`
   flag; the optimizer state is shared), so both see the same data and weights of the same kind. Synthetic tokens, real model and engine.

Run: python benchmarks/bench_optimizer_step.py [--calls 4] [--write benchmarks/HISTORY.md]
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
os.environ["OMP_NUM_THREADS"] = "2"  # what the recipe's policy gets on 2 cores (docs/architecture.md "Threads")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, publish, today, versions  # noqa: E402
from policy_learner import (ANSWER_LEN, ANSWERS, MINI_BATCH, PROMPT_LEN, PROMPTS, import_smollm2,  # noqa: E402
                            join_single_rank_group, mini_batch_plan, policy_learner)

SECTION = "## Optimizer step on CPU"
KERNELS = {"fused": {"fused": True, "foreach": None}, "torch default (the learners')": {"fused": None, "foreach": None},
           "foreach": {"fused": None, "foreach": True}}
"""Label: the parameter groups' flags torch's AdamW reads at each step."""


def set_kernel(optimizer, label: str) -> None:
    for group in optimizer.param_groups:
        group.update(KERNELS[label])


def timed(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def step_alone(model_dir: Path) -> dict[str, float]:
    import torch

    from rlhf_ray.config.model import ModelSpec
    from rlhf_ray.models.loading import load_causal_lm

    model = load_causal_lm(ModelSpec(path=str(model_dir), dtype="fp32"))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-7, weight_decay=0.0, fused=True)
    seconds = {}
    for label in KERNELS:
        set_kernel(optimizer, label)
        seconds[label] = timed(optimizer.step)
    seconds["gradient norm"] = timed(lambda: torch.stack([p.grad.float().norm() for p in params]).norm().item())
    return seconds


def learner_calls(model_dir: Path, calls: int) -> dict[str, list[dict[str, float]]]:
    join_single_rank_group()
    learner, experience = policy_learner(model_dir, "fp32")
    step = learner.optimizer_step
    spent = [0.0]

    def timed_step():
        began = time.perf_counter()
        step()
        spent[0] += time.perf_counter() - began

    learner.optimizer_step = timed_step
    plan = mini_batch_plan(len(experience))
    learner.train(plan)  # warm-up: the optimizer state is allocated at the first step
    results = {label: [] for label in list(KERNELS)[:2]}
    for call in range(calls):
        for label in (list(results) if call % 2 == 0 else list(results)[::-1]):  # ABBA: no order bias
            set_kernel(learner.deepspeed.optimizer, label)
            spent[0] = 0.0
            metrics = learner.train(plan).metrics()
            results[label].append({"train": metrics["policy/seconds"], "steps": spent[0]})
            print(f"call {call + 1}, {label}: train {metrics['policy/seconds']:.1f} s, optimizer steps "
                  f"{spent[0]:.2f} s", flush=True)
    return results


def render(alone: dict[str, float], calls: dict[str, list[dict[str, float]]]) -> str:
    fused, default = list(KERNELS)[:2]
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'deepspeed')}. Date: {today()}.", "",
             "Command: `python benchmarks/bench_optimizer_step.py --write benchmarks/HISTORY.md`. torch's fused AdamW "
             "kernel (`torch.optim.AdamW(fused=True)`) against torch's default AdamW, which on CPU loops over the "
             "tensors and is what the learners use there (on a GPU DeepSpeed's FusedAdam, with offload its CPU "
             "Adam).", "",
             "The step alone: SmolLM2-135M-Instruct fp32 (135M parameters), random gradients, 2 threads, median of "
             "5 steps:", "",
             "| AdamW kernel | step s | vs fused |", "|---|---:|---:|"]
    for label in KERNELS:
        lines.append(f"| {label} | {alone[label]:.3f} | {alone[label] / alone[fused]:.1f}x |")
    lines += ["", f"The gradient-norm pass before each ZeRO-0 step (the non-finite check): {alone['gradient norm']:.3f} s.",
              "", f"In the learner: a real PolicyLearner (DeepSpeed ZeRO-0, fp32, 2 threads) trains {PROMPTS * ANSWERS} "
              f"synthetic answers to {PROMPTS} prompts ({PROMPT_LEN}-token prompts, answers of 8-{ANSWER_LEN} tokens) "
              f"as 4 mini-batches of {MINI_BATCH}, 4 optimizer steps a call (the sft-grpo recipe with "
              "`ppo.train_batch_size: 16`); one learner alternates the kernel call by call (ABBA order), medians "
              f"over {len(calls[fused])} calls each:", "",
              "| AdamW kernel | train call s | of it optimizer steps s | call ratio |", "|---|---:|---:|---:|"]
    train = {label: statistics.median(r["train"] for r in rows) for label, rows in calls.items()}
    steps = {label: statistics.median(r["steps"] for r in rows) for label, rows in calls.items()}
    for label in calls:
        lines.append(f"| {label} | {train[label]:.1f} | {steps[label]:.2f} | {train[label] / train[fused]:.2f} |")
    spread = max(max(r["train"] for r in rows) - min(r["train"] for r in rows) for rows in calls.values())
    gap, saved = train[default] - train[fused], steps[default] - steps[fused]
    lines += ["", f"The optimizer steps account for {saved:.1f} s of the {gap:.1f} s between the medians; the other "
              f"{gap - saved:.1f} s are in the forward and backward passes, against a spread of up to {spread:.1f} s "
              "between one kernel's calls on the same data."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4, help="train calls per kernel in the learner")
    parser.add_argument("--write", type=Path, help="markdown file whose section is replaced")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = import_smollm2(Path(tmp))
        alone = step_alone(model_dir)
        print(alone, flush=True)
        calls = learner_calls(model_dir, args.calls)
    return publish(render(alone, calls), args.write, SECTION)


if __name__ == "__main__":
    sys.exit(main())
