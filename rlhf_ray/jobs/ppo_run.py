"""The actor groups of one PPO job and the operations its loop composes. The driver holds references: samples,
rollout batches, per-role results and experience live in the object store and move from actor to actor."""

from __future__ import annotations

import contextlib

import logging
import time
from pathlib import Path

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlhf_ray.actors.experience import ExperienceWorker
from rlhf_ray.actors.group import ActorGroup, RemoteCallError, RestartBudget, gather, resilient_gather, results_lost
from rlhf_ray.actors.pool import GenerationPool
from rlhf_ray.actors.reward_function import RewardFunctionWorker
from rlhf_ray.functions import column_arguments
from rlhf_ray.actors.scoring import ReferenceWorker, RewardWorker
from rlhf_ray.algorithms.experience import pack_rollouts, row_bounds
from rlhf_ray.buffer.replay_buffer import ReplayBuffer, TrainingPlan
from rlhf_ray.config.jobs import LearnerRoleSpec, PPOJob
from rlhf_ray.data.split import stable_seed
from rlhf_ray.data.build import same_tokenizer
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.jobs.checkpoints import Checkpoints
from rlhf_ray.envs.episode import EPISODE_COLUMNS, episode_metrics
from rlhf_ray.learners.critic import CriticLearner
from rlhf_ray.distributed import actor_env
from rlhf_ray.learners.group import rendezvous, setup_learner_group, spawn_learner_group
from rlhf_ray.learners.policy import PolicyLearner
from rlhf_ray.learners.resharding import load_group_checkpoint
from rlhf_ray.models.loading import load_tokenizer
from rlhf_ray.models.weight_transport import gpus_shared
from rlhf_ray.plan import ResourcePlan

log = logging.getLogger(__name__)


def _learner_kwargs(job: PPOJob, role: LearnerRoleSpec) -> dict:
    accumulation = role.accumulation_steps(job.train_batch_size)
    deepspeed = role.deepspeed.model_copy(update={"gradient_accumulation_steps": accumulation})
    return dict(model=role.model.model_dump(), optim=role.optim.model_dump(), deepspeed=deepspeed.model_dump(),
                micro_batch_size=role.micro_batch_size, seed=job.seed,
                temperature=job.generation.sampling.temperature)


def merged_metrics(scored: dict, trained: dict) -> dict[str, float]:
    """One update's metrics: those of the experience it trained on (`scored`, from when it was put in the buffer)
    and of the update itself (`trained`)."""
    out = {k: v for k, v in scored.items() if k != "accepted"} | trained
    out.setdefault("kl/mean", out["policy/kl"])  # no old log-probs: the training forward's KL
    if "policy/engine_logprob_gap" in out:
        out.setdefault("generate/logprob_gap", out["policy/engine_logprob_gap"])
        out.setdefault("generate/mismatch_kl", out["policy/engine_mismatch_kl"])
    return out


class ResultsLost(RuntimeError):
    """An iteration's rollout or scores died with a node before its experience was assembled (the step changed
    nothing yet): generate and score it again."""


def weight_transport(job: PPOJob) -> str:
    """auto: the collective transport when policy and engines have GPUs (NCCL), the object store otherwise."""
    chosen = job.generation.weight_sync.transport
    if chosen == "auto":
        gpus = job.policy.placement.num_gpus > 0 and job.generation.placement.num_gpus > 0
        chosen = "collective" if gpus else "object_store"
    return chosen


def collective_or_object_store(requested: str, shared: list[str]) -> str:
    """The transport once the weight-sync group's GPUs are known: NCCL cannot put two ranks on one device, so
    where members share a GPU (`shared`, from gpus_shared) `auto` falls back to the object store and an explicit
    `collective` is refused naming them."""
    if not shared:
        return "collective"
    if requested == "collective":
        raise ValueError(f"generation.weight_sync.transport: collective needs policy rank 0 and every engine on a "
                         f"GPU of its own (NCCL cannot put two ranks on one device), but {'; '.join(shared)}. Use "
                         "transport: auto (the object store here) or whole GPUs (placement.num_gpus: 1)")
    log.info("weight sync: object store (%s; NCCL needs a GPU per member)", "; ".join(shared))
    return "object_store"


