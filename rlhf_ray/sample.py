"""`rlhf-ray sample`: a model's answers to a PPO job's training prompts, written as a dataset an SFT job reads. The
off-policy half of distillation (SFT of a student on a teacher's answers; docs/jobs.md, "On-policy distillation"):
the prompts are rendered and tokenised as the PPO job renders them, the answers sampled with its generation
settings by one of its engines (in this process), so SFT on the file reads back the very prompt ids the job's
policy will later sample from."""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

from rlhf_ray.actors.engine import build_engine, engine_env
from rlhf_ray.actors.pool import with_model_len
from rlhf_ray.config import JobBase
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.ppo_job import PPOJob
from rlhf_ray.data.build import build_phase_data, same_tokenizer
from rlhf_ray.data.split import stable_seed
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.models.loading import load_tokenizer
from rlhf_ray.models.sources import resolve_model_sources
from rlhf_ray.models.support import resolve_engine

log = logging.getLogger(__name__)
CHUNK = 64
"""Prompts per engine call."""

SFT_FORMAT = {"prompt_field": "prompt", "chosen_field": "answer", "template": "raw"}
"""How an SFT job reads the written file (`data.datasets: [{name: custom, path: FILE, format: SFT_FORMAT}]`): the
prompt as the PPO job rendered it, the answer as the model wrote it (its stop token included), neither re-rendered."""


def job_and_model(job: JobBase, model_path: str | None) -> tuple[PPOJob, ModelSpec]:
    """The PPO job whose prompts and sampling settings are used (a pipeline's ppo stage) and the model that answers:
    `model_path`, else the job's teacher; GGUF sources imported. The answering model must share the policy's
    tokenizer: the file's prompts are the token ids the policy will see, and SFT reads them back with its own."""
    ppo = getattr(job, "ppo", None) if job.kind == "pipeline" else job
    if not isinstance(ppo, PPOJob):
        raise ValueError(f"sample takes the prompts and sampling settings of a ppo config, or of a pipeline's ppo "
                         f"stage; this is a {job.kind} config")
    ppo = resolve_model_sources(ppo)
    if model_path is not None:
        model = ppo.policy.model.model_copy(update={"path": model_path, "gguf_file": None})
    elif ppo.teacher is not None:
        model = ppo.teacher.model
    else:
        raise ValueError("which model answers? give --model PATH, or sample a config with a teacher section (its "
                         "teacher answers)")
    if model.path is None or not Path(model.path).is_dir():
        raise ValueError(f"no model folder at {model.path}: give --model PATH, or run the stage that writes it first "
                         "(a pipeline's teacher is its sft stage's output)")
    if not same_tokenizer(load_tokenizer(ppo.policy.model), load_tokenizer(model)):
        raise ValueError(f"the model at {model.path} and the policy at {ppo.policy.model.path} have different "
                         "tokenizers: the answers would be token ids the policy does not read the same way; sample "
                         "with a model of the policy's tokenizer")
    return ppo, model


@dataclass(frozen=True)
class Written:
    """What `sample_answers` wrote: the answers kept (and their tokens), of which `unfinished` ran out of tokens
    (dropped unless kept: then counted in `kept` too)."""

    path: Path
    engine: str
    prompts: int
    kept: int
    unfinished: int
    tokens: int


def sample_answers(job: PPOJob, model: ModelSpec, out: Path, prompts: int | None = None,
                   keep_unfinished: bool = False) -> Written:
    """`model`'s answers to `prompts` of `job`'s training prompts (all when None; shuffled by the job's seed, so
    any number is a sample of the whole set), `generation.sampling.n_samples_per_prompt` each, sampled with the
    job's sampling settings and seed. Answers cut at max_new_tokens are dropped unless `keep_unfinished` (SFT
    would teach the student to stop mid-answer). One JSON line per answer: prompt, answer, finished, tokens and
    columns (the dataset's columns of the prompt: a task's ground truth)."""
    tokenizer = load_tokenizer(model)
    tokens = TokenConventions.from_tokenizer(tokenizer, model.path)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, job.data.cache_dir or Path(out).parent / "data_cache",
                            tokens=tokens)
    rows = list(data.train)
    random.Random(job.seed).shuffle(rows)
    rows = rows[:prompts]
    engine_name, reason = resolve_engine(job.generation, model)
    log.info("sampling %d prompts x %d with the %s engine (%s)", len(rows),
             job.generation.sampling.n_samples_per_prompt, engine_name, reason)
    spec = with_model_len(job)
    # the engine lives in this process, as in an engine actor's (LD_PRELOAD only counts before a process starts)
    os.environ.update({k: v for k, v in engine_env(engine_name, spec, os.cpu_count() or 1).items()
                       if k != "LD_PRELOAD"})
    engine = build_engine(model, spec, tokens, engine_name)
    samples = []
    for start in range(0, len(rows), CHUNK):  # a progress line per chunk: a large sample takes a while
        chunk = [r["prompt_ids"] for r in rows[start: start + CHUNK]]
        got = engine.generate(chunk, job.generation.sampling, seed=stable_seed(job.seed, "sample", start))
        samples += [{**sample, "prompt_index": sample["prompt_index"] + start} for sample in got]
        log.info("sampled %d/%d prompts", start + len(chunk), len(rows))
    lines, unfinished, count = [], 0, 0
    for sample in samples:
        unfinished += not sample["finished"]
        if not sample["finished"] and not keep_unfinished:
            continue
        row = rows[sample["prompt_index"]]
        count += len(sample["answer_ids"])
        lines.append(json.dumps({"prompt": row["prompt"], "answer": tokenizer.decode(sample["answer_ids"]),
                                 "finished": sample["finished"], "tokens": len(sample["answer_ids"]),
                                 "columns": row["columns"]}))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    tmp.replace(out)
    return Written(out, engine_name, len(rows), len(lines), unfinished, count)
