"""Soak: a long async PPO run on the tiny quickstart models, watched from outside. Every process of the job's tree
(grouped by what it is: the driver, each role's actor, Ray's own daemons) is sampled for its unique memory (USS)
every few seconds, and the object store's usage is read from the job's Prometheus endpoint. Reported: memory at
the start and end of the measured span and the least-squares slope per 100 iterations (after a warm-up), actor
restarts and stale-experience refusals from the job's own metrics.

    python benchmarks/bench_soak.py [--iterations 500] [--write benchmarks/HISTORY.md]

Needs the quickstart's SFT and reward models (outputs/quickstart/{sft,rm}/model); builds them with
`rlhf-ray quickstart --pipeline` when missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, pyplot, save_figure, today, versions, write_section  # noqa: E402

SECTION = "## Soak: a long async PPO run, memory per process"
QUICKSTART = ROOT / "outputs" / "quickstart"
OUT = ROOT / "outputs" / "bench_soak"
WARMUP = 50
"""Iterations before the slope is measured (first allocations, caches filling, the first checkpoint)."""


def ensure_models() -> None:
    if all((QUICKSTART / stage / "model" / "config.json").is_file() for stage in ("sft", "rm")):
        return
    print("building the quickstart models (rlhf-ray quickstart --pipeline) ...", flush=True)
    subprocess.run([sys.executable, "-m", "rlhf_ray.cli", "quickstart", "--pipeline"], cwd=ROOT, check=True,
                   env={**_env(), "RLHF_RAY_LOG_LEVEL": "WARNING"})


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def process_kind(proc: psutil.Process) -> str:
    """What a process of the job's tree is: 'ray::PolicyLearner', 'raylet', 'gcs_server', 'driver', ..."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "?"
    head = cmd[0] if cmd else proc.name()
    if head.startswith("ray::"):
        return head.split()[0].split(".")[0]
    if "rlhf_ray.cli" in cmd:
        return "driver"
    for part in cmd[:3]:
        for known in ("raylet", "gcs_server", "dashboard", "agent", "log_monitor", "monitor", "runtime_env"):
            if known in Path(part).name:
                return Path(part).name.removesuffix(".py")
    return Path(head).name


def memory_by_kind(root: psutil.Process) -> dict[str, float]:
    """MiB of unique memory (pages no other process shares) per kind of process, summed over processes of a kind."""
    total: dict[str, float] = defaultdict(float)
    for proc in [root, *root.children(recursive=True)]:
        try:
            total[process_kind(proc)] += proc.memory_full_info().uss / 2**20
        except psutil.Error:
            pass
    return dict(total)


