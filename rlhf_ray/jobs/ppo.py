"""The PPO job (synchronous mode): one iteration reads as the RL dataflow.

    prompts  = next batch of PPO-phase prompts
    samples  = generation_pool.generate(prompts)                       # tagged with the policy version
    in parallel: old_logp = policy.logprobs   ref_logp = reference.logprobs
                 values   = critic.values     scores   = reward.score  (or the reward function)
    experience = make_experience(...)                                   # pure functions (algorithms/)
    in parallel: policy.train(experience)      critic.train(experience)
    generation_pool.broadcast(policy weights)                           # version += 1
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import ray
import torch
from tqdm import tqdm

from rlhf_ray import cluster
from rlhf_ray.actors.group import ActorGroup
from rlhf_ray.actors.pool import GenerationPool
from rlhf_ray.actors.scoring import ReferenceWorker, RewardWorker
from rlhf_ray.algorithms.experience import make_experience, pack_rollouts
from rlhf_ray.compare import load_function
from rlhf_ray.config.jobs import FINAL_MODEL_DIR, LearnerRoleSpec, PPOJob
from rlhf_ray.data.build import build_phase_data
from rlhf_ray.data.registry import task_rule
from rlhf_ray.data.split import stable_seed
from rlhf_ray.jobs.checkpoints import Checkpoints
from rlhf_ray.jobs.metrics import MetricsLogger
from rlhf_ray.learners.critic import CriticLearner
from rlhf_ray.learners.group import actor_env, start_learner_group
from rlhf_ray.learners.policy import PolicyLearner
from rlhf_ray.learners.schedule import micro_batches
from rlhf_ray.models.loading import load_tokenizer
from rlhf_ray.plan import ResourcePlan

log = logging.getLogger(__name__)


def _learner_kwargs(job: PPOJob, role: LearnerRoleSpec) -> dict:
    accumulation = role.accumulation_steps(job.train_batch_size)
    deepspeed = role.deepspeed.model_copy(update={"gradient_accumulation_steps": accumulation})
    return dict(model=role.model.model_dump(), optim=role.optim.model_dump(), deepspeed=deepspeed.model_dump(),
                micro_batch_size=role.micro_batch_size, seed=job.seed, train_batch_size=job.train_batch_size,
                ppo_epochs=job.ppo.ppo_epochs, temperature=job.generation.sampling.temperature)


class PPORun:
    """The groups of one PPO job and the operations the loop composes."""

    def __init__(self, job: PPOJob, plan: ResourcePlan, groups: dict, tokenizer):
        self.job, self.tokenizer = job, tokenizer
        pad, timeout = tokenizer.pad_token_id, job.cluster
        iterations = job.ppo.iterations * job.ppo.ppo_epochs * (job.samples_per_iteration // job.train_batch_size)

        def slots(role):
            name, bundles = plan.role_slots(role)
            return groups[name], bundles

        self.policy = start_learner_group(PolicyLearner, "policy", job.policy.placement, *slots("policy"), timeout,
                                          iterations, clip_ratio=job.ppo.clip_ratio, dual_clip=job.ppo.dual_clip,
                                          **_learner_kwargs(job, job.policy))
        self.critic = None
        if job.critic is not None:
            self.critic = start_learner_group(CriticLearner, "critic", job.critic.placement, *slots("critic"),
                                              timeout, iterations, clip_value=job.ppo.clip_value, pad_token_id=pad,
                                              **_learner_kwargs(job, job.critic))
        self.reference = self._inference_group(ReferenceWorker, "reference", job.reference.placement,
                                               slots("reference"), model=job.reference.model.model_dump(),
                                               micro_batch_size=job.reference.micro_batch_size,
                                               temperature=job.generation.sampling.temperature)
        self.reward_fn = load_function(job.reward.function) if job.reward.function else None
        self.reward = None
        if self.reward_fn is None:
            self.reward = self._inference_group(RewardWorker, "reward", job.reward.placement, slots("reward"),
                                                model=job.reward.model.model_dump(),
                                                micro_batch_size=job.reward.micro_batch_size, pad_token_id=pad)
        self.pool = GenerationPool.start(job, *slots("generation"), tokenizer.eos_token_id, pad)
        self.version = 0

    def _inference_group(self, cls, role, placement, slot, **kwargs) -> ActorGroup:
        group = ActorGroup(cls, role, placement.replicas, placement_group=slot[0], bundle_indices=slot[1],
                           num_cpus=placement.num_cpus, num_gpus=placement.num_gpus, kwargs=kwargs,
                           call_timeout_s=self.job.cluster.call_timeout_s,
                           start_timeout_s=self.job.cluster.startup_timeout_s, env_vars=actor_env(placement))
        return group.wait_ready(self.job.cluster.startup_timeout_s)

    # ---- one iteration ------------------------------------------------------------------------------------
    def rollout(self, prompt_rows: list[dict], seed: int, greedy: bool = False) -> tuple[list[dict], dict]:
        samples = self.pool.generate([r["prompt_ids"] for r in prompt_rows], seed=seed, greedy=greedy)
        batch = pack_rollouts([s["prompt_ids"] for s in samples], [s["answer_ids"] for s in samples],
                              self.tokenizer.pad_token_id)
        batch["ended"] = torch.tensor([s["finished"] for s in samples])
        return samples, batch

    def _split_call(self, group: ActorGroup, method: str, batch: dict) -> torch.Tensor:
        """Contiguous chunks of the batch, one per replica, each put in the object store once."""
        n, k = batch["sequences"].shape[0], len(group)
        bounds = [round(i * n / k) for i in range(k + 1)]
        parts = [{key: (v[bounds[i]: bounds[i + 1]] if v.dim() else v) for key, v in batch.items()}
                 for i in range(k)]
        return torch.cat(group.call_each(method, [(ray.put(p),) for p in parts]))

    def scores(self, samples: list[dict], batch: dict, prompt_rows: list[dict]) -> torch.Tensor:
        if self.reward_fn is not None:
            prompts = [prompt_rows[s["prompt_index"]]["prompt"] for s in samples]
            answers = self.tokenizer.batch_decode([s["answer_ids"] for s in samples], skip_special_tokens=True)
            try:
                return torch.tensor([float(v) for v in self.reward_fn(prompts, answers)])
            except Exception as exc:
                raise RuntimeError(f"reward function {self.job.reward.function} raised on a batch whose first "
                                   f"sample is {prompts[0]!r} -> {answers[0]!r}: {exc}") from exc
        return self._split_call(self.reward, "score", batch)

    def step(self, iteration: int, prompt_rows: list[dict]) -> dict[str, float]:
        timer = {"start": time.perf_counter()}
        samples, batch = self.rollout(prompt_rows, stable_seed(self.job.seed, "rollout", iteration))
        timer["generate"] = time.perf_counter()
        batch_ref = ray.put(batch)
        policy_refs = self.policy.submit("logprobs", batch_ref)
        critic_refs = self.critic.submit("values", batch_ref) if self.critic else None
        ref_logp = self._split_call(self.reference, "logprobs", batch)
        scores = self.scores(samples, batch, prompt_rows)
        old_logp = torch.cat(self.policy.gather(policy_refs, "logprobs"))
        values = torch.cat(self.critic.gather(critic_refs, "values")) if self.critic else None
        timer["experience"] = time.perf_counter()
        experience = make_experience(scores, old_logp, ref_logp, values, batch["action_mask"], batch["ended"],
                                     self.job.ppo, self.job.generation.sampling.n_samples_per_prompt)
        train_ref = ray.put({**batch, **experience})
        refs = self.policy.submit("train", train_ref, iteration)
        critic_train = self.critic.submit("train", train_ref, iteration) if self.critic else None
        metrics = self.policy.gather(refs, "train")[0]
        if critic_train is not None:
            metrics |= self.critic.gather(critic_train, "train")[0]
        timer["train"] = time.perf_counter()
        sync = self.sync_weights()
        timer["sync"] = time.perf_counter()
        lengths = batch["action_mask"].sum(-1)
        return metrics | {
            "reward/mean": scores.mean().item(), "kl/mean": experience["kl"].mean().item(),
            "answer/length": lengths.mean().item(), "answer/ended": batch["ended"].float().mean().item(),
            "time/generate": timer["generate"] - timer["start"], "time/experience": timer["experience"] - timer["generate"],
            "time/train": timer["train"] - timer["experience"], "time/sync": timer["sync"] - timer["train"],
            "sync/bytes": sync["bytes"], "sync/gather_seconds": sync["gather_seconds"],
            "sync/load_seconds": sync["load_seconds"], "policy_version": self.version,
        }

    def sync_weights(self) -> dict:
        """Policy weights -> every engine, in buckets through the object store; the policy version goes up by one."""
        start = time.perf_counter()
        refs, nbytes = self.policy.call("publish_weights", int(self.job.generation.weight_sync.bucket_mb * 2**20))[0]
        published = time.perf_counter()
        self.version += 1
        loaded = self.pool.broadcast(refs, self.version)
        return {"bytes": float(nbytes), "gather_seconds": published - start, "load_seconds": loaded["seconds"]}

    def save(self, checkpoints: Checkpoints, iteration: int, extra: dict) -> None:
        """Policy and critic engines (weights, optimizer, scheduler, RNG) of every rank, then the loop state."""
        staging = checkpoints.staging(iteration)
        refs = self.policy.submit("save_checkpoint", str(staging / "policy"), {"iteration": iteration})
        if self.critic is not None:
            self.critic.call("save_checkpoint", str(staging / "critic"), {"iteration": iteration})
        self.policy.gather(refs, "save_checkpoint")
        checkpoints.commit(staging, iteration, {"policy_version": self.version, **extra})

    def restore(self, path: Path) -> dict:
        """Load the newest checkpoint and bring the engines to its policy version."""
        state = Checkpoints.state(path)
        self.policy.call("load_checkpoint", str(path / "policy"))
        if self.critic is not None:
            self.critic.call("load_checkpoint", str(path / "critic"))
        self.version = state["policy_version"] - 1
        self.sync_weights()
        return state

    def evaluate(self, rows: list[dict], rule) -> dict[str, float]:
        """Greedy answers to held-out prompts: mean reward score and, with a rule, the task accuracy."""
        samples, batch = self.rollout(rows, seed=0, greedy=True)
        out = {"reward": self.scores(samples, batch, rows).mean().item()}
        if rule is not None:
            answers = self.tokenizer.batch_decode([s["answer_ids"] for s in samples], skip_special_tokens=True)
            out["task_accuracy"] = sum(rule([rows[s["prompt_index"]]["prompt"] for s in samples], answers)) / len(rows)
        return out


def not_yet_supported(job: PPOJob) -> list[str]:
    """Options that validate (they are part of the config contract) but this version's driver cannot honour:
    refused before any work starts rather than silently ignored."""
    problems = []
    if job.ppo.mode == "async":
        problems.append("ppo.mode: async is not implemented yet; use sync")
    if job.ppo.ema.enabled:
        problems.append("ppo.ema.enabled: the EMA policy is not implemented yet")
    if job.ppo.pretrain_data:
        problems.append("ppo.pretrain_data: the pretraining-mix loss is not implemented yet")
    return problems


def run_ppo(job: PPOJob, stop_after: int | None = None) -> dict:
    """Run the PPO job; with `stop_after`, checkpoint after that iteration and return (run again to resume)."""
    if problems := not_yet_supported(job):
        raise ValueError("this version cannot run the config as given:\n  " + "\n  ".join(problems))
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(job.policy.model)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, job.data.cache_dir or out / "data_cache")
    eval_rows = data.eval[: job.ppo.eval_prompts]
    rule = task_rule(job.data.datasets[0].name) if len(job.data.datasets) == 1 else None
    metrics = MetricsLogger(out, job.logging, run_name=f"ppo-{out.name}")
    checkpoints = Checkpoints(out, job.checkpoint.keep_last)
    started = time.time()
    with cluster.connect(job.cluster) as handle:
        plan = ResourcePlan.from_roles(job.placement_roles())
        groups = cluster.place(plan, handle.nodes(), job.cluster.startup_timeout_s)
        try:
            run = PPORun(job, plan, groups, tokenizer)
            latest = checkpoints.latest() if job.checkpoint.resume else None
            if latest is not None:
                state = run.restore(latest)
                start, before = state["step"], state["eval_before"]
                log.info("resumed PPO from %s (iteration %d, policy version %d)", latest, start, run.version)
            else:
                start, before = 0, run.evaluate(eval_rows, rule)
                metrics.log(0, {f"eval/{k}": v for k, v in before.items()})
            end = min(job.ppo.iterations, stop_after) if stop_after is not None else job.ppo.iterations
            bar = tqdm(range(start, end), desc="ppo", initial=start, total=job.ppo.iterations,
                       disable=not job.logging.progress)
            for iteration in bar:
                (indices,) = micro_batches(len(data.train), job.ppo.rollout_batch_size, job.ppo.rollout_batch_size,
                                           1, 0, iteration, job.seed)
                result = run.step(iteration, [data.train[i] for i in indices])
                bar.set_postfix(reward=f"{result['reward/mean']:.3f}", kl=f"{result['kl/mean']:.3f}")
                if (iteration + 1) % job.logging.log_every_steps == 0:
                    metrics.log(iteration + 1, result)
                every = job.checkpoint.every_steps
                if (every and (iteration + 1) % every == 0) or iteration + 1 == end:
                    run.save(checkpoints, iteration + 1, {"eval_before": before})
            if end < job.ppo.iterations:
                return {"stopped_at_iteration": end, "iterations": job.ppo.iterations}
            after = run.evaluate(eval_rows, rule)
            metrics.log(job.ppo.iterations, {f"eval/{k}": v for k, v in after.items()})
            run.policy.call("export_hf", str(out / FINAL_MODEL_DIR))
        finally:
            cluster.remove(groups)
            metrics.close()
    summary = {"iterations": job.ppo.iterations, "seconds": round(time.time() - started, 2),
               "reward_before": before["reward"], "reward_after": after["reward"], "eval_prompts": len(eval_rows)}
    if "task_accuracy" in before:
        summary.update(task_accuracy_before=before["task_accuracy"], task_accuracy_after=after["task_accuracy"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
