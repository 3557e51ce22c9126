"""What every benchmark script shares: the machine line, library versions, and replacing its section of
docs/benchmarks.md (up to the next '## ' heading) without touching the others."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
        # machines named alike ("AMD EPYC") differ here, and bf16 timings depend on it (benchmarks/HISTORY.md "Learner
        # precision on CPU")
        units = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
        cpu += f" with {' and '.join(units)}" if units else ", no bf16 units"
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    ram = psutil.virtual_memory().total / 2**30
    return (f"{len(os.sched_getaffinity(0))} cores ({cpu}){gpu}, {ram:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}")


def versions(*modules: str) -> str:
    found = []
    for name in modules:
        try:
            found.append(f"{name} {__import__(name).__version__}")
        except ImportError:
            found.append(f"{name} (not installed)")
    return f"Python {platform.python_version()}, " + ", ".join(found)


def _sha12(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()[:12]


def file_hash(path: Path) -> str:
    """The first 12 hex digits of a file's SHA-256: which version of a recipe file a kept result ran."""
    return _sha12(path.read_bytes())


def settings_hash(recipe_text: str, overrides: list[str]) -> str:
    """The first 12 hex digits of the SHA-256 of a recipe's settings with `--set` overrides applied, as the CLI
    applies them: which configuration a kept result ran. Comments and layout do not change it, nor the spelling of
    a number (YAML reads `1e-5` as a string, `1.0e-5` as a float; the config models read both as the float); a run
    of an earlier recipe file whose overrides made it today's recipe has today's recipe's hash."""
    import json

    import yaml

    from rlhf_ray.config.loader import ConfigSource

    source = ConfigSource(yaml.safe_load(recipe_text), "recipe").override(overrides)
    return _sha12(json.dumps(_numbers_read(source.data), sort_keys=True).encode())


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _numbers_read(value):
    """`value` with every string that spells a number replaced by that number."""
    if isinstance(value, dict):
        return {k: _numbers_read(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers_read(v) for v in value]
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        number = float(value)
        return int(number) if number.is_integer() and not any(c in value for c in ".eE") else number
    return value


def today() -> str:
    return datetime.date.today().isoformat()


def write_section(doc: Path, heading: str, text: str) -> None:
    """Replace the section that starts with `heading` or append it; other sections are left as they are."""
    body = doc.read_text() if doc.exists() else "# Benchmarks\n"
    lines = body.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    text = text.rstrip("\n") + "\n"
    if start is None:
        body = body.rstrip("\n") + "\n\n" + text
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        body = "".join(lines[:start]) + text + ("\n" + "".join(lines[end:]) if end < len(lines) else "")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(body)


def run_job(kind: str, config: Path, overrides: list[str], env: dict[str, str] | None = None,
            timeout: float = 3600, entry: tuple[str, ...] = ("-m", "rlhf_ray.cli")) -> tuple[dict, list[dict]]:
    """`rlhf-ray KIND --config CONFIG --set ...` in a fresh process; (summary.json, metrics.jsonl rows). The
    overrides must include output_dir. `entry`: the interpreter's arguments before the CLI's (a script of a
    benchmark's own that changes something in the driver, then calls the CLI's main on the rest)."""
    import json
    import subprocess
    import sys

    out = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")))
    command = [sys.executable, *entry, kind, "--config", str(config)]
    for item in ["cluster.dashboard=false", "logging.progress=false", "logging.tensorboard=false", *overrides]:
        command += ["--set", item]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "RLHF_RAY_LOG_LEVEL": "WARNING", **(env or {})}
    proc = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-4000:]}")
    log = out / "metrics.jsonl"  # a pipeline writes one per stage, in the stage's folder
    metrics = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    return json.loads((out / "summary.json").read_text()), metrics


def steady(rows: list[dict], key: str, skip: int = 1) -> float:
    """Median of `key` over the logged iterations after the first `skip` (warm-up: first forward passes, lazy
    allocations)."""
    import statistics

    values = [r[key] for r in rows if key in r][skip:]
    return statistics.median(values) if values else float("nan")


