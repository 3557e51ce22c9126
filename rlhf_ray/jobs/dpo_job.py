"""The DPO job: a DeepSpeed learner group trains the policy on preference pairs against a frozen reference, which
runs as a Ray role of its own (actors/scoring.ReferenceWorker).

    pairs      = build_phase_data(..., "rm")                     # the pairs share of data.split
    reference  = reference role on its bundles
    precompute: ref_logps(the pairs the steps train on, the held-out pairs), then the reference stops
    learners   = start_learner_group(DPOLearner)                 # resume from the newest checkpoint, if any
    for step:  (on the fly: ref_logps(this step's pairs))   learners.train_step(step)
    evaluate, export the HF model, write summary.json
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import ray
import torch
from tqdm import tqdm

from rlhf_ray.actors.group import ActorGroup, RestartBudget, Slots, Timeouts, resilient_gather
from rlhf_ray.actors.scoring import ReferenceWorker
from rlhf_ray.algorithms.dpo_loss import pack_pairs, pair_sequence_logps
from rlhf_ray.algorithms.experience import row_bounds, row_slices
from rlhf_ray.config.jobs import DPOJob
from rlhf_ray.jobs.checkpoints import Checkpoints
from rlhf_ray.jobs.metrics import MetricsLogger
from rlhf_ray.jobs.restarts import learner_deaths_explained, placed_attempts
from rlhf_ray.jobs.supervised import learner_kwargs, prepared, train_steps
from rlhf_ray.learners.dpo_learner import DPOLearner
from rlhf_ray.distributed import actor_env
from rlhf_ray.learners.learner_group import start_learner_group
from rlhf_ray.learners.schedule import micro_batches
from rlhf_ray.plan import ResourcePlan

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logps.pt"
"""Precomputed reference log-probs, kept in output_dir so a restart or a resumed run does not score again."""
PAIRS_PER_CALL = 256


class ReferenceScores:
    """The reference role: sequence log-probs (chosen, rejected) of pairs, rows spread over its replicas."""

    def __init__(self, job: DPOJob, plan: ResourcePlan, placements: dict, pad_id: int):
        ref = job.dpo.reference
        placement, bundles = plan.role_slots("reference")
        self.group = ActorGroup(ReferenceWorker, "reference", ref.placement.replicas,
                                Slots.of(ref.placement, placements[placement], bundles, actor_env(ref.placement)),
                                kwargs={"model": job.reference_model.model_dump(), "temperature": 1.0,
                                        "micro_batch_size": 2 * ref.micro_batch_size},
                                timeouts=Timeouts.of(job.cluster))
        self.budget = RestartBudget(job.cluster.max_actor_restarts)
        self.pad_id = pad_id

    def wait_ready(self, timeout_s: float) -> "ReferenceScores":
        self.group.wait_ready(timeout_s)
        return self

    def __call__(self, pairs: list[dict]) -> torch.Tensor:
        """[len(pairs), 2]: each pair's reference log-prob of its chosen and of its rejected answer."""
        batch = pack_pairs(pairs, self.pad_id)
        batch_ref = ray.put(batch)
        args = [(batch_ref, lo, hi) for lo, hi in row_bounds(2 * len(pairs), len(self.group))]
        refs = [actor.logprobs.remote(*a) for actor, a in zip(self.group.actors, args)]
        parts = resilient_gather(self.group, "logprobs", args, refs, self.budget)
        token_logps = torch.cat(ray.get([part.ref for part in parts], timeout=self.group.call_timeout_s))
        sums = pair_sequence_logps(token_logps, batch.action_mask)
        return torch.stack([sums["chosen"], sums["rejected"]], dim=1).double()

    def all_of(self, pairs: list[dict], desc: str, progress: bool) -> torch.Tensor:
        """The same for many pairs, PAIRS_PER_CALL at a time, with a progress bar."""
        parts = [self(pairs[s]) for s in tqdm(row_slices(len(pairs), PAIRS_PER_CALL), desc=desc, disable=not progress)]
        return torch.cat(parts) if parts else torch.zeros(0, 2, dtype=torch.float64)

    def kill(self) -> None:
        self.group.kill()


