"""On-policy distillation against its off-policy baseline at equal teacher calls (issue 41): held-out greedy
accuracy of the student against the number of tokens the teacher scored or wrote for it.

- on-policy: the distill recipe's run of this seed (benchmarks/bench_rl_after_sft.py --recipes distill; the recipe
  evaluates every 5 iterations): the student samples, the teacher scores each sampled token; teacher tokens after
  iteration k = the answer tokens of iterations 1..k. Kept runs of earlier recipe versions and tagged experiments
  of the seed are listed and plotted beside it.
- off-policy: SFT of the same student on the teacher's own answers (the same teacher, the same training prompts, the
  recipe's sampling: temperature 1, up to 64 new tokens), one pass, the SFT stage's optimizer settings; teacher
  tokens after step k = the answer tokens the teacher wrote for the samples of steps 1..k. Checkpoints every
  `--eval-every` steps are scored by the same evaluator as the teacher (vLLM greedy, the correctness rule, the same
  held-out problems: 300, never trained on by either side).
- off-policy, then on-policy (`--warm-start STEP`): the distill recipe run from the off-policy student after STEP
  steps (SFT on the teacher's samples as a warm-up, then the student's own samples scored by the teacher), kept as
  the tagged experiment `warmSTEP`; its teacher tokens start at the warm-up's.
- the warm-up recipe (configs/recipes/smollm2-distill-warmup.yaml, its run kept by `bench_rl_after_sft.py
  --recipes distill-warmup`): the same in one pipeline (its warmup stage samples and fine-tunes); its teacher
  tokens start at the answers its warm-up trained on.

    .venv/bin/python benchmarks/bench_distill_baseline.py --seed 1 --workdir W [--write benchmarks/HISTORY.md]
    .venv/bin/python benchmarks/bench_distill_baseline.py --seed 1 --workdir W --warm-start 30

W is bench_rl_after_sft's --workdir: W/distill-SEED holds the teacher (its SFT stage). The result is kept in
benchmarks/results/distill_baseline/seed-SEED.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ROOT, greedy_accuracy, machine, pyplot, run_watched, save_figure, settings_hash,  # noqa: E402
                    today, versions, write_section)

HEADING = "## On-policy distillation against SFT on the teacher's samples"
RECIPE = ROOT / "configs/recipes/smollm2-distill.yaml"
WARMUP_RECIPE = ROOT / "configs/recipes/smollm2-distill-warmup.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "distill_baseline"
ON_POLICY = ROOT / "benchmarks" / "results" / "rl_after_sft"
EVAL, GOAL = 300, 0.9
EXTRA_COLOURS = ("tab:red", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive")  # the runs beside both


def sample_child(teacher: str, rows_file: str, n: int, new_tokens: int, seed: int, out: str) -> None:
    """The teacher's answers to n training prompts (vLLM, fp32, temperature 1): text, token count, finished."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    rows = json.loads(Path(rows_file).read_text())[:n]
    llm = LLM(teacher, dtype="float32", max_model_len=512, enforce_eager=True, seed=seed,
              kv_cache_memory_bytes=2**30)
    outs = llm.generate([r["rendered"] for r in rows], SamplingParams(temperature=1.0, max_tokens=new_tokens),
                        use_tqdm=False)
    answers = [{"prompt": r["prompt"], "answer": o.outputs[0].text, "tokens": len(o.outputs[0].token_ids),
                "finished": o.outputs[0].finish_reason == "stop"} for r, o in zip(rows, outs)]
    Path(out).write_text("\n".join(json.dumps(a) for a in answers) + "\n")


