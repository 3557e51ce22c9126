"""The same GRPO job with TRL's GRPOTrainer and with rlhf-ray, side by side in one run: same model, prompts,
reward function, number of samples, batch sizes, answer length, learning rate and KL coefficient.

Work per step on both sides: 4 prompts of the demo/sort task x 4 sampled answers of up to `--new-tokens` tokens
(temperature 1), the rule reward `rlhf_ray.data.demo_sort:score`, reference log-probs for a KL term (TRL
beta = rlhf-ray ppo.kl_coef, k3 in the loss on both sides), group-normalised advantages, one optimizer step on the 16 answers. TRL runs in one
process (transformers `generate`, gradient checkpointing off as ours); rlhf-ray runs its actor groups on an
embedded Ray over the same cores. Time per step = median over steps 2..N (step 1 pays one-time warm-up).

Needs the bench extra: RLHF_RAY_EXTRAS=cpu,test,bench bash scripts/setup.sh
Run: python benchmarks/bench_trl.py [--write benchmarks/HISTORY.md] [--quick]
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
from common import ROOT, machine, run_job, steady, today, trl_step_timer, versions, write_section  # noqa: E402

SECTION = "## GRPO against TRL"
PROMPTS, SAMPLES, LR, KL = 4, 4, 1e-5, 0.04


def trl_child(model_dir: str, prompts_file: str, steps: int, new_tokens: int) -> dict:
    """One TRL GRPOTrainer run in this process; per-step wall times."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_ray.data.demo_sort import score

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    prompts = json.loads(Path(prompts_file).read_text())

    def reward(prompts, completions, **_):
        return score(prompts, completions)

    marks: list[float] = []

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES,
                            max_completion_length=new_tokens, learning_rate=LR, beta=KL, max_steps=steps,
                            num_iterations=1, temperature=1.0, use_cpu=True, bf16=False, gradient_checkpointing=False,
                            logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_dropout=True,
                            dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=config,
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[trl_step_timer(marks)])
        trainer.train()
    import trl

    return {"step_seconds": [b - a for a, b in zip(marks, marks[1:])], "trl": trl.__version__}


def run_trl(model_dir: Path, prompts_file: Path, steps: int, new_tokens: int) -> dict:
    command = [sys.executable, __file__, "--child", str(model_dir), str(prompts_file), str(steps), str(new_tokens)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"TRL run failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def run_ours(model_dir: Path, out: Path, steps: int, new_tokens: int, engine: str) -> list[dict]:
    overrides = [f"policy.model.path={model_dir}", "reward.model.path=null", f"output_dir={out}",
                 "reward.function=rlhf_ray.data.demo_sort:score", "reward.placement.colocate_with=policy",
                 "reward.placement.num_cpus=0.1", "critic=null", "ppo.advantage_estimator=grpo",
                 f"ppo.rollout_batch_size={PROMPTS}", f"generation.sampling.n_samples_per_prompt={SAMPLES}",
                 f"generation.sampling.max_new_tokens={new_tokens}", f"ppo.iterations={steps}", "ppo.eval_prompts=0",
                 f"ppo.kl_coef={KL}", "ppo.kl_in_loss=true", "ppo.kl_estimator=k3", f"policy.optim.lr={LR}",
                 "policy.micro_batch_size=16",
                 f"generation.engine={engine}", "generation.vllm.max_model_len=256", "checkpoint.every_steps=0",
                 "policy.deepspeed.zero_stage=0", "policy.placement.threads=2", "reference.placement.threads=2",
                 "reward.placement.threads=2",
                 "generation.placement.threads=2"]
    _, rows = run_job("ppo", ROOT / "configs/quickstart/ppo.yaml", overrides)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="markdown file whose section is replaced")
    parser.add_argument("--quick", action="store_true", help="fewer steps, the tiny model only")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_dir, prompts_file, steps, new_tokens = args.child
        print(json.dumps(trl_child(model_dir, prompts_file, int(steps), int(new_tokens))))
        return 0
    steps = 4 if args.quick else 8
    cases = [("tiny", 32)] if args.quick else [("tiny", 32), ("small", 128)]
    from transformers import AutoTokenizer

    from rlhf_ray.models.support import model_parameters
    from rlhf_ray.config.data import DataSpec
    from rlhf_ray.data.build import build_phase_data
    from rlhf_ray.models.tiny import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for preset, new_tokens in cases:
            model = build_tiny_model(tmp / preset, preset=preset)
            data = build_phase_data(DataSpec(), AutoTokenizer.from_pretrained(model), "ppo", 1234, tmp / "cache")
            prompts_file = tmp / "prompts.json"
            prompts_file.write_text(json.dumps([r["prompt"] for r in data.train[: PROMPTS * steps * 2]]))
            t = time.perf_counter()
            trl = run_trl(model, prompts_file, steps, new_tokens)
            print(f"{preset} trl: {time.perf_counter() - t:.0f} s", flush=True)
            row = {"model": preset, "params": model_parameters(str(model)), "new_tokens": new_tokens,
                   "trl": statistics.median(trl["step_seconds"][1:]), "trl_version": trl["trl"]}
            for engine in ("hf", "vllm"):
                t = time.perf_counter()
                metrics = run_ours(model, tmp / f"{preset}-{engine}", steps, new_tokens, engine)
                print(f"{preset} ours ({engine}): {time.perf_counter() - t:.0f} s", flush=True)
                row[engine] = steady(metrics, "time/iteration")
                row[f"{engine}_generation"] = steady(metrics, "time/engine_generate")
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = render(rows, args, steps)
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)
    return 0