def _node_and_gpus(_actor) -> tuple[str, list]:
    """Run in an actor (`__ray_call__`): its node id and the GPU ids Ray assigned it."""
    return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()


def sharded_roles(job: PPOJob) -> tuple[str, ...]:
    """Forward-only roles whose replicas hold shards of one model (ZeRO-3 inference): a dead replica ends the
    attempt, as a dead learner rank does."""
    return tuple(role for role in ("reference", "reward") if getattr(job, role).sharded)


class PPORun:
    def __init__(self, job: PPOJob, plan: ResourcePlan, groups: dict, tokenizer, tokens: TokenConventions | None = None):
        self.job, self.tokenizer = job, tokenizer
        self.tokens = tokens or TokenConventions.from_tokenizer(tokenizer, job.policy.model.path)
        pad, cluster = self.tokens.pad_id, job.cluster
        updates = job.ppo.iterations * job.ppo.ppo_epochs * (job.samples_per_iteration // job.train_batch_size)

        def slots(role):
            name, bundles = plan.role_slots(role)
            return groups[name], bundles

        self.sharded_roles = sharded_roles(job)
        """Forward-only roles whose replicas hold shards of one model: called together, never replaced alone."""
        # every role's processes start at once (imports and model loads overlap); then each is waited for
        ppo = job.ppo
        self.policy = spawn_learner_group(PolicyLearner, "policy", job.policy.placement, *slots("policy"), cluster,
                                          clip_ratio=ppo.clip_ratio, dual_clip=ppo.dual_clip,
                                          clip_ratio_high=ppo.clip_ratio_high,
                                          loss_aggregation=ppo.loss_aggregation, tis_cap=ppo.tis_cap,
                                          pad_token_id=pad, train_batch_size=job.train_batch_size,
                                          kl_loss_coef=ppo.kl_coef if ppo.kl_in_loss else 0.0,
                                          kl_estimator=ppo.kl_estimator,
                                          ema_beta=ppo.ema.beta if ppo.ema.enabled else None,
                                          pretrain_data=ppo.pretrain_data, ptx_coef=ppo.ptx_coef,
                                          **_learner_kwargs(job, job.policy))
        self.critic = None
        if job.critic is not None:
            self.critic = spawn_learner_group(CriticLearner, "critic", job.critic.placement, *slots("critic"),
                                              cluster, clip_value=job.ppo.clip_value, pad_token_id=pad,
                                              **_learner_kwargs(job, job.critic))
        self.reference = self._inference_group(ReferenceWorker, "reference", job.reference.placement,
                                               slots("reference"), model=job.reference.model.model_dump(),
                                               micro_batch_size=job.reference.micro_batch_size,
                                               temperature=job.generation.sampling.temperature,
                                               sharded=job.reference.sharded)
        if not job.reward.is_model:
            http = job.reward.http.model_dump() if job.reward.http else None
            self.reward = self._inference_group(RewardFunctionWorker, "reward", job.reward.placement, slots("reward"),
                                                function=job.reward.function, http=http,
                                                tokenizer=job.policy.model.tokenizer_path)
        else:
            rm_tokenizer = load_tokenizer(job.reward.model)
            bridge = None if same_tokenizer(tokenizer, rm_tokenizer) else job.policy.model.tokenizer_path
            if bridge:
                log.info("reward model tokenizer %s differs from the policy's %s: answers are decoded and "
                         "re-tokenised for it", job.reward.model.tokenizer_path, bridge)
            self.reward = self._inference_group(RewardWorker, "reward", job.reward.placement, slots("reward"),
                                                model=job.reward.model.model_dump(),
                                                micro_batch_size=job.reward.micro_batch_size,
                                                tokens=TokenConventions.from_tokenizer(rm_tokenizer,
                                                                                       job.reward.model.path),
                                                bridge_from=bridge, sharded=job.reward.sharded)
        self.restarts = RestartBudget(cluster.max_actor_restarts)  # engines, reference and reward share it
        self.learner_restarts = 0  # set by the job: how many times it restarted every role after a learner died
        self.pool = GenerationPool.start(job, *slots("generation"), self.tokens, self.restarts, wait=False)
        # The assembler owns every experience object and the buffer holds their references: both live on the
        # driver's node, which goes only with the driver. Placed anywhere, a lost worker node would take them
        # and the experience with them (the learners' fetch then fails with OwnerDiedError).
        on_driver_node = {"scheduling_strategy": NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)}
        self.assembler = ActorGroup(ExperienceWorker, "experience", 1, num_cpus=0,
                                    kwargs={"ppo": job.ppo.model_dump(), "pad_token_id": pad,
                                            "group_size": job.generation.sampling.n_samples_per_prompt,
                                            "max_answer_tokens": job.generation.sampling.max_new_tokens},
                                    call_timeout_s=cluster.call_timeout_s, ray_options=on_driver_node)
        self.buffer = ActorGroup(ReplayBuffer, "replay-buffer", 1, num_cpus=0,
                                 kwargs={"capacity": job.ppo.buffer_capacity, "max_staleness": job.ppo.max_staleness},
                                 call_timeout_s=cluster.call_timeout_s, ray_options=on_driver_node)
        setup_learner_group(self.policy, cluster, updates)
        if self.critic is not None:
            setup_learner_group(self.critic, cluster, updates)
        for group in (self.reference, self.reward, self.pool.group, self.assembler, self.buffer):
            group.wait_ready(cluster.startup_timeout_s)
        for role in self.sharded_roles:  # ZeRO-3 inference groups: one process group each, shards loaded together
            group = getattr(self, role)
            group.call("setup", *rendezvous(group, cluster.startup_timeout_s), cluster.call_timeout_s,
                       timeout=cluster.startup_timeout_s)
        self.transport = weight_transport(job)
        if self.transport == "collective":
            self.transport = collective_or_object_store(job.generation.weight_sync.transport, self._gpus_shared())
        if self.transport == "collective":
            self._form_weight_group()
            self.pool.on_replaced = self._rejoin
        self.version = 0
        self.recent_samples: list[dict] = []
        """The latest rollout's first `logging.samples_per_iteration` rows (token ids, score, dataset columns)."""

    def kill(self) -> None:
        """Kill every actor of the run. Before its placement groups go: an actor killed by the removal of its group
        keeps holding its name, so a restarted run could not take it again; the experience and buffer actors
        live in no group at all."""
        for name in ("policy", "critic", "reference", "reward", "assembler", "buffer"):
            group = getattr(self, name, None)
            if group is not None:
                group.kill()
        if getattr(self, "pool", None) is not None:
            self.pool.group.kill()

    def _inference_group(self, cls, role, placement, slot, **kwargs) -> ActorGroup:
        """The role's replicas, started; the caller waits for them."""
        return ActorGroup(cls, role, placement.replicas, placement_group=slot[0], bundle_indices=slot[1],
                          num_cpus=placement.num_cpus, num_gpus=placement.num_gpus, kwargs=kwargs,
                          call_timeout_s=self.job.cluster.call_timeout_s,
                          start_timeout_s=self.job.cluster.startup_timeout_s, env_vars=actor_env(placement))

    def _split_submit(self, group: ActorGroup, method: str, batch_ref, rows: int) -> tuple[list, list]:
        """Replica i scores its contiguous share of the rows; returns (per-replica args, call refs) in row order."""
        args = [(batch_ref, lo, hi) for lo, hi in row_bounds(rows, len(group))]
        return args, [getattr(actor, method).remote(*a) for actor, a in zip(group.actors, args)]

    def _split_gather(self, group: ActorGroup, method: str, submitted: tuple[list, list]) -> list:
        """Results of `_split_submit`; a replica that died is replaced and its rows scored again (unless it holds a
        shard of a sharded model: then the group cannot go on, as a learner group cannot)."""
        if group.role in self.sharded_roles:
            return group.gather(submitted[1], method)
        return resilient_gather(group, method, submitted[0], submitted[1], self.restarts)

    # ---- one iteration ------------------------------------------------------------------------------------
    def rollout_seed(self, iteration: int) -> int:
        return stable_seed(self.job.seed, "rollout", iteration)

    def experience(self, rollout: dict) -> tuple:
        """Score a rollout on every role at once; returns (reference to the experience, its metrics)."""
        rows = rollout["samples"]
        (assembler,) = self.assembler.actors
        batch = assembler.batch.remote(rollout["refs"])
        calls = {"reference": self._split_submit(self.reference, "logprobs", batch, rows),
                 "reward": self._split_submit(self.reward, "score", batch, rows)}
        if not self.job.old_logprobs_from_training:
            calls["policy"] = self.policy.submit("logprobs", batch)
        if self.critic is not None:
            calls["critic"] = self.critic.submit("values", batch)
        results = {"reference": self._split_gather(self.reference, "logprobs", calls["reference"]),
                   "reward": self._split_gather(self.reward, "score", calls["reward"])}
        if "policy" in calls:
            results["policy"] = self.policy.gather(calls["policy"], "logprobs")
        if self.critic is not None:
            results["critic"] = self.critic.gather(calls["critic"], "values")
        parts = {role: [r["ref"] for r in out] for role, out in results.items()}
        (out,) = self.assembler.gather([assembler.experience.remote(batch, parts["reward"], parts.get("policy", []),
                                                                    parts["reference"], parts.get("critic"),
                                                                    self.job.logging.samples_per_iteration)],
                                       "experience")
        experience, metrics, self.recent_samples = out["ref"], out["metrics"], out["samples"]
        self.experience_rows = out["rows"]  # fewer than the rollout's samples with dynamic sampling
        seconds = {f"compute/{role}_seconds": max(r["seconds"] for r in out) for role, out in results.items()}
        return experience, metrics | seconds

    def put_experience(self, index: int, rollout: dict, prompt_indices: list[int]) -> dict[str, float]:
        """Score rollout `index` into experience and put it in the replay buffer; returns its metrics (logged when
        it is trained on) and `accepted` (False: the buffer refused it as too stale already). Raises ResultsLost
        when a node took results it needed (nothing changed yet)."""
        began = time.perf_counter()
        try:
            experience, metrics = self.experience(rollout)
        except RemoteCallError as err:  # nothing has changed yet: the rollout can be scored again
            if results_lost(err):
                raise ResultsLost(f"rollout {index + 1}: {err}") from err
            raise
        if self.job.generation.vllm.sleep_when_idle and self.job.ppo.mode == "sync":
            self.pool.sleep()  # engines are idle until the weight sync, which wakes them
        roles = [v for k, v in metrics.items() if k.startswith("compute/") and k != "compute/advantages_seconds"]
        metrics["compute/experience_seconds"] = max(roles) + metrics["compute/advantages_seconds"]  # roles at once
        meta = {"version": rollout["version"], "samples": self.experience_rows, "rollout": index,
                "prompt_indices": prompt_indices}
        accepted = self.buffer.call("put", [experience], meta, self.version)[0]
        return metrics | episode_metrics(rollout) | {
            "time/experience": time.perf_counter() - began, "accepted": accepted,
            "time/engine_generate": rollout["engine_seconds"], "generate/tokens": rollout["tokens"],
            "time/engine_busy": rollout["engine_busy_seconds"]}

    def update(self) -> tuple[TrainingPlan | None, dict[str, float]]:
        """Take the oldest fresh experience from the buffer -> PPO epochs on policy and critic -> weights to the
        engines (policy version + 1; unless every policy step was skipped for non-finite gradients). Returns
        (the plan trained on, metrics); (None, {}) when the buffer held nothing fresh enough (then put more)."""
        timer = [time.perf_counter()]
        ppo = self.job.ppo
        (plan,) = self.buffer.call("take", self.version, self.job.train_batch_size, ppo.ppo_epochs, self.job.seed)
        if plan is None:
            return None, {}
        calls = [(self.policy, self.policy.submit("train", plan))]
        if self.critic is not None:
            calls.append((self.critic, self.critic.submit("train", plan)))
        metrics, train_seconds = {}, 0.0
        for group, refs in calls:
            out = group.gather(refs, "train")
            metrics |= out[0]
            train_seconds = max([train_seconds] + [m[f"{group.role}/seconds"] for m in out])
        timer.append(time.perf_counter())
        if metrics["policy/steps_applied"]:
            sync = self.sync_weights()
        else:  # every policy step was skipped (non-finite gradients): same weights, same version, nothing to send
            log.warning("update on rollout %d: every policy optimizer step was skipped (inf / nan gradients); the "
                        "policy stays at version %d and no weights are sent", plan.meta.rollout + 1, self.version)
            sync = {"bytes": 0.0, "gather_seconds": 0.0, "learner_gather_seconds": 0.0, "load_seconds": 0.0,
                    "engine_load_seconds": 0.0}
        timer.append(time.perf_counter())
        return plan, metrics | plan.stats | {
            "time/train": timer[1] - timer[0], "time/sync": timer[2] - timer[1],
            "compute/train_seconds": train_seconds,
            "compute/sync_seconds": sync["learner_gather_seconds"] + sync["engine_load_seconds"],
            "sync/bytes": sync["bytes"], "sync/gather_seconds": sync["gather_seconds"],
            "sync/load_seconds": sync["load_seconds"], "policy_version": self.version,
            "experience/staleness": plan.staleness, "actors/restarts": len(self.restarts.replaced),
            "actors/learner_restarts": self.learner_restarts,
        }

    def step(self, index: int, rollout: dict, prompt_indices: list[int]) -> dict[str, float]:
        """A sync-mode iteration on its own: put rollout `index`'s experience, then the update that takes it;
        their metrics on one line (what a script driving PPORun by hand, or a test, wants)."""
        scored = self.put_experience(index, rollout, prompt_indices)
        plan, trained = self.update()
        if plan is None or plan.meta.rollout != index:
            raise RuntimeError(f"rollout {index} was not the one trained on: the buffer held older or staler "
                               f"experience (use put_experience and update)")
        return merged_metrics(scored, trained)

    def _form_weight_group(self) -> None:
        """Policy rank 0 and every engine join a fresh weight-sync group (again after an engine is replaced)."""
        timeout = self.job.cluster.call_timeout_s
        address = rendezvous(self.policy, timeout)
        world = len(self.pool.group) + 1
        learner = self.policy.submit("join_weight_sync", *address, world, timeout)
        engines = [actor.join_weight_sync.remote(*address, rank + 1, world, timeout)
                   for rank, actor in enumerate(self.pool.group.actors)]
        self.policy.gather(learner, "join_weight_sync")
        self.pool.group.gather(engines, "join_weight_sync")

    def _gpus_shared(self) -> list[str]:
        """Members of the weight-sync group (policy rank 0, every engine) on the same GPU as another."""
        members = [(self.policy.names[0], self.policy.actors[0])] + list(zip(self.pool.group.names,
                                                                               self.pool.group.actors))
        found = gather([actor.__ray_call__.remote(_node_and_gpus) for _, actor in members], [n for n, _ in members],
                       self.job.cluster.call_timeout_s, "GPU ids")
        return gpus_shared(dict(zip([n for n, _ in members], found)))

    def _rejoin(self, rank: int) -> None:
        """Collective transport: a replacement engine joins a new group with everyone, then all get the weights."""
        self._form_weight_group()
        self.sync_weights(bump=False)

    def sync_weights(self, bump: bool = True) -> dict:
        """Policy weights -> every engine, bucket by bucket; the policy version goes up by one (unless `bump` is
        false: a re-sync after an engine was replaced)."""
        start = time.perf_counter()
        bucket_bytes = int(self.job.generation.weight_sync.bucket_mb * 2**20)
        adapters = self.job.generation.weight_sync.lora == "adapter"
        self.version += int(bump)
        if self.transport == "collective":
            learner = self.policy.submit("broadcast_weights", bucket_bytes, adapters)
            engines = self.pool.receive(self.version)
            sent = self.policy.gather(learner, "broadcast_weights")[0]
            loaded = self.pool.group.gather(engines, "receive_weights")
            if stale := [n for n, r in zip(self.pool.group.names, loaded) if r["version"] != self.version]:
                raise RuntimeError(f"{', '.join(stale)} did not reach policy version {self.version}")
            seconds = time.perf_counter() - start
            return {"bytes": float(sent["bytes"]), "gather_seconds": seconds, "learner_gather_seconds": sent["seconds"],
                    "load_seconds": seconds, "engine_load_seconds": 0.0}  # one pipelined transfer: all in the gather
        published = self.policy.call("publish_weights", bucket_bytes, adapters)[0]
        gathered = time.perf_counter()
        loaded = self.pool.broadcast(published["refs"], self.version)
        return {"bytes": float(published["bytes"]), "gather_seconds": gathered - start,
                "learner_gather_seconds": published["seconds"], "load_seconds": loaded["seconds"],
                "engine_load_seconds": loaded["engine_seconds"]}

    # ---- checkpoints --------------------------------------------------------------------------------------
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
        load_group_checkpoint(self.policy, path / "policy", "policy")
        if self.critic is not None:
            load_group_checkpoint(self.critic, path / "critic", "critic")
        self.version = state["policy_version"]
        self.sync_weights(bump=False)
        return state

    # ---- evaluation ---------------------------------------------------------------------------------------
    def evaluate(self, rows: list[dict], rule, samples: int = 0) -> dict[str, float]:
        """Held-out prompts answered greedily (the policy's mode) and, with `samples`, sampled with the training
        settings (the distribution PPO optimises): mean reward score and, with a rule, the task accuracy, as
        `reward` / `task_accuracy` and `sampled_reward` / `sampled_task_accuracy`. (Small: the answers come to the
        driver, which decodes them for the rule.) No prompts: nothing to report."""
        if not rows:
            return {}
        prompt_ids, columns = [r["prompt_ids"] for r in rows], [r.get("columns", {}) for r in rows]
        with self._reward_model_on_every_core():
            out = self._score_answers(self.pool.generate(prompt_ids, seed=0, greedy=True, columns=columns), rows, rule)
            if samples:
                rounds = -(-samples // self.job.generation.sampling.n_samples_per_prompt)
                sampled = self.pool.generate(prompt_ids * rounds, seed=1, columns=columns * rounds)
                out |= {f"sampled_{k}": v for k, v in self._score_answers(sampled, rows, rule).items()}
        return out

    @contextlib.contextmanager
    def _reward_model_on_every_core(self):
        """In sync mode nothing else runs during the evaluation, so a CPU reward model, sized for the experience
        phase it shares with three other roles (often one thread), scores on the node's cores meanwhile."""
        placement = self.job.reward.placement
        if not self.job.reward.is_model or placement.num_gpus > 0 or self.job.ppo.mode != "sync":
            yield
            return
        cores = min(int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n.get("Alive"))
        before = self.reward.call("set_threads", max(1, cores // placement.replicas))
        try:
            yield
        finally:
            self.reward.call("set_threads", before[0])

    def _score_answers(self, samples: list[dict], rows: list[dict], rule) -> dict[str, float]:
        batch = pack_rollouts([s["prompt_ids"] for s in samples], [s["answer_ids"] for s in samples],
                              self.tokens.pad_id, [s.get("answer_mask") for s in samples])
        batch["ended"] = torch.tensor([s["finished"] for s in samples])
        batch["columns"] = [{**rows[s["prompt_index"] % len(rows)].get("columns", {}), **s.get("episode", {})}
                            for s in samples]
        parts = self._split_gather(self.reward, "score",
                                   self._split_submit(self.reward, "score", ray.put(batch), len(samples)))
        out = {"reward": torch.cat(ray.get([p["ref"] for p in parts])).float().mean().item()}
        episodes = [s["episode"] for s in samples if "episode" in s]
        if episodes:  # multi-turn: how the episodes went (tool-call validity: nan when no tool was called)
            totals = {k: sum(e[k] for e in episodes) for k in EPISODE_COLUMNS}
            out.update({k.removeprefix("env/"): v for k, v in
                        episode_metrics({"episodes": totals, "samples": len(episodes)}).items()
                        if k != "env/episode_reward"})
        if rule is not None:
            answers = self.tokenizer.batch_decode([s["answer_ids"] for s in samples], skip_special_tokens=True)
            prompts = [rows[s["prompt_index"] % len(rows)]["prompt"] for s in samples]
            columns = column_arguments(rule, batch["columns"])
            out["task_accuracy"] = sum(rule(prompts, answers, **columns)) / len(samples)
        return out
