"""Where the time of a PPO / GRPO iteration goes on this machine, what weight sync costs against a plain memory
copy of the same bytes, and how iteration time grows with engines, learner ranks and answer length.

Each configuration is a real `rlhf-ray ppo` job in a fresh process on an embedded Ray (tiny random models, so
answers run to their length limit and every iteration does the same work); numbers are medians over the
iterations after the first. Compute parts are measured inside the actors: engine generation, the slowest
experience role (policy / reference / critic / reward run in parallel), the slowest learner's PPO epochs, and
the learner's gather plus the slowest engine's load for weight sync. Orchestration overhead = iteration wall time
minus those parts (scheduling, object-store transfers, the driver's waits).

Run: python benchmarks/bench_iteration.py [--write docs/benchmarks.md] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, pyplot, run_job, save_figure, steady, today, versions, write_section  # noqa: E402,E501

SECTION = "## PPO iterations: where the time goes"
CONFIG = ROOT / "configs/quickstart/ppo.yaml"
PARTS = [("generation", "time/engine_generate"), ("experience", "compute/experience_seconds"),
         ("training", "compute/train_seconds"), ("weight sync", "compute/sync_seconds")]


def base(model: Path, out: Path, iterations: int, new_tokens: int) -> list[str]:
    return [f"policy.model.path={model}", f"reward.model.path={model}", f"output_dir={out}",
            f"ppo.iterations={iterations}", "ppo.eval_prompts=0", "ppo.rollout_batch_size=32",
            f"generation.sampling.max_new_tokens={new_tokens}", "generation.engine=hf",
            "policy.placement.threads=2", "reference.placement.threads=2", "critic.placement.threads=2",
            "reward.placement.threads=2", "generation.placement.threads=2", "checkpoint.every_steps=0"]


GRPO = ["ppo.advantage_estimator=grpo", "critic=null", "generation.sampling.n_samples_per_prompt=4",
        "ppo.rollout_batch_size=8", "reward.model.path=null", "reward.function=rlhf_ray.data.demo_sort:score",
        "reward.placement.colocate_with=policy", "reward.placement.num_cpus=0.1"]


def breakdown(rows: list[dict]) -> dict:
    wall = steady(rows, "time/iteration")
    parts = {name: steady(rows, key) for name, key in PARTS}
    return {"wall": wall, **parts, "overhead": max(0.0, wall - sum(parts.values())),
            "sync_bytes": steady(rows, "sync/bytes")}


def between_calls(timeline: Path) -> dict:
    """Where orchestration goes, from Ray's timeline of a run (logging.timeline): per iteration (from one rollout
    call's start to the next's, the first two left out), the actor calls made, the time no actor call was running
    (the driver's waits and Ray's scheduling between calls) and the time calls spent reading their arguments and
    storing their results (object-store transfers). Medians over iterations."""
    import json
    import statistics

    events = [e for e in json.loads(timeline.read_text()) if e.get("ph") == "X"]
    calls = sorted((e for e in events if not e["name"].startswith(("task:", "submit_task", "__"))),
                   key=lambda e: e["ts"])
    transfers = [e for e in events if e["name"] in ("task:deserialize_arguments", "task:store_outputs")]
    starts = [e["ts"] for e in calls if e["name"] == "rollout"]
    rows = []
    for lo, hi in zip(starts[2:], starts[3:]):
        inside = [(e["ts"], min(hi, e["ts"] + e["dur"])) for e in calls if lo <= e["ts"] < hi]
        busy, reach = 0.0, lo
        for start, end in inside:  # the union of the calls' intervals
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        moved = sum(e["dur"] for e in transfers if lo <= e["ts"] < hi)
        rows.append({"calls": len(inside), "idle": (hi - lo - busy) / 1e6, "transfers": moved / 1e6})
    return {key: statistics.median(r[key] for r in rows) for key in ("calls", "idle", "transfers")} if rows else {}


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Best time of one in-memory copy of nbytes (torch clone of a flat buffer): the machine's bound for moving
    the weights once."""
    import torch

    src = torch.empty(int(nbytes), dtype=torch.uint8)
    src.fill_(1)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst = src.clone()
        best = min(best, time.perf_counter() - t)
        del dst
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="markdown file whose section is replaced")
    parser.add_argument("--quick", action="store_true", help="fewer iterations and configurations")
    args = parser.parse_args()
    iterations = 3 if args.quick else 6
    from rlhf_ray.models.tiny import build_tiny_model

    results: dict = {"runs": {}, "sync": [], "scaling": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = {size: build_tiny_model(tmp / size, preset=size) for size in ("tiny", "small")}

        def job(name: str, model: str, extra: list[str], new_tokens: int = 32) -> list[dict]:
            t = time.perf_counter()
            summary, rows = run_job("ppo", CONFIG, base(models[model], tmp / name, iterations, new_tokens) + extra)
            print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
            results["transport"] = summary["weight_sync"]
            return rows

        results["runs"]["PPO (GAE, critic)"] = breakdown(job("ppo", "tiny", []))
        results["runs"]["GRPO (4 samples/prompt, reward function)"] = breakdown(job("grpo", "tiny", GRPO + [
            "logging.timeline=true"]))
        results["between_calls"] = between_calls(tmp / "grpo" / "timeline.json")
        for size in ("tiny", "small"):
            for engines in (1, 2):
                rows = job(f"sync-{size}-{engines}", size, GRPO + [f"generation.placement.replicas={engines}",
                                                                   "generation.placement.num_cpus=0.25",
                                                                   f"generation.placement.threads={2 // engines}"], 16)
                nbytes = steady(rows, "sync/bytes")
                results["sync"].append({"model": size, "engines": engines, "bytes": nbytes,
                                        "sync": steady(rows, "time/sync"),
                                        "gather": steady(rows, "sync/gather_seconds"),
                                        "load": steady(rows, "sync/load_seconds"),
                                        "memcpy": memcpy_seconds(nbytes)})
        grid = [(1, 1, 32), (2, 1, 32), (1, 2, 32), (2, 2, 32), (1, 1, 16), (1, 1, 64)]
        if args.quick:
            grid = grid[:2]
        for engines, ranks, new_tokens in grid:
            rows = job(f"scale-{engines}-{ranks}-{new_tokens}", "tiny", GRPO + [
                f"generation.placement.replicas={engines}", "generation.placement.num_cpus=0.25",
                f"generation.placement.threads={2 // engines}", f"policy.placement.replicas={ranks}",
                "policy.placement.num_cpus=0.25", f"policy.placement.threads={2 // ranks}",
                f"policy.micro_batch_size={32 // ranks}",
                "reference.placement.num_cpus=0.2", "reward.placement.num_cpus=0.05"], new_tokens)
            results["scaling"].append({"engines": engines, "ranks": ranks, "new_tokens": new_tokens,
                                       **breakdown(rows)})
    text = render(results, args, iterations)
    if args.write:
        text += plot(results, args.write)
        write_section(args.write, SECTION, text)
    print(text)
    return 0


def plot(results: dict, doc: Path) -> str:
    """Stacked bars: one per iteration kind, one segment per part."""
    plt = pyplot()
    if plt is None:
        return ""
    names = list(results["runs"])
    fig, ax = plt.subplots(figsize=(7, 2.2 + 0.4 * len(names)))
    left = [0.0] * len(names)
    for part in [p for p, _ in PARTS] + ["overhead"]:
        widths = [results["runs"][n][part] for n in names]
        ax.barh(names, widths, left=left, label="orchestration" if part == "overhead" else part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds per iteration (median)")
    ax.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    return "\n" + save_figure(fig, doc, "iteration_breakdown.png") + "\n"


def _x(ratio: float) -> str:
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def render(results: dict, args, iterations: int) -> str:
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'deepspeed', 'transformers')}. Date: {today()}.", "",
             f"Command: `python benchmarks/bench_iteration.py{' --quick' if args.quick else ''} --write "
             f"docs/benchmarks.md`. Tiny random Llama (0.5M parameters) unless said, configs/quickstart/ppo.yaml "
             f"with every role on the same 2 cores (sync mode: roles take turns; each role's replicas share 2 threads), hf "
             f"engines, "
             f"32 prompts x 32 new tokens (GRPO: 8 prompts x 4 samples), {iterations} iterations, medians of "
             f"iterations 2-{iterations}.", "",
             "| iteration | wall s | generation s | experience s | training s | weight sync s | orchestration s | "
             "orchestration % |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results["runs"].items():
        lines.append(f"| {name} | {r['wall']:.2f} | {r['generation']:.2f} | {r['experience']:.2f} | "
                     f"{r['training']:.2f} | {r['weight sync']:.3f} | {r['overhead']:.2f} | "
                     f"{100 * r['overhead'] / r['wall']:.0f}% |")
    how = {"ipc": "policy rank 0 hands over where its weights lie in shared memory; every engine loads them from "
                  "there", "object_store": "policy rank 0 gathers and puts the buckets in the object store; every "
                  "engine fetches and loads them"}.get(results.get("transport"), results.get("transport"))
    lines += ["", f"**Weight sync** (transport auto, here {results.get('transport')}: {how}) against one "
              "in-memory copy of the same bytes:", "",
              "| model | engines | MB | sync s | learner s | engines' load s | memcpy s | sync / memcpy |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["sync"]:
        lines.append(f"| {r['model']} | {r['engines']} | {r['bytes'] / 2**20:.1f} | {r['sync']:.3f} | "
                     f"{r['gather']:.3f} | {r['load']:.3f} | {r['memcpy']:.4f} | {r['sync'] / r['memcpy']:.0f}x |")
    lines += ["", "**Scaling** (GRPO, tiny model): iteration time against engines, policy ranks and answer length.",
              "", "| engines | policy ranks | new tokens | wall s | generation s | training s | orchestration % |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["scaling"]:
        lines.append(f"| {r['engines']} | {r['ranks']} | {r['new_tokens']} | {r['wall']:.2f} | {r['generation']:.2f} "
                     f"| {r['training']:.2f} | {100 * r['overhead'] / r['wall']:.0f}% |")
    overheads = {name: 100 * r["overhead"] / r["wall"] for name, r in results["runs"].items()}
    ratios: dict[str, list[float]] = {}
    for r in results["sync"]:
        ratios.setdefault(f"{r['model']} ({r['bytes'] / 2**20:.0f} MB)", []).append(r["sync"] / r["memcpy"])
    calls = results.get("between_calls") or {}
    lines += ["", "Goals:", "- orchestration under 10% of an iteration: " + "; ".join(
        f"{name.split(' (')[0]} {o:.0f}% ({'met' if o < 10 else 'missed'})" for name, o in overheads.items()) + ".",
        "- orchestration under 3% on the tiny GRPO (issue 38): " + "; ".join(
        f"{o:.0f}% ({'met' if o < 3 else 'missed'})" for name, o in overheads.items() if name.startswith("GRPO"))
        + ".",
        "- weight sync within 3x of the memory-copy bound: " + "; ".join(
        f"{model} {_x(min(v))}-{_x(max(v))} ({'met' if max(v) <= 3 else 'missed'})" for model, v in ratios.items())
        + ".",
        "", "Where a goal is missed, why: a tiny iteration is a few tens of milliseconds of compute, so the fixed "
        "cost of the calls between actors is a visible share of it; with the 26M model of the TRL comparison it is "
        "under 1% (`time/orchestration_fraction`). The share also moves with the compute around it: compare it "
        "within one run of this script, not across machines (the experience step alone, reference and policy "
        "forwards at once with 2 threads each on 2 cores, took 0.09 s per GRPO iteration on an AMD EPYC and "
        "0.31 s on an Intel Xeon)."]
    if calls:
        lines[-1] += (f" Ray's timeline of the GRPO run (`logging.timeline: true`; median iteration): "
                      f"{calls['calls']:.0f} actor calls, most of them one after the other (rollout, batch, the "
                      f"scoring roles at once, experience, buffer put and take, train, handoff, engine load); "
                      f"{1e3 * calls['idle']:.0f} ms with no call running (the driver noticing a result and "
                      f"sending the next call, Ray scheduling it: ~1-2 ms a step on these 2 shared cores) and "
                      f"{1e3 * calls['transfers']:.0f} ms inside calls reading arguments and storing results.")
    lines[-1] += (" Already cut (issue 38): the buffer's put is answered at the next take (one wait for both), "
                  "the weight handoff's last part says so and the call that frees it is not waited for, and the "
                  "experience assembler's packing counts as compute. What would close the rest: fewer processes "
                  "on the critical path, e.g. the reference forward, the reward function and the experience "
                  "assembly in the policy's own process (as veRL's fused workers do), which matters little once "
                  "the model is worth distributing. Likewise a sync of 2 MB is latency, not bandwidth: its "
                  "few ms are calls, against a 0.1 ms copy; at 100 MB the sync is within the bound.")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
