"""Wall time and peak memory of the quickstart pipeline (SFT -> RM -> PPO on CPU), from a clean outputs folder.

Memory is the peak of the summed PSS of the whole process tree (the driver, the embedded Ray's processes and
every actor), sampled every 0.25 s. Run: python benchmarks/bench_quickstart.py [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, run_watched, write_section  # noqa: E402

SECTION = "## Quickstart pipeline: wall time and peak memory"


def run() -> dict:
    shutil.rmtree(ROOT / "outputs" / "quickstart", ignore_errors=True)
    log = ROOT / "outputs" / "quickstart.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        seconds, peak = run_watched([sys.executable, "-m", "rlhf_ray.cli", "quickstart"], log,
                                    env={"RLHF_RAY_LOG_LEVEL": "INFO"})
    except RuntimeError as failed:
        sys.exit(f"quickstart failed: {failed}\n{log.read_text()[-4000:]}")
    summary = json.loads((ROOT / "outputs" / "quickstart" / "summary.json").read_text())
    return {"seconds": seconds, "peak_pss_gib": peak, "summary": summary}


def render(result: dict) -> str:
    s = result["summary"]
    sft, rm, ppo = s["sft"], s["rm"], s["ppo"]
    versions = {m: __import__(m).__version__ for m in ("torch", "ray", "deepspeed", "transformers")}
    return "\n".join([
        SECTION, "",
        f"Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, {platform.platform()}. "
        + ", ".join(f"{k} {v}" for k, v in versions.items()) + f". Date: {datetime.date.today()}.", "",
        "Command: `python benchmarks/bench_quickstart.py --write docs/benchmarks.md` (runs `rlhf-ray quickstart` "
        "on configs/quickstart/ from an empty outputs/quickstart, tiny model already built or not).", "",
        "| measure | value | goal |", "|---|---:|---|",
        f"| wall time, SFT -> RM -> PPO | {result['seconds']:.0f} s | < 600 s |",
        f"| peak memory, whole process tree | {result['peak_pss_gib']:.2f} GiB | < 12 GiB |",
        f"| SFT eval loss | {sft['eval_loss_first']:.3f} -> {sft['eval_loss_last']:.3f} | lower |",
        f"| RM held-out pair accuracy | {rm['eval_accuracy_first']:.2f} -> {rm['eval_accuracy']:.2f} | > 0.5 |",
        *(f"| PPO held-out {what}, {how} | {ppo[f'{key}_before']:.3f} -> {ppo[f'{key}_after']:.3f} | {goal} |"
          for what, key in (("reward (RM score)", "reward"), ("task accuracy (rule)", "task_accuracy"))
          for how, key, goal in (("sampled", f"sampled_{key}", "higher"), ("greedy", key, "about the same"))),
        "", f"Sampled: {ppo['eval_prompts']} held-out prompts x `ppo.eval_samples` answers at the training temperature "
        "(what PPO optimises); greedy: the most likely answer to each. Why greedy accuracy hardly moves on this task: "
        "[docs/jobs.md](jobs.md), \"What to expect on the demo task\".",
        "", "Peak memory is the largest sum, sampled every 0.25 s, of the PSS of every process of the job (the "
        "driver, the embedded Ray's processes and every actor): pages shared between processes are split between "
        "them, not counted once per process.", ""])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="markdown file whose quickstart section is replaced")
    args = parser.parse_args()
    section = render(run())
    print(section)
    if args.write:
        write_section(args.write, SECTION, section)
