"""The actor groups of one PPO run, started and killed together: the policy and critic learner groups, the reference,
teacher (distillation) and reward replicas, the generation pool, and, on the driver's node, the experience
assembler and the replay buffer. Their life (start, kill, checkpoints) and training the learners on a take from the
buffer are here; scoring a rollout on every role is jobs/ppo/scoring.py's. The driver passes references, the
tensors move from actor to actor in the object store."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlhf_ray.actors.http_reward import credentials
from rlhf_ray.actors.experience_worker import ExperienceWorker
from rlhf_ray.actors.group import ActorGroup, RestartBudget, Slots, Timeouts
from rlhf_ray.algorithms.losses import PolicyLoss
from rlhf_ray.actors.pool import GenerationPool
from rlhf_ray.actors.reward_function import RewardFunctionWorker
from rlhf_ray.actors.scoring import ReferenceWorker, RewardWorker
from rlhf_ray.buffer.replay_buffer import ReplayBuffer, Minibatches
from rlhf_ray.config.ppo_job import InferenceRoleSpec, LearnerRoleSpec, PPOJob
from rlhf_ray.data.build import same_tokenizer
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.distributed import actor_env
from rlhf_ray.learners.critic import CriticLearner
from rlhf_ray.learners.learner_group import rendezvous, setup_learner_group, spawn_learner_group
from rlhf_ray.learners.policy import PolicyLearner
from rlhf_ray.learners.ppo_base import TrainReport
from rlhf_ray.jobs.ppo.scoring import Scorer
from rlhf_ray.learners.resharding import load_group_checkpoint
from rlhf_ray.models.loading import load_tokenizer
from rlhf_ray.plan import ResourcePlan

log = logging.getLogger(__name__)


def sharded_roles(job: PPOJob) -> tuple[str, ...]:
    """Forward-only roles whose replicas hold shards of one model (ZeRO-3 inference): a dead replica ends the
    attempt, as a dead learner rank does."""
    return tuple(role for role in ("reference", "teacher", "reward")
                 if getattr(job, role) is not None and getattr(job, role).sharded)


def learner_groups(job: PPOJob) -> tuple[str, ...]:
    """The roles whose ranks form a ZeRO group (a dead rank ends the attempt): the learners and sharded roles."""
    return ("policy", "critic", *sharded_roles(job))


@dataclass
class Trained:
    """The learners' report of one update: rank 0's TrainReport of each group that trained (its statistics stand for
    the group's: they are all-reduced) and the compute time."""

    policy: TrainReport | None
    """None: the policy did not train (the critic's warm-up)."""
    critic: TrainReport | None
    """None: no critic."""
    seconds: float
    """The slowest rank's compute seconds."""
    wall: float
    """From the call to the last result, at the driver."""

    @property
    def steps_applied(self) -> int:
        """Policy optimizer steps that changed the weights (0: the policy did not train, or every one of its steps was
        skipped for a non-finite gradient): whether the engines need new weights."""
        return self.policy.steps_applied if self.policy is not None else 0

    def metrics(self) -> dict[str, float]:
        """`policy/...` and `critic/...`."""
        return {name: value for report in (self.policy, self.critic) if report is not None
                for name, value in report.metrics().items()}


def _learner_kwargs(job: PPOJob, name: str) -> dict:
    role: LearnerRoleSpec = getattr(job, name)
    accumulation = role.accumulation_steps(job.train_batch_size)
    deepspeed = role.deepspeed.model_copy(update={"gradient_accumulation_steps": accumulation})
    return dict(model=role.model.model_dump(), optim=role.optim.model_dump(), deepspeed=deepspeed.model_dump(),
                micro_batch_size=role.micro_batch_size, max_tokens_per_micro_batch=role.max_tokens_per_micro_batch,
                pack_sequences=role.pack_sequences, seed=job.seed,
                temperature=job.generation.sampling.temperature, scoring_threads=job.scoring_threads.get(name))


class RoleWorkers:
    def __init__(self, job: PPOJob, plan: ResourcePlan, placements: dict, tokenizer, tokens: TokenConventions):
        """Start every role's processes at once (imports and model loads overlap), then wait for each."""
        self.job, self.tokens = job, tokens
        pad, cluster, ppo = tokens.pad_id, job.cluster, job.ppo
        steps_per_iteration = ppo.ppo_epochs * (job.samples_per_iteration // job.train_batch_size)

        def slots(role):
            name, bundles = plan.role_slots(role)
            return placements[name], bundles

        self.sharded = sharded_roles(job)
        self.policy = spawn_learner_group(PolicyLearner, "policy", job.policy.placement, *slots("policy"), cluster,
                                          loss=PolicyLoss(ppo.clip_ratio, ppo.dual_clip, ppo.clip_ratio_high,
                                                          ppo.loss_aggregation, ppo.tis_cap,
                                                          ppo.kl_coef if ppo.kl_in_loss else 0.0, ppo.kl_estimator),
                                          pad_token_id=pad, train_batch_size=job.train_batch_size,
                                          ema_beta=ppo.ema.beta if ppo.ema.enabled else None,
                                          pretrain_data=ppo.pretrain_data, ptx_coef=ppo.ptx_coef,
                                          **_learner_kwargs(job, "policy"))
        self.critic = None
        if job.critic is not None:
            self.critic = spawn_learner_group(CriticLearner, "critic", job.critic.placement, *slots("critic"),
                                              cluster, clip_value=ppo.clip_value, pad_token_id=pad,
                                              **_learner_kwargs(job, "critic"))
        self.reference = None  # none when no KL term reads its log-probs
        if job.reference is not None:
            self.reference = self._logprob_group("reference", job.reference, slots("reference"))
        self.teacher = None  # on-policy distillation: the teacher's log-probs of the policy's tokens
        if job.teacher is not None:
            self.teacher = self._logprob_group("teacher", job.teacher, slots("teacher"))
        self.reward = self._reward_group(job, tokenizer, slots("reward"))
        self.restarts = RestartBudget(cluster.max_actor_restarts)  # engines, reference and reward share it
        self.pool = GenerationPool.start(job, *slots("generation"), tokens, self.restarts, wait=False)
        # The assembler owns every experience object and the buffer holds their references: both live on the
        # driver's node, which goes only with the driver. Placed anywhere, a lost worker node would take them
        # and the experience with them (the learners' fetch then fails with OwnerDiedError).
        on_driver_node = Slots(num_cpus=0, ray_options={"scheduling_strategy": NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)})
        timeouts = Timeouts(call_s=cluster.call_timeout_s)
        self.assembler = ActorGroup(ExperienceWorker, "experience", 1, on_driver_node, timeouts=timeouts,
                                    kwargs={"ppo": ppo.model_dump(), "pad_token_id": pad,
                                            "group_size": job.generation.sampling.n_samples_per_prompt,
                                            "max_answer_tokens": job.generation.sampling.max_new_tokens})
        self.buffer = ActorGroup(ReplayBuffer, "replay-buffer", 1, on_driver_node, timeouts=timeouts,
                                 kwargs={"capacity": ppo.buffer_capacity, "max_staleness": ppo.max_staleness})
        setup_learner_group(self.policy, cluster, (ppo.iterations - ppo.critic_warmup) * steps_per_iteration)
        if self.critic is not None:
            setup_learner_group(self.critic, cluster, ppo.iterations * steps_per_iteration)
        for group in (self.reference, self.teacher, self.reward, self.pool.group, self.assembler, self.buffer):
            if group is not None:
                group.wait_ready(cluster.startup_timeout_s)
        for role in self.sharded:  # ZeRO-3 inference groups: one process group each, shards loaded together
            group = getattr(self, role)
            group.call("setup", *rendezvous(group, cluster.startup_timeout_s), cluster.call_timeout_s,
                       timeout=cluster.startup_timeout_s)
        self.scorer = Scorer(job, self)

    def _reward_group(self, job: PPOJob, tokenizer, slot) -> ActorGroup:
        """A reward function or server behind the same contract as a reward model (which may have a tokenizer of
        its own: its answers are then decoded and re-tokenised for it)."""
        if not job.reward.is_model:
            http = job.reward.http.model_dump() if job.reward.http else None
            secrets = credentials(job.reward.http) if job.reward.http else None  # arguments: not on the dashboard
            return self._inference_group(RewardFunctionWorker, "reward", job.reward.placement, slot,
                                         function=job.reward.function, http=http, http_credentials=secrets,
                                         tokenizer=job.policy.model.tokenizer_path)
        rm_tokenizer = load_tokenizer(job.reward.model)
        bridge = None if same_tokenizer(tokenizer, rm_tokenizer) else job.policy.model.tokenizer_path
        if bridge:
            log.info("reward model tokenizer %s differs from the policy's %s: answers are decoded and re-tokenised "
                     "for it", job.reward.model.tokenizer_path, bridge)
        return self._inference_group(RewardWorker, "reward", job.reward.placement, slot,
                                     model=job.reward.model.model_dump(), micro_batch_size=job.reward.micro_batch_size,
                                     max_tokens_per_micro_batch=job.reward.max_tokens_per_micro_batch,
                                     pack_sequences=job.reward.pack_sequences,
                                     tokens=TokenConventions.from_tokenizer(rm_tokenizer, job.reward.model.path),
                                     bridge_from=bridge, sharded=job.reward.sharded)

    def _logprob_group(self, role: str, spec: InferenceRoleSpec, slot) -> ActorGroup:
        """A frozen model scoring the log-probs of sampled tokens (the reference, or a distillation teacher)."""
        return self._inference_group(ReferenceWorker, role, spec.placement, slot, model=spec.model.model_dump(),
                                     micro_batch_size=spec.micro_batch_size,
                                     max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch,
                                     pack_sequences=spec.pack_sequences,
                                     temperature=self.job.generation.sampling.temperature, sharded=spec.sharded)

    def _inference_group(self, cls, role, placement, slot, **kwargs) -> ActorGroup:
        """The role's replicas, started; the caller waits for them."""
        return ActorGroup(cls, role, placement.replicas, Slots.of(placement, *slot, actor_env(placement)),
                          kwargs=kwargs, timeouts=Timeouts.of(self.job.cluster))

    def peak_memory(self) -> dict[str, int]:
        """Each role's peak bytes (its largest replica) above what its processes held before their models: what the
        plan predicts (memory/probe.py). A reward function or server has no model and no entry."""
        groups = {"policy": self.policy, "critic": self.critic, "reference": self.reference, "teacher": self.teacher,
                  "reward": self.reward if self.job.reward.is_model else None, "generation": self.pool.group}
        return {role: max(p["bytes"] for p in group.call("peak_memory"))
                for role, group in groups.items() if group is not None}

    def kill(self) -> None:
        """Kill every actor of the run. Before its placement groups go: an actor killed by the removal of its group
        keeps holding its name, so a restarted run could not take it again; the experience and buffer actors
        live in no group at all. First the policy's file in shared memory (transport ipc) is removed and the engines
        shut down (GenerationPool.close: vLLM's files, the adapter folder): a killed process cannot remove them (a
        later learner or engine removes those named after a dead process)."""
        if self.policy is not None:
            with contextlib.suppress(Exception):  # dead or hung: the next learner on the node sweeps the file
                self.policy.call("release_shared_memory", timeout=10)
        self.pool.close()
        for group in (self.policy, self.critic, self.reference, self.teacher, self.reward, self.assembler,
                      self.buffer):
            if group is not None:
                group.kill()

    # ---- training -------------------------------------------------------------------------------------------
    def train(self, minibatches: Minibatches, policy: bool = True) -> Trained:
        """PPO epochs on the experience the mini-batches index: policy and critic groups at once, every rank of each
        (`policy` False: the critic alone, as in its warm-up)."""
        began = time.perf_counter()
        calls = [(self.policy, self.policy.submit("train", minibatches))] if policy else []
        if self.critic is not None:
            calls.append((self.critic, self.critic.submit("train", minibatches)))
        reports, seconds = {}, 0.0
        for group, refs in calls:
            ranks: list[TrainReport] = group.gather(refs, "train")
            reports[ranks[0].role] = ranks[0]
            seconds = max([seconds] + [r.seconds for r in ranks])
        return Trained(reports.get("policy"), reports.get("critic"), seconds, time.perf_counter() - began)

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def save(self, staging: Path, iteration: int) -> None:
        """Policy and critic engines (weights, optimizer, scheduler, RNG) of every rank."""
        refs = self.policy.submit("save_checkpoint", str(staging / "policy"), {"iteration": iteration})
        if self.critic is not None:
            self.critic.call("save_checkpoint", str(staging / "critic"), {"iteration": iteration})
        self.policy.gather(refs, "save_checkpoint")

    def restore(self, path: Path) -> None:
        """Every rank of policy and critic loads the checkpoint (on another rank count: resharded once)."""
        load_group_checkpoint(self.policy, path / "policy", "policy")
        if self.critic is not None:
            load_group_checkpoint(self.critic, path / "critic", "critic")
