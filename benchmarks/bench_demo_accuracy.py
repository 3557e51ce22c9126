"""What PPO does to the demo task's accuracy: the quickstart pipeline's policy after PPO with the quickstart reward
model, a stronger reward model and the rule itself as the reward, at the quickstart's and at larger learning rates,
with both engines. Each policy is scored on held-out prompts greedily and by sampling (the distribution PPO
optimises), and its answers of the wrong length are counted (the reward models' blind spot).

    .venv/bin/python benchmarks/bench_demo_accuracy.py [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, run_job, today, versions, write_section  # noqa: E402

HEADING = "## PPO on the demo task: greedy and sampled accuracy"
QUICK = ROOT / "configs/quickstart"
PROMPTS, SAMPLES = 200, 16
RULE = ["reward.model.path=null", "reward.function=rlhf_ray.data.demo_sort:score"]
STRONGER = ["policy.optim.lr=2e-4", "critic.optim.lr=1e-3"]
GRPO = ["critic=null", "reward.placement.colocate_with=policy", "ppo.advantage_estimator=grpo",
        "generation.sampling.n_samples_per_prompt=4", "ppo.rollout_batch_size=16", "policy.micro_batch_size=64",
        "ppo.iterations=60", "policy.optim.lr=1e-3"]
# (reward, which reward model, PPO change, its overrides, engine)
RUNS = [("quickstart reward model", "rm", "none", [], "hf"),
        ("quickstart reward model", "rm", "none", [], "vllm"),
        ("quickstart reward model", "rm", "policy lr 2e-4, critic lr 1e-3", STRONGER, "hf"),
        ("reward model from the SFT model, 4 epochs", "rm_sft", "none", [], "hf"),
        ("reward model from the SFT model, 4 epochs", "rm_sft", "policy lr 2e-4, critic lr 1e-3", STRONGER, "hf"),
        ("reward model from the SFT model, 4 epochs", "rm_sft", "policy lr 2e-4, critic lr 1e-3", STRONGER, "vllm"),
        ("rule", None, "none", RULE, "hf"),
        ("rule", None, "policy lr 2e-4, critic lr 1e-3", RULE + STRONGER, "hf"),
        ("rule, GRPO", None, "16 prompts x 4 answers, 60 iterations, lr 1e-3", RULE + GRPO, "hf")]


def score_policy(path: Path) -> dict:
    """Greedy and sampled (T = 1) rule accuracy on the first PROMPTS held-out demo/sort prompts, and the share of
    greedy answers with a wrong number of digits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ray.data import demo_sort

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = [demo_sort.prompt_of(s) for s in demo_sort.split_sequences()[1][:PROMPTS]]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    start = batch.input_ids.shape[1]
    torch.manual_seed(0)
    with torch.no_grad():
        greedy = model.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        sampled = model.generate(**batch, max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0,
                                 num_return_sequences=SAMPLES, pad_token_id=tokenizer.pad_token_id)
    greedy = tokenizer.batch_decode(greedy[:, start:], skip_special_tokens=True)
    sampled = tokenizer.batch_decode(sampled[:, start:], skip_special_tokens=True)
    return {"greedy": sum(map(demo_sort.check_answer, prompts, greedy)) / len(prompts),
            "sampled": sum(demo_sort.check_answer(prompts[i // SAMPLES], a) for i, a in enumerate(sampled)) / len(sampled),
            "wrong_length": sum(len(a.split()) != demo_sort.LENGTH for a in greedy) / len(prompts)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="replace this benchmark's section of the given markdown file")
    args = parser.parse_args()
    from rlhf_ray.models.tiny import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tiny = build_tiny_model(tmp / "tiny", seed=0)

        def stage(kind: str, name: str, *extra: str) -> tuple[dict, list[dict]]:
            return run_job(kind, QUICK / f"{kind}.yaml", [f"model.path={tiny}", f"output_dir={tmp / name}", *extra])

        stage("sft", "sft")
        sft = tmp / "sft/model"
        rms = {"rm": stage("rm", "rm")[0], "rm_sft": stage("rm", "rm_sft", f"model.path={sft}", "train.epochs=4")[0]}
        base = score_policy(sft)
        rows.append(("(the SFT policy, before PPO)", "", "", base, None, None))
        print("sft", base, flush=True)
        for i, (reward, rm, change, extra, engine) in enumerate(RUNS):
            rm_path = tmp / (rm or "rm_sft") / "model"  # the reward model, and the critic's start (also for the rule)
            overrides = [f"policy.model.path={sft}", f"reward.model.path={rm_path}", f"output_dir={tmp / f'ppo{i}'}",
                         f"critic.model.path={rm_path}", f"generation.engine={engine}", *extra]
            if engine == "vllm":
                overrides.append("generation.vllm.dtype=fp32")
            started = time.time()
            summary, _ = run_job("ppo", QUICK / "ppo.yaml", overrides)
            result = score_policy(tmp / f"ppo{i}/model")
            rm_gain = summary["reward_after"] - summary["reward_before"] if rm else None
            rows.append((reward, change, engine, result, rm_gain, time.time() - started))
            print(reward, change, engine, result, rm_gain, flush=True)
    text = render(rows, rms)
    print(text)
    if args.write:
        write_section(args.write, HEADING, text)
    return 0


def render(rows, rms) -> str:
    out = [HEADING, "", f"Machine: {machine()}. {versions('torch', 'ray', 'deepspeed', 'transformers', 'vllm')}. "
           f"Date: {today()}.", "",
           "Command: `python benchmarks/bench_demo_accuracy.py --write docs/benchmarks.md`. The quickstart's SFT "
           f"and PPO configs (seed 1234, 30 iterations) with what the second column changes; reward models: the "
           f"quickstart's (held-out pair accuracy {rms['rm']['eval_accuracy']:.2f}) and one trained from the SFT "
           f"model for 4 epochs ({rms['rm_sft']['eval_accuracy']:.2f}); with the rule as reward the critic starts "
           f"from the latter. Each policy answers the first {PROMPTS} held-out demo/sort prompts greedily and "
           f"{SAMPLES} times sampled at T = 1; wrong length = greedy answers without exactly 4 digits; RM gain = "
           "summary.json's held-out reward-model score after minus before.", "",
           "| reward | PPO change | engine | greedy accuracy | sampled accuracy | wrong length | RM gain | s |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for reward, change, engine, r, gain, seconds in rows:
        out.append(f"| {reward} | {change} | {engine} | {r['greedy']:.3f} | {r['sampled']:.3f} | "
                   f"{r['wrong_length']:.3f} | {'' if gain is None else f'{gain:+.3f}'} | "
                   f"{'' if seconds is None else f'{seconds:.0f}'} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