def render(rows: list[dict], args, steps: int) -> str:
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions('torch', 'ray', 'transformers', 'trl', 'vllm')}. Date: {today()}.", "",
             f"Command: `python benchmarks/bench_trl.py{' --quick' if args.quick else ''} --write benchmarks/HISTORY.md`. "
             f"Per step: {PROMPTS} demo/sort prompts x {SAMPLES} answers, rule reward, KL {KL} to a reference "
             f"model (k3, in the loss: GRPO as TRL runs it), one optimizer step (lr {LR}), fp32, {steps} steps, median of steps 2-{steps}. rlhf-ray: "
             "policy (DeepSpeed, 1 rank, ZeRO stage 0: nothing to partition), reference, reward-function and generation actors on an embedded "
             "Ray, sync mode, every role 2 threads.", "",
             "| model | new tokens | TRL GRPOTrainer s/step | rlhf-ray hf engine s/step (generation) | TRL / ours | "
             "rlhf-ray vLLM engine s/step (generation) | TRL / ours |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['params'] / 1e6:.1f}M) | {r['new_tokens']} | {r['trl']:.2f} | "
                     f"{r['hf']:.2f} ({r['hf_generation']:.2f}) | {r['trl'] / r['hf']:.2f}x | "
                     f"{r['vllm']:.2f} ({r['vllm_generation']:.2f}) | {r['trl'] / r['vllm']:.2f}x |")
    best = {r["model"]: max(r["trl"] / r["hf"], r["trl"] / r["vllm"]) for r in rows}
    lines += ["", "Goal: the GRPO job faster than TRL's on the same work (TRL / ours > 1x): " + "; ".join(
        f"{model} {ratio:.2f}x with the faster engine ({'met' if ratio > 1 else 'missed'})"
        for model, ratio in best.items()) + ".", "",
        "Why and what would close it: TRL runs the step in one process; ours moves the rollout through five actors "
        "(engine, experience, reference, reward, policy) and the weights back to the engine, a fixed ~0.1 s per "
        "step that the tiny model's ~0.1 s of compute cannot hide. Once compute dominates (the 26M model), the "
        "vLLM engine's faster sampling and the skipped old-log-prob forward (`ppo.kl_in_loss`, one on-policy step) "
        "put us ahead; with the hf engine we generate with the same `generate` as TRL and also pay the reference "
        "forward in a second process competing for the same two cores. Closing the tiny-model gap would take fewer "
        "actor round trips per step (chaining experience, buffer and training in one call); on machines where each "
        "role has its own devices the roles also run in parallel, which one shared CPU cannot show.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
