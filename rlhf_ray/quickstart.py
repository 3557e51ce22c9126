"""The README's main job. By default: check every quickstart config, then GRPO on a real instruct model
(configs/quickstart/grpo.yaml: SmolLM2-135M-Instruct learns arithmetic, ~9 minutes on 2 cores). With
`--pipeline`: build the tiny model and run the whole InstructGPT pipeline on it (SFT -> RM -> PPO, ~2 minutes).
docs/jobs.md, "The two quickstarts", says why the default is the real model."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from rlhf_ray.config import ConfigError, ConfigSource, PipelineJob, PPOJob, load_job, validate_job
from rlhf_ray.exit_codes import EXIT_BAD_CONFIG, EXIT_OK, EXIT_PLAN_DOES_NOT_FIT
from rlhf_ray.jobs.failure import failures_reported
from rlhf_ray.jobs.kinds import run_job
from rlhf_ray.jobs.preflight import check_plan, preflight

console = Console(soft_wrap=True)


def run_quickstart(configs: Path, pipeline: bool = False, verbose: bool = False) -> int:
    files = sorted(configs.glob("*.yaml"))
    if not files:
        console.print(f"[red]no quickstart configs in {configs}[/red]")
        return EXIT_BAD_CONFIG
    steps = 3 if pipeline else 2
    source = ConfigSource.from_file(configs / ("pipeline.yaml" if pipeline else "grpo.yaml"))
    if verbose:
        source = source.override(["logging.verbose=true"])
    job = validate_job(source, expect="pipeline" if pipeline else "ppo")
    if pipeline:
        assert isinstance(job, PipelineJob)
        _tiny_model(Path(job.sft.model.path or ""), steps)
    else:
        assert isinstance(job, PPOJob)

    for path in files:
        try:
            config = load_job(path)
        except ConfigError as exc:
            console.print(str(exc), markup=False)
            return EXIT_BAD_CONFIG
        problems = check_plan(config, show=False)
        if problems:
            console.print(f"[red]{path}: the plan does not fit this machine:[/red]\n  " + "\n  ".join(problems))
            return EXIT_PLAN_DOES_NOT_FIT
    console.print(f"[{steps - 1}/{steps}] {len(files)} quickstart configs load and fit this machine: "
                  f"{', '.join(p.stem for p in files)} (in {configs})", markup=False, highlight=False)
    try:
        preflight(job, source)  # the files the job about to run reads (the others may name models not built yet)
    except ConfigError as exc:
        console.print(str(exc), markup=False)
        return EXIT_BAD_CONFIG

    if pipeline:
        console.print(f"[{steps}/{steps}] running the pipeline on the tiny model: SFT -> RM -> PPO")
    else:
        console.print(f"[{steps}/{steps}] GRPO on SmolLM2-135M-Instruct ({configs / 'grpo.yaml'}): "
                      f"{job.ppo.iterations} iterations, then the held-out prompts again")
    with failures_reported(job.output_dir):
        summary = run_job(job) if pipeline else {"grpo": run_job(job)}
    _report(summary)
    out = Path(job.output_dir)
    console.print(f"written: {out / 'summary.json'}, the report {out / 'report.html'}, library logs in "
                  f"{out / 'logs' if not pipeline else out / '<stage>' / 'logs'}/", markup=False, highlight=False)
    return EXIT_OK


def _tiny_model(path: Path, steps: int) -> None:
    from rlhf_ray.models.tiny import build_tiny_model

    if (path / "config.json").is_file():
        console.print(f"[1/{steps}] tiny model already built: {path}")
    else:
        console.print(f"[1/{steps}] building the tiny model and tokenizer in {path}")
        build_tiny_model(path)


def _report(summary: dict) -> None:
    sft, rm = summary.get("sft", {}), summary.get("rm", {})
    if "eval_loss_last" in sft:
        console.print(f"SFT: eval loss {sft['eval_loss_first']:.3f} -> {sft['eval_loss_last']:.3f} "
                      f"(perplexity {sft['eval_perplexity']:.2f})")
    if "eval_accuracy" in rm:
        console.print(f"RM: held-out pair accuracy {rm['eval_accuracy_first']:.2f} -> {rm['eval_accuracy']:.2f}")
    for stage in ("ppo", "grpo"):
        ppo = summary.get(stage, {})
        # GRPO's reward is the rule itself: its reward line would repeat the accuracy line
        keys = [("task_accuracy", "task accuracy (rule-checked)")]
        if stage == "ppo":
            keys.insert(0, ("reward", "reward"))
        for key, label in keys:
            if ppo.get(f"{key}_after") is not None:
                line = (f"{stage.upper()}: held-out {label}, greedy {ppo[f'{key}_before']:.3f} -> "
                        f"{ppo[f'{key}_after']:.3f}")
                if f"{key}_se_after" in ppo:
                    line += f" ± {ppo[f'{key}_se_after']:.3f}"
                if f"sampled_{key}_after" in ppo:
                    line += f", sampled {ppo[f'sampled_{key}_before']:.3f} -> {ppo[f'sampled_{key}_after']:.3f}"
                    if f"sampled_{key}_se_after" in ppo:
                        line += f" ± {ppo[f'sampled_{key}_se_after']:.3f}"
                console.print(line)
        if any(ppo.get(f"{key}_se_after") is not None for key, _ in keys):
            console.print(f"  (±: one standard error over the {ppo['eval_prompts']} held-out prompts)")