def reference_key(job: DPOJob, data_file: str, steps: int) -> str:
    """What the precomputed log-probs depend on: the pairs (their cache file names every input), which of them the
    steps train on, and the model."""
    parts = {"data": Path(data_file).name, "model": job.reference_model.model_dump(mode="json"), "steps": steps,
             "batches": [job.placement.replicas, job.global_batch_size, job.train.micro_batch_size, job.seed]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def load_precomputed(path: Path, key: str) -> dict | None:
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    return saved if saved.get("key") == key else None


def save_precomputed(path: Path, saved: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(saved, tmp)
    os.replace(tmp, path)


def step_pairs(job: DPOJob, train_pairs: int, steps: range) -> list[int]:
    """Indices of the training pairs that optimizer steps `steps` train on, over every rank."""
    ranks = job.placement.replicas
    return sorted({i for step in steps for rank in range(ranks) for micro in micro_batches(
        train_pairs, job.global_batch_size, job.train.micro_batch_size, ranks, rank, step, job.seed) for i in micro})


def hand_in(learners: ActorGroup, split: str, indices: list[int], logps: torch.Tensor) -> None:
    learners.call("set_reference_logps", split, indices, logps[:, 0].tolist(), logps[:, 1].tolist())


def run_dpo(job: DPOJob, stop_after: int | None = None) -> dict:
    """Train, evaluate, export and summarise; with `stop_after`, checkpoint at that step and return (run again to
    resume)."""
    job, out, tokens, data, steps = prepared(job, "rm")  # the pairs share of data.split
    checkpoints = Checkpoints(out, job.checkpoint.keep_last)
    metrics = MetricsLogger(out, job.logging, run_name=f"dpo-{out.name}")
    key, saved_file = reference_key(job, data.cache_file, steps), out / REFERENCE_FILE
    started = time.time()

    def attempt(job, placements: dict, plan: ResourcePlan, restarts: int) -> dict:
        learners = reference = None
        try:
            reference = ReferenceScores(job, plan, placements, tokens.pad_id)
            placement, bundles = plan.role_slots("learner")
            learners = start_learner_group(DPOLearner, "dpo-learner", job.placement, placements[placement], bundles,
                                           job.cluster, steps, beta=job.dpo.beta, loss=job.dpo.loss,
                                           label_smoothing=job.dpo.label_smoothing, rpo_alpha=job.dpo.rpo_alpha,
                                           **learner_kwargs(job, tokens.pad_id))
            learners.call("set_data", ray.put(data.train), ray.put(data.eval))
            reference.wait_ready(job.cluster.startup_timeout_s)
            before_step = _reference_logps(job, reference, learners, data, steps, key, saved_file)
            if before_step is None:
                reference.kill()  # precomputed: its memory goes back to the learners
            with learner_deaths_explained(checkpoints, ("dpo-learner",)):
                return train_steps(job, "dpo", learners, checkpoints, metrics, steps, stop_after, restarts, out,
                                   before_step)
        finally:
            for group in (learners, reference):
                if group is not None:
                    group.kill()

    result = placed_attempts(job, checkpoints, metrics, attempt)
    if "stopped_at_step" in result:
        return result
    first, last = result["first_eval"], result["last_eval"]
    summary = {"phase": "dpo", "steps": steps, "train_pairs": len(data.train), "seconds": round(time.time() - started, 2),
               "data_report": data.report, "reference": "precomputed" if job.dpo.reference.precompute else "on the fly",
               **{f"{k}_first": first[k] for k in ("eval_accuracy", "eval_logp_accuracy", "eval_margin", "eval_loss")},
               **{k: last[k] for k in ("eval_accuracy", "eval_logp_accuracy", "eval_margin", "eval_loss",
                                       "eval_chosen_reward",
                                       "eval_rejected_reward", "eval_chosen_logp", "eval_rejected_logp")}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _reference_logps(job: DPOJob, reference: ReferenceScores, learners: ActorGroup, data, steps: int, key: str,
                     saved_file: Path):
    """Hands the learners the reference log-probs of the held-out pairs, and when precomputing of every pair the
    run's steps train on (None is returned then); otherwise returns the hook that scores each step's pairs just
    before it."""
    progress = job.logging.progress
    if job.dpo.reference.precompute:
        saved = load_precomputed(saved_file, key)
        if saved is None:
            used = step_pairs(job, len(data.train), range(steps))
            saved = {"key": key, "train_indices": used,
                     "train": reference.all_of([data.train[i] for i in used], "reference log-probs (train)", progress),
                     "eval": reference.all_of(data.eval, "reference log-probs (held-out)", progress)}
            save_precomputed(saved_file, saved)
        else:
            log.info("reference log-probs from %s", saved_file)
        hand_in(learners, "train", list(saved["train_indices"]), saved["train"])
        hand_in(learners, "eval", list(range(len(data.eval))), saved["eval"])
        return None
    hand_in(learners, "eval", list(range(len(data.eval))), reference.all_of(data.eval, "reference (held-out)", progress))

    def before_step(step: int) -> None:
        indices = step_pairs(job, len(data.train), range(step, step + 1))
        hand_in(learners, "train", indices, reference([data.train[i] for i in indices]))

    return before_step
