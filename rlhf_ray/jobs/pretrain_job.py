"""The continued-pretraining job: one DeepSpeed learner group trains the causal-LM loss on mmap corpora.

    corpora = open_for_tokenizer(every corpus)        # before any actor starts: a missing or half-written file fails
    group   = start_learner_group(PretrainLearner)    # resume from the newest checkpoint, if any
    for step: group.train_step(step)                  # global batch `step` of the weighted mix, a pure function
    evaluate (held-out perplexity per corpus), export the HF model, write summary.json
"""

from __future__ import annotations

import json
import time

from rlhf_ray.config.jobs import PretrainJob
from rlhf_ray.data.heldout import HeldOutSplit
from rlhf_ray.data.mmap_corpus import open_for_tokenizer
from rlhf_ray.jobs.supervised import learner_kwargs, resolved, run_learner_group, total_steps
from rlhf_ray.learners.pretrain_learner import PretrainLearner


def run_pretrain(job: PretrainJob, stop_after: int | None = None) -> dict:
    """Train, evaluate, export and summarise; `stop_after` checkpoints at that step and returns (run again to
    resume)."""
    started = time.time()
    job, out, tokenizer, tokens = resolved(job)
    data = job.data
    corpora = [open_for_tokenizer(c.path, len(tokenizer)) for c in data.corpora]
    splits = [HeldOutSplit(len(c), data.heldout_fraction, data.heldout_max_samples) for c in corpora]
    train_samples = sum(s.num_train for s in splits)
    steps = total_steps(job, train_samples)
    args = {**learner_kwargs(job, tokens.pad_id), "data": data.model_dump()}
    result = run_learner_group(job, "pretrain", PretrainLearner, steps, stop_after, args)
    if "stopped_at_step" in result:
        return result
    first, last = result["first_eval"], result["last_eval"]
    summary = {"phase": "pretrain", "steps": steps, "train_samples": train_samples,
               "samples_trained": steps * job.global_batch_size, "seconds": round(time.time() - started, 2),
               "corpora": {c.label: {"samples": len(k), "tokens": k.num_tokens, "heldout_samples": s.num_heldout}
                           for c, k, s in zip(data.corpora, corpora, splits)},
               "eval_loss_first": first["eval_loss"], "eval_loss_last": last["eval_loss"],
               "eval_perplexity_first": first["eval_perplexity"], "eval_perplexity": last["eval_perplexity"],
               **{k: v for k, v in last.items() if k.startswith("eval_perplexity/")},
               **{k.replace("/", "_first/"): v for k, v in first.items() if k.startswith("eval_perplexity/")}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