def hf_from_checkpoint(checkpoint: Path, student: str, out: Path) -> None:
    """The student's weights in a ZeRO-0 DeepSpeed checkpoint written as a plain HF folder vLLM reads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    states = torch.load(checkpoint / "state" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(states["module"], strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:  # a tied head is saved once, as the embedding
        raise RuntimeError(f"{checkpoint}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(student).save_pretrained(out)


def user_message(tokenizer, prompt: str) -> str:
    """The user's message of a one-turn prompt as the chat template rendered it (the rows hold rendered text), checked
    by rendering it again: the SFT data must render to the very prompts distillation sampled from."""
    question = prompt.split("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
    again = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                          tokenize=False)
    if again != prompt:
        raise RuntimeError(f"cannot recover the user message of {prompt!r}: it renders as {again!r}")
    return question


def setup(seed: int, work: Path):
    """The distill recipe's stages for this seed as bench_rl_after_sft ran them: the teacher's folder, the
    student's, the recipe's sections, and the PPO stage's training prompts and held-out rows."""
    from rlhf_ray.config import load_job
    from rlhf_ray.data.build import build_phase_data
    from rlhf_ray.data.tokens import TokenConventions
    from rlhf_ray.models.loading import load_tokenizer
    from rlhf_ray.models.sources import resolve_model_sources

    pipeline = load_job(RECIPE, [f"seed={seed}", f"output_dir={work / f'distill-{seed}'}"])
    ppo = resolve_model_sources(pipeline.ppo)
    teacher = ppo.teacher.model.path
    if not (Path(teacher) / "config.json").is_file():
        raise SystemExit(f"no teacher at {teacher}: run bench_rl_after_sft.py --recipes distill --seeds {seed} "
                         f"--workdir {work} first")
    tokenizer = load_tokenizer(ppo.policy.model)
    data = build_phase_data(ppo.data, tokenizer, "ppo", seed, work / "baseline-cache",
                            tokens=TokenConventions.from_tokenizer(tokenizer, ppo.policy.model.path))
    train = [{"prompt": r["prompt"], "question": user_message(tokenizer, r["prompt"]),
              "rendered": tokenizer.decode(r["prompt_ids"])} for r in data.train]
    random.Random(seed).shuffle(train)
    held_out = [{"prompt": tokenizer.decode(r["prompt_ids"]), "answer": r["columns"]["answer"]}
                for r in data.eval[:EVAL]]
    return teacher, ppo.policy.model.path, yaml.safe_load(RECIPE.read_text()), ppo, train, held_out


