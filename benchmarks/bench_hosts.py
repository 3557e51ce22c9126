"""Weight sync and iteration time across two hosts against one host: the SmolLM2 GRPO recipe on a cluster of two
real hosts made on this machine (network namespaces with their own addresses, a Ray node of 2 CPUs in each:
tests/hosts.py; needs root and `ip`), side by side in one run of this script.

- one host, ipc: the engine colocated with the policy (one 2-CPU bundle), transport auto (ipc);
- one host, object store: the same placement, transport object_store;
- two hosts: the policy's bundle takes a whole host (policy 1.5 CPU), so the engine lands on the other host;
  transport auto (the object store, across hosts).
The hosts share this machine's 2 cores, so the network between them is a veth pair in memory: what the rows show
is what crossing hosts costs in Ray's transfer path (object store pull between raylets over TCP), not a real
network's bandwidth.

Run: python benchmarks/bench_hosts.py [--iterations N] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import ROOT, machine, publish, recipe_args, steady, today, versions  # noqa: E402
from tests.hosts import Hosts, unavailable  # noqa: E402

SECTION = "## Across hosts"
RECIPE = ROOT / "configs/recipes/smollm2-grpo.yaml"
RUNS = {"one host, ipc": ["generation.placement.colocate_with=policy"],
        "one host, object store": ["generation.placement.colocate_with=policy",
                                   "generation.weight_sync.transport=object_store"],
        "two hosts": ["policy.placement.num_cpus=1.5"]}


def main() -> int:
    args = recipe_args(__doc__, iterations=4)
    if (why := unavailable()) is not None:
        print(f"cannot make hosts here: {why}")
        return 1
    root = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RLHF_RAY_MODELS_DIR=str(root / "models"),
               PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
    hosts = Hosts(root, env)
    results = {}
    try:
        h1, h2 = hosts.add("h1"), hosts.add("h2")
        hosts.start_ray(h1, None, cpus=2)
        hosts.start_ray(h2, h1, cpus=2)
        shutil.copy(RECIPE, root / "grpo.yaml")
        for name, overrides in RUNS.items():
            out = root / "runs" / name.replace(" ", "-").replace(",", "")
            command = ["rlhf-ray", "ppo", "--config", "grpo.yaml"]
            for item in [f"output_dir={out}", f"ppo.iterations={args.iterations}", "ppo.eval_prompts=0",
                         "checkpoint.every_steps=0", "logging.progress=false", "logging.tensorboard=false",
                         *overrides]:
                command += ["--set", item]
            t = time.perf_counter()
            done = hosts.run(h1, command, cwd=root, env={"RAY_ADDRESS": f"{h1.address}:6379"}, timeout=3600)
            transport = next((line.split("weight sync: ", 1)[1] for line in (done.stdout + done.stderr).splitlines()
                              if "weight sync: " in line), "?")
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            results[name] = {"transport": transport, "sync": steady(rows, "time/sync"),
                             "bytes": steady(rows, "sync/bytes"), "load": steady(rows, "sync/load_seconds"),
                             "iteration": steady(rows, "time/iteration")}
            print(f"{name}: {time.perf_counter() - t:.0f} s, {results[name]}", flush=True)
    finally:
        hosts.close()
        shutil.rmtree(root, ignore_errors=True)
    return publish(render(results, args), args.write, SECTION)


def render(results: dict, args) -> str:
    base = results["one host, object store"]
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'deepspeed', 'vllm')}. Date: {today()}.", "",
             f"Command: `sudo python benchmarks/bench_hosts.py --iterations {args.iterations} --write "
             "docs/benchmarks.md`: configs/recipes/smollm2-grpo.yaml (ZeRO-0, fp32, one vLLM engine) on two hosts "
             "made on this machine (network namespaces joined by a bridge, a Ray node of 2 CPUs each, tests/hosts.py), "
             "no evaluation; medians of the iterations after the first. One host: the engine colocated with the policy; "
             "two hosts: the policy's bundle fills one host, the engine is on the other. The hosts share this "
             "machine's 2 cores and memory, so crossing hosts costs Ray's transfer between raylets (TCP over a veth "
             "pair), not a real network's bandwidth.", "",
             "| placement | transport chosen | MB | sync s | MB/s | engine load s | iteration s | sync vs one host, "
             "object store |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        mb = r["bytes"] / 1e6
        lines.append(f"| {name} | {r['transport']} | {mb:.0f} | {r['sync']:.2f} | {mb / r['sync']:.0f} | "
                     f"{r['load']:.2f} | {r['iteration']:.1f} | {r['sync'] / base['sync']:.2f}x |")
    two = results["two hosts"]
    lines += ["", f"Crossing hosts, the sync took {two['sync'] / base['sync']:.2f}x the one-host object store's time "
                  f"({two['sync']:.2f} against {base['sync']:.2f} s for {two['bytes'] / 1e6:.0f} MB), "
                  f"{two['sync'] / two['iteration']:.0%} of an iteration; the transport chosen without a setting "
                  "is in the second column, as the job logs it."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