def pyplot():
    """matplotlib's pyplot on a file-only backend, or None when matplotlib is missing (tables still get written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, doc: Path, name: str) -> str:
    """Save under docs/img/ (where docs/benchmarks.md and benchmarks/HISTORY.md both link); returns the markdown
    link, relative to the doc."""
    import os

    path = ROOT / "docs" / "img" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return f"![{name}]({os.path.relpath(path, Path(doc).resolve().parent)})"


def tree_pss(proc: psutil.Process) -> int:
    """Memory of a process and its children, summed as PSS (shared pages split between sharers): summing RSS
    would count shared libraries and a forked worker's copy-on-write pages once per process."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total


def run_watched(command: list[str], log: Path, env: dict | None = None, timeout: float | None = None,
                stdout: Path | None = None) -> tuple[float, float]:
    """Run a command from the repository root with PYTHONPATH on it, polling its process tree's PSS; (wall
    seconds, peak GiB). A PSS sample reads every process's page map (a large vLLM process takes a noticeable
    fraction of a second), so the poll waits 20x as long as the last sample took, at least 0.25 s: sampling costs
    the job under 5% of one core (polling every 0.25 s regardless took a whole core of 2 and slowed a GRPO run's
    iterations from 29 s to 47 s). Output goes to files (`log`; stdout to `stdout` when given), never to a pipe:
    a pipe nobody reads until the end fills up and blocks the job. A failure or a run past `timeout` raises,
    naming the log."""
    import subprocess
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "RLHF_RAY_LOG_LEVEL": "WARNING", **(env or {})}
    start, peak = time.perf_counter(), 0
    with open(log, "w") as err, open(stdout or os.devnull, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out if stdout else err, stderr=err)
        watched = psutil.Process(proc.pid)
        while proc.poll() is None:
            sampled = time.perf_counter()
            peak = max(peak, tree_pss(watched))
            if timeout is not None and time.perf_counter() - start > timeout:
                proc.kill()
                raise RuntimeError(f"{' '.join(map(str, command))} ran past {timeout} s; see {log}")
            time.sleep(max(0.25, 20 * (time.perf_counter() - sampled)))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - start, peak / 2**30


def greedy_accuracy(model_dir: str, tokenizer: str, rows: list[dict], new_tokens: int) -> float:
    """Greedy accuracy of a model on held-out rows ({"prompt": the prompt as the engines see it, "answer": the
    truth}) by vLLM in fp32, scored by the last-number rule. Loads vLLM into this process: call it from a child."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from rlhf_ray.data.answers import last_number_reward

    llm = LLM(model_dir, tokenizer=tokenizer, dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=2**30)  # vLLM's default on CPU reserves 92% of a NUMA node's memory
    outs = llm.generate([r["prompt"] for r in rows], SamplingParams(temperature=0, max_tokens=new_tokens),
                        use_tqdm=False)
    scores = last_number_reward([r["prompt"] for r in rows], [o.outputs[0].text for o in outs],
                                answer=[r["answer"] for r in rows])
    return sum(scores) / len(scores)


def trl_step_timer(marks: list[float]):
    """A TRL/transformers callback appending the time at the first step's start and at every step's end to `marks`
    (so consecutive differences are step times)."""
    import time

    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not marks:
                marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    return StepTimes()


def recipe_args(doc: str, iterations: int) -> argparse.Namespace:
    """The arguments of a benchmark that runs recipes: --iterations N, --write FILE (the section to replace)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=iterations)
    parser.add_argument("--write", type=Path, help="markdown file whose section is replaced")
    return parser.parse_args()


def publish(text: str, doc: Path | None, heading: str) -> int:
    """Print a benchmark's section and, given `doc`, replace it there."""
    if doc:
        write_section(doc, heading, text)
    print(text)
    return 0
