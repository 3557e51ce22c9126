"""(pretrain ->) SFT (-> warm-up) -> RM -> PPO (or SFT -> DPO), each stage's model feeding the next. A stage whose
output is complete (its model and summary.json exist) is not run again, so a pipeline interrupted in stage k
resumes at stage k."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhf_ray.config.jobs import FINAL_MODEL_DIR, JobBase
from rlhf_ray.config.pipeline_job import ANSWERS_FILE, PAIRS_DIR, PipelineJob
from rlhf_ray.data.pairs import label_pairs
from rlhf_ray.functions import load_function
from rlhf_ray.jobs.kinds import run_job
from rlhf_ray.jobs.teacher_answers import check_same_tokenizer, sample_answers
from rlhf_ray.models.loading import load_tokenizer
from rlhf_ray.models.sources import resolve_model_sources

log = logging.getLogger(__name__)


def completed_summary(stage: JobBase) -> dict | None:
    out = Path(stage.output_dir)
    if (out / FINAL_MODEL_DIR / "config.json").is_file() and (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text())
    return None


@dataclass(frozen=True)
class TeacherAnswers:
    """The summary's `warmup.teacher_answers`: the answers the warm-up trains on and their tokens (the teacher's
    cost of the warm-up); of a fresh sample also the prompts asked, the answers cut at max_new_tokens and the
    engine (None when the file of an earlier run is `reused`: it records only the answers)."""

    answers: int
    tokens: int
    reused: bool
    prompts: int | None = None
    unfinished: int | None = None
    engine: str | None = None


def teacher_answers(job: PipelineJob, sample: bool) -> TeacherAnswers | None:
    """What the warm-up trains on: the teacher's answers to `warmup.prompts` of the PPO stage's training prompts,
    sampled on the cluster when the file is not there and `sample`; a file written earlier is kept (it is written
    whole or not at all)."""
    warmup = job.warmup
    path = Path(warmup.output_dir) / ANSWERS_FILE
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        log.info("warmup: the teacher's answers in %s are there, reusing them (delete the file to sample again)", path)
        return TeacherAnswers(answers=len(rows), tokens=sum(r["tokens"] for r in rows), reused=True)
    if not sample:
        return None
    ppo = resolve_model_sources(job.ppo)
    check_same_tokenizer(ppo.teacher.model, resolve_model_sources(warmup).model, "the student (warmup.model)")
    written = sample_answers(ppo, ppo.teacher.model, path, warmup.prompts, warmup.keep_unfinished)
    log.info("warmup: %d teacher answers (%d tokens) to %d prompts in %s; %d cut at max_new_tokens %s",
             written.kept, written.tokens, written.prompts, path, written.unfinished,
             "kept" if warmup.keep_unfinished else "dropped")
    return TeacherAnswers(answers=written.kept, tokens=written.tokens, reused=False, prompts=written.prompts,
                          unfinished=written.unfinished, engine=written.engine)


@dataclass(frozen=True)
class Pairs:
    """The summary's `rm.pairs`: pairs the reward model trains on and is checked on, the ties left out, and the gold
    function's own accuracy on the held-out labels (the ceiling of the reward model's `eval_accuracy`)."""

    train: int
    eval: int
    ties: int
    gold_eval_accuracy: float
    reused: bool
    seconds: float | None = None
    """The sampling and labelling (None when reused)."""


def preference_pairs(job: PipelineJob, sample: bool) -> Pairs | None:
    """What the rm stage trains on with a `pairs` section: the SFT model's two answers to each of `pairs.prompts` +
    `pairs.eval_prompts` of the PPO stage's training prompts, labelled by the gold function, in `<rm>/pairs/`.
    Sampled when the folder is not there and `sample`; a folder written earlier is kept (written whole or not at
    all)."""
    spec, folder = job.pairs, Path(job.rm.output_dir) / PAIRS_DIR
    if (folder / "eval.jsonl").is_file():
        log.info("rm: the labelled pairs in %s are there, reusing them (delete the folder to sample again)", folder)
        return Pairs(**json.loads((folder / "pairs.json").read_text()), reused=True)
    if not sample:
        return None
    started = time.perf_counter()
    ppo = resolve_model_sources(job.ppo)
    sft_model = ppo.policy.model.model_copy(update={"path": str(Path(job.sft.output_dir) / FINAL_MODEL_DIR),
                                                    "gguf_file": None})
    sampling = ppo.generation.sampling.model_copy(update={"n_samples_per_prompt": 2})
    twice = ppo.model_copy(update={"generation": ppo.generation.model_copy(update={"sampling": sampling})})
    answers_file = folder.with_name(PAIRS_DIR + ".answers.jsonl")
    written = sample_answers(twice, sft_model, answers_file, spec.prompts + spec.eval_prompts, keep_unfinished=True)
    rows = [json.loads(line) for line in answers_file.read_text().splitlines()]
    tokenizer = load_tokenizer(sft_model)
    text = lambda answer: tokenizer.decode(tokenizer(answer, add_special_tokens=False)["input_ids"],  # noqa: E731
                                           skip_special_tokens=True)
    gold = load_function(spec.gold_function)
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    held_out = set(prompts[spec.prompts:])
    train = label_pairs([r for r in rows if r["prompt"] not in held_out], gold, spec.temperature, job.seed, text)
    check = label_pairs([r for r in rows if r["prompt"] in held_out], gold, spec.temperature, job.seed + 1, text)
    made = Pairs(train=len(train.rows), eval=len(check.rows), ties=train.ties + check.ties,
                 gold_eval_accuracy=round(check.ceiling, 4), reused=False,
                 seconds=round(time.perf_counter() - started, 2))
    staging = folder.with_name(PAIRS_DIR + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)
    for split, labelled in (("train", train), ("eval", check)):
        (staging / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labelled.rows))
    facts = {k: v for k, v in asdict(made).items() if k not in ("reused", "seconds")}
    (staging / "pairs.json").write_text(json.dumps(facts, indent=2))
    staging.replace(folder)
    answers_file.unlink()
    log.info("rm: %d training and %d held-out pairs of the SFT model's answers (%s engine) labelled by %s in %s; "
             "%d ties left out; the gold score's own accuracy on the held-out labels: %.3f", made.train, made.eval,
             written.engine, spec.gold_function, folder, made.ties, made.gold_eval_accuracy)
    return made


def run_pipeline(job: PipelineJob) -> dict:
    summary: dict[str, dict] = {}
    for name, stage in job.named_stages().items():
        done = completed_summary(stage)
        answers = teacher_answers(job, sample=done is None) if name == "warmup" else None
        pairs = preference_pairs(job, sample=done is None) if name == "rm" and job.pairs is not None else None
        if done is not None:
            log.info("%s: already complete in %s, reusing it (delete the folder to run it again)",
                     name, stage.output_dir)
            summary[name] = {**done, "reused": True}
        else:
            summary[name] = run_job(stage)
        if answers is not None:
            summary[name]["teacher_answers"] = asdict(answers)
        if pairs is not None:
            summary[name]["pairs"] = asdict(pairs)
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
