"""What PPO does to the demo task's accuracy: the quickstart pipeline (its reward model starts from the SFT model
and saw rejections of every kind: wrong order, a digit changed, a digit dropped or repeated) over three seeds with
each engine, longer runs that over-optimise the reward model, a reward model trained from the base model instead,
and the rule itself as the reward. Each policy is scored on all held-out prompts greedily and by sampling (the
distribution PPO optimises), with the share of sampled answers of the wrong length (a reward model's blind spot when
it never saw one rejected).

    .venv/bin/python benchmarks/bench_demo_accuracy.py [--write benchmarks/HISTORY.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, run_job, today, versions, write_section  # noqa: E402

HEADING = "## PPO on the demo task: greedy and sampled accuracy"
QUICK = ROOT / "configs/quickstart"
SAMPLES = 16
RULE = ["reward.model.path=null", "reward.function=rlhf_ray.data.demo_sort:score"]
VLLM = ["generation.engine=vllm", "generation.vllm.dtype=fp32"]
HF = ["generation.engine=hf"]
# (reward, which reward model, PPO change, its overrides)
RUNS = [("quickstart reward model", "rm", "none (seed 1234), hf", HF),
        ("quickstart reward model", "rm", "seed 1, hf", HF + ["seed=1"]),
        ("quickstart reward model", "rm", "seed 2, hf", HF + ["seed=2"]),
        ("quickstart reward model", "rm", "none (seed 1234), vllm", VLLM),
        ("quickstart reward model", "rm", "seed 1, vllm", VLLM + ["seed=1"]),
        ("quickstart reward model", "rm", "seed 2, vllm", VLLM + ["seed=2"]),
        ("quickstart reward model", "rm", "300 iterations, hf", HF + ["ppo.iterations=300"]),
        ("reward model from the base model, 2 epochs", "rm_base", "none, hf", HF),
        ("reward model from the base model, 2 epochs", "rm_base", "300 iterations, hf", HF + ["ppo.iterations=300"]),
        ("rule", None, "none, hf", HF + RULE),
        ("rule", None, "300 iterations, hf", HF + RULE + ["ppo.iterations=300"])]


def score_policy(path: Path) -> dict:
    """Greedy and sampled (T = 1) rule accuracy on every held-out demo/sort prompt, and the share of sampled answers
    with a wrong number of digits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ray.data import demo_sort

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = [demo_sort.prompt_of(s) for s in demo_sort.split_sequences()[1]]
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
            "wrong_length": sum(len(a.split()) != demo_sort.LENGTH for a in sampled) / len(sampled)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="replace this benchmark's section of the given markdown file")
    args = parser.parse_args()
    from rlhf_ray.models.tiny import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tiny = build_tiny_model(tmp / "tiny", seed=0)

        def stage(kind: str, name: str, *extra: str) -> dict:
            return run_job(kind, QUICK / f"{kind}.yaml", [f"output_dir={tmp / name}", *extra])[0]

        stage("sft", "sft", f"model.path={tiny}")
        sft = tmp / "sft/model"
        rms = {"rm": stage("rm", "rm", f"model.path={sft}"),
               "rm_base": stage("rm", "rm_base", f"model.path={tiny}", "train.epochs=2")}
        rows.append(("(the SFT policy, before PPO)", "", score_policy(sft), None, None))
        print(rows[-1], flush=True)
        for i, (reward, rm, change, extra) in enumerate(RUNS):
            rm_path = tmp / (rm or "rm") / "model"  # the reward model, and the critic's start (also for the rule)
            overrides = [f"policy.model.path={sft}", f"reward.model.path={rm_path}", f"output_dir={tmp / f'ppo{i}'}",
                         f"critic.model.path={rm_path}", *extra]
            started = time.time()
            summary, _ = run_job("ppo", QUICK / "ppo.yaml", overrides)
            rm_gain = summary["reward_after"] - summary["reward_before"] if rm else None
            rows.append((reward, change, score_policy(tmp / f"ppo{i}/model"), rm_gain, time.time() - started))
            print(rows[-1], flush=True)
    text = render(rows, rms)
    print(text)
    if args.write:
        write_section(args.write, HEADING, text)
    return 0


def render(rows, rms) -> str:
    from rlhf_ray.config import load_job
    from rlhf_ray.data import demo_sort

    ppo = load_job(QUICK / "ppo.yaml")
    base = rows[0][2]
    quick = [r[2] for r in rows if r[0] == "quickstart reward model" and "iterations" not in r[1]]
    mean = {k: statistics.mean(q[k] for q in quick) for k in ("greedy", "sampled")}
    out = [HEADING, "", f"Machine: {machine()}. {versions('torch', 'ray', 'deepspeed', 'transformers', 'vllm')}. "
           f"Date: {today()}.", "",
           "Command: `python benchmarks/bench_demo_accuracy.py --write benchmarks/HISTORY.md`. The quickstart's SFT, RM "
           f"and PPO configs (PPO: seed {ppo.seed}, {ppo.ppo.iterations} iterations, "
           f"policy lr {ppo.policy.optim.lr:g}, critic lr {ppo.critic.optim.lr:g}, KL coefficient {ppo.ppo.kl_coef:g}) with what the second "
           "column changes; reward models: the quickstart's, trained from the SFT model for 4 epochs (held-out pair "
           f"accuracy {rms['rm']['eval_accuracy']:.2f}), and one trained from the base model for 2 epochs "
           f"({rms['rm_base']['eval_accuracy']:.2f}); with the rule as reward the critic starts from the quickstart "
           f"reward model. Each policy answers all {demo_sort.EVAL_SIZE} held-out demo/sort prompts greedily and "
           f"{SAMPLES} times sampled at T = 1 (the training temperature); wrong length = sampled answers without "
           "exactly 4 digits; RM gain = summary.json's held-out reward-model score (greedy) after minus before.", "",
           "| reward | PPO change, engine | greedy accuracy | sampled accuracy | sampled wrong length | RM gain | s |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for reward, change, r, gain, seconds in rows:
        out.append(f"| {reward} | {change} | {r['greedy']:.3f} | {r['sampled']:.3f} | {r['wrong_length']:.3f} | "
                   f"{'' if gain is None else f'{gain:+.3f}'} | {'' if seconds is None else f'{seconds:.0f}'} |")
    out += ["", f"The quickstart's six runs (3 seeds x 2 engines): sampled accuracy {base['sampled']:.3f} -> "
            f"{mean['sampled']:.3f} on average ({min(q['sampled'] for q in quick):.3f} to "
            f"{max(q['sampled'] for q in quick):.3f}); greedy accuracy {base['greedy']:.3f} -> {mean['greedy']:.3f} "
            f"({min(q['greedy'] for q in quick):.3f} to {max(q['greedy'] for q in quick):.3f})."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
