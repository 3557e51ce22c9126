"""How close the plan's memory prediction comes to what each role really holds: `rlhf-ray rehearse` on the SmolLM2
recipes (random weights in SmolLM2-135M's shape, every role on this machine's CPU), one row per role.

Each recipe runs as `rlhf-ray rehearse CONFIG --iterations N` in a fresh process; the numbers are its
rehearsal.json. Measured: the role's largest replica's peak resident set above what its process held before its
model; predicted: what `rlhf-ray validate` computes for that replica (device + host on CPU).

Run: python benchmarks/bench_rehearsal.py [--iterations N] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, publish, recipe_args, today, versions  # noqa: E402

SECTION = "## Rehearsal: plan against measured memory"
RECIPES = {"GRPO": ROOT / "configs/recipes/smollm2-grpo.yaml", "PPO (critic)": ROOT / "configs/recipes/smollm2-ppo.yaml"}
GOAL = 0.10


def rehearse(config: Path, out: Path, iterations: int) -> dict:
    command = [sys.executable, "-m", "rlhf_ray.cli", "rehearse", str(config), "--iterations", str(iterations),
               "--out", str(out), "--set", "cluster.dashboard=false", "--set", "logging.progress=false",
               "--set", "logging.tensorboard=false"]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "RLHF_RAY_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-4000:]}")
    print(proc.stdout, flush=True)
    return {**json.loads((out / "rehearsal.json").read_text()), "printed": proc.stdout}


def main() -> int:
    args = recipe_args(__doc__, iterations=3)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in RECIPES.items():
            t = time.perf_counter()
            results[name] = rehearse(config, Path(tmp) / name.split()[0], args.iterations)
            print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
    text = render(results, args)
    return publish(text, args.write, SECTION)


def render(results: dict, args) -> str:
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'deepspeed', 'transformers', 'vllm')}. "
             f"Date: {today()}.", "",
             f"Command: `python benchmarks/bench_rehearsal.py --iterations {args.iterations} --write "
             "docs/benchmarks.md`: `rlhf-ray rehearse` on each recipe as written (random weights in SmolLM2-135M's "
             "shape, fp32, every role on 2 cores). Measured: each role's largest replica's peak resident set above "
             "what its process held before its model; plan: what `validate` predicts for that replica (device + "
             "host). Error = (plan - measured) / measured.", "",
             "| recipe | role | plan GiB | measured GiB | error |", "|---|---|---:|---:|---:|"]
    errors = []
    for name, r in results.items():
        for role, m in r["memory_gib"].items():
            error = (m["plan"] - m["measured"]) / m["measured"] if m["plan"] is not None and m["measured"] else None
            errors.append((abs(error), f"{name} {role}") if error is not None else None)
            plan = "-" if m["plan"] is None else f"{m['plan']:.2f}"
            lines.append(f"| {name} | {role} | {plan} | {m['measured']:.2f} | "
                         f"{'-' if error is None else f'{error:+.0%}'} |")
    known = [e for e in errors if e is not None]
    within = sum(e <= GOAL for e, _ in known)
    worst = max(known, default=(float("nan"), "-"))
    lines += ["", f"Goal (issue 38): every role within {GOAL:.0%} of its measured peak: {within} of {len(known)} "
              f"({'met' if within == len(known) else 'missed'}; worst {worst[0]:.0%}, {worst[1]})."]
    for name, r in results.items():
        t = r["seconds"]
        lines.append(f"- {name}: iteration {t['iteration']:.1f} s (generation {t['generation']:.1f}, experience "
                     f"{t['experience']:.1f}, training {t['training']:.1f}, sync {t['sync']:.2f}; orchestration "
                     f"{r['orchestration_fraction']:.0%}); weight sync {r['sync_bytes'] / 1e6:.0f} MB by "
                     f"{r['transport']}.")
    lines += ["", *NOTES]
    return "\n".join(lines) + "\n"


NOTES = [
    "What the rows say (2026-11-27, CPU, fp32):",
    "- Learners of the PPO recipe (policy, critic: ZeRO-0, 8 rows per micro-batch) are within 10%.",
    "- The GRPO policy is predicted about 40% high: the plan sizes a micro-batch as micro_batch_size rows at the longest "
    "prompt plus answer (16 x 224 tokens), each running its own prompt; the run's prompts were shorter (~100 "
    "tokens) and GRPO's shared-prompt forward runs each prompt once for its 4 answers. For this recipe the plan "
    "is an upper bound, not an estimate; modelling the shared prompt would tighten it.",
    "- The reference is predicted 15-25% low: its forward holds more than the weights, activations and logits "
    "the model counts (not yet broken down).",
    "- The vLLM engine: the plan counts its weights twice (vLLM's CPU kernels re-lay every linear layer's weights "
    "for oneDNN and the process keeps the first layout's memory: measured alone, 1.99 GB above the runtime after "
    "start-up for 0.51 GB of weights and a 1 GiB cache) and `vllm.kv_cache_gb`. What is left is the weights in "
    "flight: during an ipc load the engine maps the policy's shared-memory file and reads every page of it "
    "(measured alone: +0.55 GB while loading from a mapped file), pages that are the policy's parameters, "
    "resident in both processes, not memory of the engine's own. The plan leaves them out so that a node's "
    "total stays right; on a GPU (CUDA IPC, the allocator's peak) they do not count.",
    "",
    "Rehearsal on a GPU (the CUDA allocator's peak, which holds no shared pages): the next section.",
]


if __name__ == "__main__":
    sys.exit(main())
