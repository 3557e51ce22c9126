"""GRPO with the reward served over HTTP: configs/quickstart/grpo-http.yaml as shipped, its rule (demo/sort) behind
the reference reward server on 127.0.0.1, 3 seeds; held-out accuracy before -> after and wall time.

    python benchmarks/bench_grpo_http.py --write benchmarks/HISTORY.md

Needs the pipeline quickstart's SFT model (`bash scripts/quickstart.sh --pipeline` makes it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, machine, run_job, today, versions, write_section  # noqa: E402
from rlhf_ray.data.demo_sort import score  # noqa: E402
from rlhf_ray.reward_server import make_server  # noqa: E402

CONFIG = ROOT / "configs/quickstart/grpo-http.yaml"
HEADING = "## GRPO with a reward server (tiny model)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="1234,2,3")
    parser.add_argument("--workdir", default="/tmp/bench_grpo_http")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    server = make_server(score, port=8000)  # the port the config names
    import threading

    threading.Thread(target=server.serve_forever, daemon=True).start()
    rows = []
    try:
        for seed in args.seeds.split(","):
            summary, _ = run_job("ppo", CONFIG, [f"seed={seed}", f"output_dir={args.workdir}/seed-{seed}",
                                                 "checkpoint.resume=false"])
            rows.append((seed, summary))
            print(seed, summary, flush=True)
    finally:
        server.shutdown()
    lines = [HEADING, "",
             f"{today()}; {machine()}; {versions('torch', 'ray', 'deepspeed', 'transformers')}.",
             f"Command: `python benchmarks/bench_grpo_http.py --write benchmarks/HISTORY.md` (`{CONFIG.relative_to(ROOT)}` "
             "as shipped: the pipeline quickstart's SFT model, demo/sort's rule served by `rlhf_ray.reward_server` "
             "on 127.0.0.1, 100 iterations of 16 prompts x 4 answers; 64 held-out prompts, 4 samples each).", "",
             "| seed | greedy accuracy | sampled accuracy | job seconds |", "|---|---|---|---|"]
    for seed, s in rows:
        lines.append(f"| {seed} | {s['task_accuracy_before']:.3f} -> {s['task_accuracy_after']:.3f} | "
                     f"{s['sampled_task_accuracy_before']:.3f} -> {s['sampled_task_accuracy_after']:.3f} | "
                     f"{s['seconds']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(args.write, HEADING, text)


if __name__ == "__main__":
    main()