def sft_config(recipe: dict, student: str, samples: Path, steps: int, every: int, seed: int, out: Path) -> dict:
    """An SFT job on the teacher's answers: the distill recipe's SFT settings, the student's model, one pass."""
    sft = recipe["sft"]
    return {"kind": "sft", "output_dir": str(out), "seed": seed, "cluster": recipe["cluster"],
            "model": {"path": student, "dtype": "fp32"},
            "data": {"datasets": [{"name": "custom", "path": str(samples),
                                   "format": {"messages_field": "messages", "template": "chat_template"}}],
                     "split": "1,0,0", "max_seq_len": sft["data"]["max_seq_len"]},
            "train": {**sft["train"], "max_steps": steps},
            "optim": sft["optim"], "deepspeed": sft["deepspeed"], "placement": sft["placement"],
            "checkpoint": {"every_steps": every, "keep_last": steps // every + 1},
            "logging": {"progress": False, "tensorboard": False}}


def on_policy_curve(seed: int, file: Path | None = None) -> tuple[list[tuple[int, float]], dict]:
    """(teacher tokens, greedy accuracy) at each evaluation of the distill run of this seed (or of the run kept in
    `file`), and the run."""
    run = json.loads((file or ON_POLICY / f"distill-{seed}.json").read_text())
    tokens, curve = 0, []
    for row in run["metrics"]:
        tokens += row.get("generate/tokens", 0)
        if "eval/task_accuracy" in row:
            curve.append((int(tokens), row["eval/task_accuracy"]))
    return curve, run


def run_baseline(seed: int, work: Path, answers: int, every: int) -> dict:
    teacher, student, recipe, ppo, train, held_out = setup(seed, work)
    base = work / f"baseline-{seed}"
    base.mkdir(parents=True, exist_ok=True)
    (base / "train.json").write_text(json.dumps(train))
    (base / "held_out.json").write_text(json.dumps(held_out))
    new_tokens = ppo.generation.sampling.max_new_tokens
    samples = base / "teacher_answers.jsonl"
    if not samples.exists():
        run_watched([sys.executable, __file__, "--sample-child", teacher, str(base / "train.json"), str(answers),
                     str(new_tokens), str(seed), str(samples)], base / "sample.log")
    written = [json.loads(line) for line in samples.read_text().splitlines()]
    if len(written) != answers:  # an earlier invocation's file: its SFT and checkpoints are of another length too
        raise SystemExit(f"{samples} holds {len(written)} teacher answers, not --answers {answers}: give another "
                         f"--workdir (with {work / f'distill-{seed}'} in it, the teacher) or delete {base}")
    conversations = base / "sft_data.jsonl"
    conversations.write_text("".join(json.dumps({"messages": [{"role": "user", "content": row["question"]},
                                                              {"role": "assistant", "content": a["answer"].strip()}]})
                                     + "\n" for row, a in zip(train, written)))
    batch = recipe["sft"]["train"]["global_batch_size"]
    steps = answers // batch
    config = base / "sft.yaml"
    config.write_text(yaml.safe_dump(sft_config(recipe, student, conversations, steps, every, seed, base / "sft")))
    if not (base / "sft" / "summary.json").exists():
        run_watched([sys.executable, "-m", "rlhf_ray.cli", "sft", "--config", str(config)], base / "sft.log",
                    timeout=2 * 3600)

    def accuracy(model_dir: Path, name: str) -> float:
        out = base / f"eval-{name}.json"
        if not out.exists():
            run_watched([sys.executable, __file__, "--eval-child", str(model_dir), str(base / "held_out.json"),
                         str(new_tokens), str(out)], base / f"eval-{name}.log")
        return json.loads(out.read_text())["accuracy"]

    mean_tokens = sum(a["tokens"] for a in written) / len(written)
    curve = [(0, accuracy(Path(student), "student"))]
    for step in range(every, steps + 1, every):
        model = base / f"hf-step{step}"
        if not (model / "config.json").exists():
            hf_from_checkpoint(base / "sft" / "checkpoints" / f"step-{step:08d}", student, model)
        curve.append((round(step * batch * mean_tokens), accuracy(model, f"step{step}")))
    # every checkpoint is an HF folder now (what --warm-start reads): the DeepSpeed copies (~0.5 GB each) go
    shutil.rmtree(base / "sft" / "checkpoints", ignore_errors=True)
    result = {"seed": seed, "answers": answers, "teacher_tokens": sum(a["tokens"] for a in written),
              "finished": sum(a["finished"] for a in written) / len(written), "steps": steps, "batch": batch,
              "every": every, "curve": curve, "teacher_accuracy": accuracy(Path(teacher), "teacher"),
              "date": today(), "machine": machine()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"seed-{seed}.json").write_text(json.dumps(result) + "\n")
    return result


def run_warm_start(seed: int, work: Path, step: int, overrides: list[str], name: str | None) -> dict:
    """The distill recipe from the off-policy student after `step` steps of this seed's baseline run (which must
    have run, in this workdir, with a checkpoint at that step), kept as the experiment `warm{step}` (with `overrides`
    of the recipe's settings, `warm{step}-{name}`); the record says how many teacher tokens the warm-up took, where
    the on-policy curve starts."""
    baseline = json.loads((RESULTS / f"seed-{seed}.json").read_text())
    if step % baseline["every"] or not 0 < step <= baseline["steps"]:
        raise SystemExit(f"--warm-start {step}: the baseline of seed {seed} kept checkpoints every "
                         f"{baseline['every']} steps up to {baseline['steps']}")
    model = work / f"baseline-{seed}" / f"hf-step{step}"
    if not (model / "config.json").is_file():
        raise SystemExit(f"no off-policy student at {model}: run this script with --seed {seed} --workdir {work} "
                         f"--eval-every {baseline['every']} first")
    tag = f"warm{step}" if name is None else f"warm{step}-{name}"
    settings = [a for o in ["ppo.policy.model.gguf_file=null", f"ppo.policy.model.path={model}", *overrides]
                for a in ("--set", o)]
    run_watched([sys.executable, str(ROOT / "benchmarks" / "bench_rl_after_sft.py"), "--recipes", "distill",
                 "--seeds", str(seed), "--workdir", str(work), "--tag", tag, *settings],
                work / f"{tag}-{seed}.log", timeout=4 * 3600)
    record = {"seed": seed, "step": step, "answers": step * baseline["batch"],
              "teacher_tokens": baseline["curve"][step // baseline["every"]][0],  # a point every `every` steps
              "experiment": f"distill-{seed}-{tag}.json", "date": today()}
    (RESULTS / f"warm-{seed}-{tag.removeprefix('warm')}.json").write_text(json.dumps(record) + "\n")
    return record


def warm_starts(seed: int) -> dict[str, dict]:
    """The warm-start records of this seed, by the experiment file they name."""
    records = (json.loads(f.read_text()) for f in sorted(RESULTS.glob(f"warm-{seed}-*.json")))
    return {r["experiment"]: r for r in records}


def on_policy_runs(seed: int) -> tuple[list[tuple[int, float]] | None, list[tuple[str, list, dict]]]:
    """The curve of the current distill recipe's run of this seed (None when none is kept), and the other kept runs
    of this seed as (label, curve, run): runs of an earlier version of the recipe (superseded/) and tagged
    experiments (bench_rl_after_sft --tag: settings the recipe did not ship)."""
    recipe, others = None, []
    current = ON_POLICY / f"distill-{seed}.json"
    if current.is_file():
        curve, run = on_policy_curve(seed, current)
        if run["settings"] == settings_hash(RECIPE.read_text(), []):
            recipe = curve
        else:
            others.append(("an earlier recipe", curve, run))
    warm = warm_starts(seed)
    for folder, kind in (("superseded", "an earlier recipe"), ("experiments", "experiment")):
        for file in sorted((ON_POLICY / folder).glob(f"distill-{seed}-*.json")):
            curve, run = on_policy_curve(seed, file)
            tag = file.stem.split('-', 2)[2]
            label = f"{kind} `{tag}`"
            if folder == "experiments" and file.name in warm:  # its teacher tokens start at the warm-up's
                w = warm[file.name]
                curve = [(w["teacher_tokens"] + t, a) for t, a in curve]
                label = f"after {w['step']} off-policy steps ({w['answers']} teacher answers) `{tag}`"
            others.append((label, curve, run))
    for file in sorted((ON_POLICY / "experiments").glob(f"distill-warmup-{seed}-*.json")):
        curve, run = on_policy_curve(seed, file)
        others.append((f"warm-up recipe, experiment `{file.stem.split('-', 3)[3]}`", warmup_tokens_first(curve, run),
                       run))
    return recipe, others


def warmup_tokens_first(curve: list[tuple[int, float]], run: dict) -> list[tuple[int, float]]:
    """A warm-up recipe run's curve with its teacher tokens starting at those of the answers its warm-up trained on."""
    start = run["summary"]["warmup"]["teacher_answers"]["tokens"]
    return [(start + tokens, accuracy) for tokens, accuracy in curve]


def warmup_recipe_curve(seed: int) -> list[tuple[int, float]] | None:
    """(teacher tokens, greedy accuracy) of the warm-up recipe's kept run of this seed, its tokens starting at the
    warm-up's teacher answers; None when no run of the recipe as it is now is kept."""
    file = ON_POLICY / f"distill-warmup-{seed}.json"
    if not file.is_file():
        return None
    curve, run = on_policy_curve(seed, file)
    if run["settings"] != settings_hash(WARMUP_RECIPE.read_text(), []):
        print(f"not reported: {file} ran other settings than {WARMUP_RECIPE.name} holds now", flush=True)
        return None
    return warmup_tokens_first(curve, run)


def tokens_to_reach(curve: list[tuple[int, float]], level: float) -> int | None:
    # accuracies are counts over the same problems: 54/300 is 90% of 60/300, which 0.9 * 0.2 (0.18000000000000002)
    # would put out of reach by float rounding alone
    return next((tokens for tokens, acc in curve if acc >= level - 1e-9), None)


def goal_verdict(reached_on: int | None, reached_off: int | None, off_budget: int) -> str:
    """Met when on-policy reaches the level in fewer teacher tokens than off-policy: off-policy reaching it later,
    or not at all within answers worth more teacher tokens than on-policy needed. When the off-policy run stopped
    short of on-policy's tokens without reaching it, the comparison is not decided."""
    if reached_on is None or (reached_off is not None and reached_off <= reached_on):
        return "missed"
    if reached_off is None and off_budget < reached_on:
        return (f"not decided: the off-policy run ended at {off_budget:,} teacher tokens without reaching it; "
                "a longer one (bench_distill_baseline.py --answers) would say")
    return "met"


def report(doc: Path | None) -> str:
    rows, plots, tried, warmed = [], [], {}, {}
    for file in sorted(RESULTS.glob("seed-*.json")):
        base = json.loads(file.read_text())
        on, tried[base["seed"]] = on_policy_runs(base["seed"])
        warmed[base["seed"]] = warmup_recipe_curve(base["seed"])
        teacher, off = base["teacher_accuracy"], base["curve"]
        plots.append((base, on, teacher))
        best_off = max(a for _, a in off)
        off_cell = f"{best_off:.3f} ({best_off / teacher:.0%}) at {tokens_to_reach(off, best_off):,}"
        warm = warmed[base["seed"]]
        warm_cell = "not run" if warm is None else \
            f"{max(a for _, a in warm):.3f} ({max(a for _, a in warm) / teacher:.0%}) at " \
            f"{tokens_to_reach(warm, max(a for _, a in warm)):,}"
        if on is None:
            rows.append(f"| {base['seed']} | {teacher:.3f} | {off[0][1]:.3f} | no run of the current recipe kept | "
                        f"{off_cell} | - | {warm_cell} |")
            continue
        best_on = max(a for _, a in on)
        level = min(best_on, best_off)  # the accuracy both reach: who needs fewer teacher tokens for it
        need_on, need_off = tokens_to_reach(on, level), tokens_to_reach(off, level)
        rows.append(f"| {base['seed']} | {teacher:.3f} | {on[0][1]:.3f} | {best_on:.3f} ({best_on / teacher:.0%}) "
                    f"at {tokens_to_reach(on, best_on):,} | {off_cell} | "
                    f"{level:.3f}: {need_on:,} on-policy, {need_off:,} off-policy | {warm_cell} |")
    text = [HEADING, "",
            "Runs: " + "; ".join(f"seed {b['seed']}: {b['date']}, {b['machine']}" for b, _, _ in plots)
            + f". Versions: {versions('torch', 'ray', 'deepspeed', 'transformers', 'vllm')}.",
            "",
            "Command: `python benchmarks/bench_rl_after_sft.py --recipes distill --seeds N --workdir W` (on-policy: "
            "the distill recipe, evaluated every 5 iterations), then `python benchmarks/bench_distill_baseline.py --seed N --workdir W --answers A --eval-every E "
            "--write benchmarks/HISTORY.md` (off-policy: the teacher answers A training prompts at the recipe's sampling "
            "settings and the base student is fine-tuned on those answers, one pass in batches of the SFT stage's "
            "size with its optimizer, a checkpoint scored every E steps; "
            + "; ".join(f"seed {b['seed']}: A = {b['answers']}, E = {b['every']}" for b, _, _ in plots)
            + "). Both "
            "students are the base SmolLM2-135M-Instruct; the teacher is the seed's SFT model; held-out: greedy "
            f"accuracy on the same {EVAL} problems, one evaluator (vLLM, the correctness rule). Teacher tokens: "
            "on-policy, the student's answer tokens the teacher scored; off-policy, the answer tokens the teacher "
            "wrote for the samples trained on so far. Warm-up recipe: `python benchmarks/bench_rl_after_sft.py "
            "--recipes distill-warmup --seeds N --workdir W` (configs/recipes/smollm2-distill-warmup.yaml, one "
            "pipeline: the teacher answers 240 training prompts on the cluster, the base student is fine-tuned on the "
            "answers it finished, then distilled on-policy at lr 1e-5, evaluated every 5 iterations); its teacher "
            "tokens start at the warm-up's answers' and add the tokens scored on-policy.", "",
            "| seed | teacher | student before | on-policy best (of teacher) at teacher tokens | off-policy best "
            "(of teacher) at teacher tokens | teacher tokens to reach the accuracy both reach | warm-up recipe best "
            "(of teacher) at teacher tokens |",
            "|---:|---:|---:|---|---|---|---|", *rows, ""]
    for base, on, teacher in plots:
        for recipe, curve in (("distill", on), ("distill-warmup", warmed[base["seed"]])):
            if curve is None:
                text.append(f"Goal (issue 41), seed {base['seed']}, {recipe} recipe: not judged, no run of the "
                            f"recipe as it is now is kept for this seed.")
                continue
            reached_on = tokens_to_reach(curve, GOAL * teacher)
            reached_off = tokens_to_reach(base["curve"], GOAL * teacher)
            verdict = goal_verdict(reached_on, reached_off, base["teacher_tokens"])
            text.append(f"Goal (issue 41), seed {base['seed']}, {recipe} recipe: the student at >= {GOAL:.0%} of the "
                        f"teacher's accuracy ({GOAL * teacher:.3f}) in fewer teacher tokens than SFT on teacher "
                        f"samples: on-policy "
                        f"{'reached at ' + format(reached_on, ',') if reached_on else 'not reached'}, off-policy "
                        f"{'reached at ' + format(reached_off, ',') if reached_off else 'not reached'}: {verdict}.")
    for base, _, teacher in plots:
        for label, curve, run in tried[base["seed"]]:
            settings = ", ".join(f"`{o}`" for o in run["overrides"]) or "no overrides"
            reached = tokens_to_reach(curve, GOAL * teacher)
            text.append("")
            off = tokens_to_reach(base["curve"], GOAL * teacher)
            text.append(f"On-policy, {label}, seed {base['seed']} ({run['date']}, recipe file {run['recipe']} with "
                        f"{settings}; not the current recipe, so not in the goal above): "
                        + ", ".join(f"{a:.3f} at {t:,}" for t, a in curve)
                        + f" teacher tokens; {GOAL:.0%} of the teacher "
                        + (f"reached at {reached:,}" if reached else "not reached")
                        + f" (off-policy alone: {f'reached at {off:,}' if off else 'not reached'} in "
                          f"{base['answers']} teacher answers, {base['teacher_tokens']:,} tokens).")
    text.append("")
    plt = pyplot()
    if plt is not None and plots and doc is not None:
        # one panel per seed: each seed has its own teacher, so its own teacher and goal lines
        fig, axes = plt.subplots(1, len(plots), figsize=(4.5 * len(plots) + 1, 4), sharey=True, squeeze=False)
        colours: dict[str, str] = {}
        for ax, (base, on, teacher) in zip(axes[0], plots):
            if on is not None:
                ax.plot(*zip(*on), "o-", label="on-policy distillation (the recipe)")
            if warmed[base["seed"]] is not None:
                ax.plot(*zip(*warmed[base["seed"]]), "D-", color="black",
                        label="warm-up recipe (SFT on teacher answers, then on-policy)")
            ax.plot(*zip(*base["curve"]), "s--", label="SFT on teacher samples")
            for label, curve, _ in tried[base["seed"]]:  # one colour per kind of run, the same in every panel
                ax.plot(*zip(*curve), "^:", color=colours.setdefault(label, EXTRA_COLOURS[len(colours) % 6]),
                        label=f"on-policy, {label.replace('`', '')}")
            ax.axhline(teacher, color="gray", lw=0.8)
            ax.axhline(GOAL * teacher, color="gray", lw=0.8, ls=":")
            ax.set_title(f"seed {base['seed']}: teacher {teacher:.3f} (gray), {GOAL:.0%} of it dotted", fontsize=9)
            ax.set_xlabel("teacher tokens (scored on-policy, written off-policy)", fontsize=8)
        axes[0][0].set_ylabel(f"held-out greedy accuracy ({EVAL} problems)")
        fig.suptitle("student accuracy against teacher calls", fontsize=10)
        legend = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
        fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=3, fontsize=7)  # below, off the curves
        fig.subplots_adjust(bottom=0.32, top=0.85)
        text.append(save_figure(fig, doc, "distill_baseline.png"))
        text.append("")
    return "\n".join(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", type=Path, help="bench_rl_after_sft's --workdir (holds the teacher)")
    parser.add_argument("--answers", type=int, default=480,
                        help="teacher answers to train on (480: the distill recipe's 15 iterations x 32 prompts)")
    parser.add_argument("--eval-every", type=int, default=15, help="SFT steps between scored checkpoints")
    parser.add_argument("--warm-start", type=int, metavar="STEP",
                        help="run the distill recipe from the off-policy student after STEP steps (the baseline's "
                             "checkpoint), after the baseline")
    parser.add_argument("--warm-set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --warm-start: a setting of the distill recipe changed for the on-policy part "
                             "(repeatable; needs --warm-name)")
    parser.add_argument("--warm-name", help="with --warm-set: names the experiment (kept as warmSTEP-NAME)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--write", type=Path)
    parser.add_argument("--sample-child", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--eval-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sample_child:
        teacher, rows_file, n, new_tokens, seed, out = args.sample_child
        sample_child(teacher, rows_file, int(n), int(new_tokens), int(seed), out)
        return 0
    if args.eval_child:
        model_dir, rows_file, new_tokens, out = args.eval_child
        rows = json.loads(Path(rows_file).read_text())
        Path(out).write_text(json.dumps({"accuracy": greedy_accuracy(model_dir, model_dir, rows, int(new_tokens))}))
        return 0
    if not args.report_only:
        if args.workdir is None:
            parser.error("--workdir is needed to run (it holds the teacher)")
        if args.warm_start is not None and (args.warm_start <= 0 or args.warm_start % args.eval_every):
            parser.error(f"--warm-start {args.warm_start}: a checkpointed step, a positive multiple of --eval-every "
                         f"({args.eval_every}); checked before the baseline runs")
        if bool(args.warm_set) != bool(args.warm_name) or (args.warm_set and args.warm_start is None):
            parser.error("--warm-set and --warm-name go together, with --warm-start")
        run_baseline(args.seed, args.workdir, args.answers, args.eval_every)
        if args.warm_start:
            run_warm_start(args.seed, args.workdir, args.warm_start, args.warm_set, args.warm_name)
    text = report(args.write)
    print(text)
    if args.write:
        write_section(args.write, HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
