"""A model's answers to a PPO job's training prompts, written as a dataset an SFT job reads: the off-policy half of
distillation (a pipeline's warm-up stage, and `rlhf-ray sample`; docs/jobs.md, "On-policy distillation"). The
prompts are rendered and tokenised as the PPO job renders them and answered by the job's generation engines on
the cluster (its generation placement), with its sampling settings, so SFT on the file reads back the very prompt
ids the job's policy will later sample from."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from rlhf_ray import cluster
from rlhf_ray.actors.actor_logs import actor_logs, ray_messages
from rlhf_ray.actors.group import job_names, job_tag
from rlhf_ray.actors.pool import GenerationPool
from rlhf_ray.config import JobBase
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.ppo_job import PPOJob
from rlhf_ray.data.build import build_phase_data, same_tokenizer
from rlhf_ray.data.split import stable_seed
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.models.loading import load_tokenizer
from rlhf_ray.models.sources import resolve_model_sources
from rlhf_ray.plan import ResourcePlan

log = logging.getLogger(__name__)
CHUNK = 64
"""Prompts per call to the engines (a progress line after each)."""


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
    check_same_tokenizer(model, ppo.policy.model, "the policy")
    return ppo, model


def check_same_tokenizer(model: ModelSpec, student: ModelSpec, role: str) -> None:
    """The answering model and the student (`role`, as the message names it) read text as the same token ids."""
    if not same_tokenizer(load_tokenizer(student), load_tokenizer(model)):
        raise ValueError(f"the model at {model.path} and {role} at {student.path} have different tokenizers: the "
                         "answers would be token ids the student does not read the same way; answer with a model "
                         "of the student's tokenizer")


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
    any number is a sample of the whole set), `generation.sampling.n_samples_per_prompt` each, sampled on the job's
    cluster by its generation engines (`generation.placement`, without colocation) with its sampling settings and
    seed. Answers cut at max_new_tokens are dropped unless `keep_unfinished` (SFT would teach the student to stop
    mid-answer). One JSON line per answer: prompt, answer, finished, tokens and columns (the dataset's columns of
    the prompt: a task's ground truth). Written whole or not at all."""
    tokenizer = load_tokenizer(model)
    tokens = TokenConventions.from_tokenizer(tokenizer, model.path)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, job.data.cache_dir or Path(out).parent / "data_cache",
                            tokens=tokens)
    rows = list(data.train)
    random.Random(job.seed).shuffle(rows)
    rows = rows[:prompts]
    generation = job.generation.model_copy(
        update={"placement": job.generation.placement.model_copy(update={"colocate_with": None})})
    answering = job.model_copy(update={"generation": generation,
                                       "policy": job.policy.model_copy(update={"model": model})})
    plan = ResourcePlan.from_roles({"generation": generation.placement})
    samples = []
    quiet = not job.logging.verbose  # the engines' own output in <out's folder>/logs/, as a job's actors' is
    logs = Path(out).parent / "logs" if quiet else None
    with cluster.connect(job.cluster, quiet=quiet) as handle, actor_logs(logs), ray_messages(logs), \
            job_names(job_tag("sample", str(Path(out).parent))):
        placements = cluster.place(plan, handle.nodes(), job.cluster.startup_timeout_s)
        pool = None
        try:
            name, bundles = plan.role_slots("generation")
            pool = GenerationPool.start(answering, placements[name], bundles, tokens)
            log.info("sampling %d prompts x %d with %d %s engine(s)", len(rows),
                     generation.sampling.n_samples_per_prompt, len(pool.group), pool.engine)
            for start in range(0, len(rows), CHUNK):
                chunk = [r["prompt_ids"] for r in rows[start: start + CHUNK]]
                got = pool.generate(chunk, seed=stable_seed(job.seed, "sample", start))
                samples += [{**sample, "prompt_index": sample["prompt_index"] + start} for sample in got]
                log.info("sampled %d/%d prompts", start + len(chunk), len(rows))
        finally:
            if pool is not None:
                pool.close()
            cluster.remove(placements)
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
    return Written(out, pool.engine, len(rows), len(lines), unfinished, count)