def object_store_mib(port: int) -> float | None:
    """Bytes held by Ray's object store (all locations: shared memory, spilled, fallback), from Prometheus."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    values = [float(m.group(1)) for m in re.finditer(r"^ray_object_store_memory\{[^}]*\} ([0-9.e+]+)$", text, re.M)]
    return sum(values) / 2**20 if values else None


def steps_done(metrics: Path) -> tuple[int, dict]:
    if not metrics.exists():
        return 0, {}
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "policy_version" in r]
    return len(steps), (steps[-1] if steps else {})


def slope_per_100(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of value against iteration, per 100 iterations."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 100 * sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else float("nan")


def soak(iterations: int, every_s: float) -> dict:
    from rlhf_ray.cluster import free_port

    ensure_models()
    out, port = OUT / "ppo", free_port()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    overrides = [f"output_dir={out}", "ppo.mode=async", f"ppo.iterations={iterations}", "ppo.eval_prompts=16",
                 "checkpoint.every_steps=100", "checkpoint.keep_last=2", f"cluster.metrics_export_port={port}",
                 "cluster.dashboard=false", "logging.progress=false", "logging.tensorboard=false"]
    command = [sys.executable, "-m", "rlhf_ray.cli", "ppo", "--config", "configs/quickstart/ppo.yaml"]
    for item in overrides:
        command += ["--set", item]
    OUT.mkdir(parents=True, exist_ok=True)
    samples, start = [], time.perf_counter()
    with open(OUT / "job.log", "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env={**_env(), "RLHF_RAY_LOG_LEVEL": "INFO"}, stdout=log,
                                stderr=log)
        root, shown = psutil.Process(proc.pid), -1
        while proc.poll() is None:
            done, _ = steps_done(out / "metrics.jsonl")
            samples.append({"iteration": done, "t": time.perf_counter() - start, "memory": memory_by_kind(root),
                            "object_store": object_store_mib(port)})
            if done // 25 != shown // 25:
                print(f"  iteration {done}/{iterations}, {samples[-1]['t'] / 60:.1f} min", flush=True)
                shown = done
            time.sleep(every_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the soak job failed (exit {proc.returncode}); see {OUT / 'job.log'}")
    done, last = steps_done(out / "metrics.jsonl")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = {"iterations": done, "minutes": (time.perf_counter() - start) / 60, "samples": samples,
              "restarts": last.get("actors/restarts"), "learner_restarts": last.get("actors/learner_restarts"),
              "refused_stale": max((r.get("buffer/refused_stale", 0) for r in rows), default=0),
              "max_staleness_seen": max((r.get("experience/staleness", 0) for r in rows), default=0)}
    (OUT / "soak.json").write_text(json.dumps(result))
    return result


def report(result: dict, doc: Path, iterations: int) -> None:
    measured = [s for s in result["samples"] if WARMUP <= s["iteration"] < result["iterations"]]
    kinds = sorted({k for s in measured for k in s["memory"]})
    lines = [SECTION, "",
             f"Measured {today()} by `python benchmarks/bench_soak.py --iterations {iterations}` on {machine()}; "
             f"{versions('torch', 'ray', 'deepspeed', 'transformers', 'vllm')}.", "",
             f"`configs/quickstart/ppo.yaml` (the tiny quickstart models) with `ppo.mode=async`, {result['iterations']} "
             f"iterations in {result['minutes']:.1f} min, a checkpoint every 100. Every process of the job's tree "
             f"sampled for its unique memory (USS) and the object store read from the job's Prometheus endpoint "
             f"(`ray_object_store_memory`) every few seconds; slope: least squares against the iteration, from "
             f"iteration {WARMUP} on ({len(measured)} samples). Processes of one kind are summed.", "",
             "| process | MiB at iteration %d | MiB at the end | slope MiB / 100 iterations |" % WARMUP,
             "|---|---:|---:|---:|"]
    series = {k: [(s["iteration"], s["memory"].get(k, 0.0)) for s in measured] for k in kinds}
    series["object store"] = [(s["iteration"], s["object_store"]) for s in measured if s["object_store"] is not None]
    series["all processes"] = [(s["iteration"], sum(s["memory"].values())) for s in measured]
    for name, points in series.items():
        if not points:
            lines.append(f"| {name} | - | - | - |")
            continue
        lines.append(f"| {name} | {points[0][1]:.0f} | {points[-1][1]:.0f} | {slope_per_100(points):+.1f} |")
    lines += ["", f"Actor restarts: {result['restarts']}; learner restarts: {result['learner_restarts']}; "
                  f"stale experience refused: {result['refused_stale']} (largest staleness trained on: "
                  f"{result['max_staleness_seen']})."]
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, points in series.items():
            if points and name != "all processes":
                ax.plot([x for x, _ in points], [y for _, y in points], label=name)
        ax.set_xlabel("iteration")
        ax.set_ylabel("MiB")
        ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=2)
        ax.set_title("Async PPO soak: memory per kind of process")
        lines += ["", save_figure(fig, doc, "soak.png")]
    write_section(doc, SECTION, "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--write", type=Path, help="markdown file whose soak section is replaced")
    parser.add_argument("--report-only", action="store_true", help=f"re-report {OUT / 'soak.json'}")
    args = parser.parse_args()
    result = json.loads((OUT / "soak.json").read_text()) if args.report_only else soak(args.iterations, args.every)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.write:
        report(result, args.write, args.iterations)


if __name__ == "__main__":
    main()
