"""The README's main job: build the tiny model, check the quickstart configs, run the pipeline."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from rlhf_ray.config import ConfigError, PipelineJob, load_job

console = Console(soft_wrap=True)


def run_quickstart(configs: Path) -> int:
    """Runs every stage that exists in this version; says plainly which stages are still to come."""
    from rlhf_ray.cli import EXIT_BAD_CONFIG, EXIT_OK, EXIT_PLAN_DOES_NOT_FIT, check_plan, job_runners
    from rlhf_ray.models.tiny import build_tiny_model

    files = sorted(configs.glob("*.yaml"))
    if not files:
        console.print(f"[red]no quickstart configs in {configs}[/red]")
        return EXIT_BAD_CONFIG
    pipeline = load_job(configs / "pipeline.yaml", expect="pipeline")
    assert isinstance(pipeline, PipelineJob)

    base_model = Path(pipeline.sft.model.path or "")
    if (base_model / "config.json").is_file():
        console.print(f"[1/3] tiny model already built: {base_model}")
    else:
        console.print(f"[1/3] building the tiny model and tokenizer in {base_model}")
        build_tiny_model(base_model)

    console.print(f"[2/3] validating {len(files)} quickstart configs")
    for path in files:
        try:
            job = load_job(path)
        except ConfigError as exc:
            console.print(str(exc), markup=False)
            return EXIT_BAD_CONFIG
        problems = check_plan(job, show=False)
        if problems:
            console.print(f"[red]{path}: the plan does not fit this machine:[/red]\n  " + "\n  ".join(problems))
            return EXIT_PLAN_DOES_NOT_FIT
        console.print(f"      ok  {path} ({job.kind})")

    console.print("[3/3] running the pipeline: SFT -> RM -> PPO")
    summary = job_runners()["pipeline"](pipeline)
    console.print_json(data=summary)
    _report(summary)
    return EXIT_OK


def _report(summary: dict) -> None:
    from rlhf_ray.jobs.pipeline import NOT_IMPLEMENTED

    sft, rm, ppo = summary.get("sft", {}), summary.get("rm", {}), summary.get("ppo", {})
    if "eval_loss_last" in sft:
        console.print(f"SFT: eval loss {sft['eval_loss_first']:.3f} -> {sft['eval_loss_last']:.3f} "
                      f"(perplexity {sft['eval_perplexity']:.2f})")
    if "eval_accuracy" in rm:
        console.print(f"RM: held-out pair accuracy {rm['eval_accuracy_first']:.2f} -> {rm['eval_accuracy']:.2f}")
    for key, label in (("reward", "reward"), ("task_accuracy", "task accuracy (rule-checked)")):
        if ppo.get(f"{key}_after") is not None:
            line = f"PPO: held-out {label}, greedy {ppo[f'{key}_before']:.3f} -> {ppo[f'{key}_after']:.3f}"
            if f"sampled_{key}_after" in ppo:
                line += f", sampled {ppo[f'sampled_{key}_before']:.3f} -> {ppo[f'sampled_{key}_after']:.3f}"
            console.print(line)
    if ppo.get("status") == NOT_IMPLEMENTED:
        console.print("PPO: not implemented in this version.")
