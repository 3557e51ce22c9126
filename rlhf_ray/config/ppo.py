"""PPO hyper-parameters. Defaults are DeepSpeed-Chat's (reference/seeds_dschat.md, step 3)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel
from rlhf_ray.config.estimators import OPTIONS, Estimator, estimator, readers
from rlhf_ray.config.paths import PathField

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


class EmaSpec(StrictModel):
    """An exponential moving average of the policy, saved beside it (DeepSpeed-Chat `--enable_ema`)."""

    enabled: bool = False
    """Keep an EMA copy of the policy."""
    beta: float = Field(0.992, gt=0, lt=1)
    """EMA decay per policy update."""


class DynamicSamplingSpec(StrictModel):
    """DAPO's dynamic sampling (grpo and rloo): a group whose answers all score the same has zero advantage and
    teaches nothing, so each iteration samples `oversample` x rollout_batch_size prompts and trains on
    rollout_batch_size groups, those with differing scores first; if too few differ, equal groups fill the rest
    (dynamic/informative_groups shows how often)."""

    enabled: bool = False
    oversample: float = Field(2.0, ge=1)
    """Prompts sampled per prompt trained on."""
    fill: bool = True
    """When fewer than rollout_batch_size groups differ: true, equal groups fill the batch (every update the same
    size); false, only the groups that differ train (at least one): a smaller update that costs less to score and
    train. A filled group's advantages are zero, so it adds to the loss only through the KL term (and the token
    mean's count); an iteration's optimizer steps are fewer when ppo.train_batch_size cuts fewer rows."""


class PPOSpec(StrictModel):
    """The RL loop: rollout size, reward shaping, advantage estimation, losses, and sync/async mode."""

    iterations: int = Field(100, ge=1)
    """Rollout -> experience -> train -> weight sync cycles."""
    rollout_batch_size: int = Field(16, ge=1)
    """Prompts per iteration (each sampled `generation.sampling.n_samples_per_prompt` times)."""
    train_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step; default: all of an iteration's samples (one step per PPO epoch). A multiple of
    generation.sampling.n_samples_per_prompt keeps the answers to one prompt in one mini-batch (whole groups are
    shuffled), where their prompt's forward is shared: otherwise rows are drawn one by one."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each iteration's experience (DeepSpeed-Chat found more than 1 unstable)."""
    advantage_estimator: str = "gae"
    """gae, grpo, rloo, reinforce_pp or distill (rlhf_ray/config/estimators.py), or `package.module:name` naming an
    Estimator of your own (docs/extending.md). gae uses a critic; grpo, rloo and reinforce_pp need none, and then
    no critic group is created. distill is on-policy distillation: a `teacher` scores every sampled token, and a
    token's advantage is the teacher's log-prob of it minus the policy's (the per-token reverse KL to the teacher,
    negated; no discounting); the reward role's scores are measured (reward/mean), not optimised."""

    @field_validator("advantage_estimator")
    @classmethod
    def _known_estimator(cls, name: str) -> str:
        estimator(name)
        return name

    @property
    def estimator(self) -> Estimator:
        """The advantage estimator's entry: what it needs (critic, groups, teacher) and reads."""
        return estimator(self.advantage_estimator)
    kl_coef: float = Field(0.1, ge=0)
    """KL penalty beta: per token in the shaped reward, or in the policy loss with `kl_in_loss`."""
    kl_in_loss: bool = False
    """Put the KL penalty in the policy loss (kl_coef x token-mean KL to the reference, as GRPO does; usually with
    kl_estimator k3) instead of the reward. With one on-policy step per rollout (sync mode, ppo_epochs 1, one
    train batch per iteration) the policy then skips the forward pass for old log-probs: they equal its
    training forward's, detached."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator: k1 = log ratio (DeepSpeed-Chat), k2 = squared log ratio / 2, k3 = ratio - 1 - log ratio."""
    clip_reward: float = Field(5.0, gt=0)
    """Reward-model scores are clipped to +-clip_reward before shaping."""
    clip_ratio: float = Field(0.2, gt=0)
    """PPO epsilon for the policy ratio (its lower bound 1 - clip_ratio; the upper one too unless
    clip_ratio_high is set)."""
    clip_ratio_high: float | None = Field(None, gt=0)
    """Upper clip epsilon, when it differs from clip_ratio: DAPO's clip-higher (0.28 with clip_ratio 0.2) lets
    unlikely tokens with a positive advantage grow faster, against entropy collapse."""
    loss_aggregation: LossAggregation = "token_mean"
    """How the policy loss averages: token_mean over every answer token of the mini-batch (DeepSpeed-Chat, DAPO:
    long answers weigh more), seq_mean_token_mean over answers of each one's token mean (GRPO as published),
    seq_mean_token_sum over answers of each one's token sum (Dr. GRPO, up to a constant)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant c (> 1) bounding the loss of negative-advantage tokens; off when unset."""
    clip_value: float = Field(0.2, gt=0)
    """Value-function clip around the old values (gae only: setting it for another estimator is refused)."""
    gamma: float = Field(1.0, gt=0, le=1)
    """Discount (gae and reinforce_pp; refused for grpo and rloo, which score whole answers)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda (gae only)."""
    critic_warmup: int = Field(0, ge=0)
    """The first this many iterations train the critic alone (gae only): the policy keeps its starting weights, so
    a critic with a new value head (one that starts from the SFT model, not from a reward model) learns that
    policy's values before its advantages steer an update (veRL's critic_warmup). The policy's learning-rate
    schedule spans the iterations after it. Must be below `iterations`."""
    whiten_advantages: bool = True
    """Normalise advantages to zero mean and unit variance over the batch (gae and rloo; grpo normalises within
    each prompt's group and reinforce_pp always whitens, so setting it for them is refused)."""
    tis_cap: float | None = Field(None, gt=0)
    """Truncated importance sampling: each answer token's policy loss is weighted by min(pi_learner / pi_engine,
    tis_cap), with pi_engine the probability the generation engine sampled it with and pi_learner the learner's
    (its old log-prob): the correction for the train/inference mismatch (generate/mismatch_kl) of engines in
    lower precision or, in async mode, with older weights. Off when unset; 2 is a common cap."""
    old_logprobs: Literal["policy", "engine"] = "policy"
    """Where the PPO ratio's old log-probs come from. `policy`: a forward of the policy learner over each rollout
    (skipped when the rollout's only update sees the weights that sampled it: its training forward's then).
    `engine`: the log-probs the generation engine returned with its samples, so no learner forward runs and the
    reference (or critic) has the experience phase to itself; the ratio then also carries the engine/learner
    numeric gap (generate/mismatch_kl under `policy`: near 0 for fp32 engines, larger for bf16 ones), and the
    gap is no longer reported (it would be 0). The engine's are the log-probs it sampled from: at the sampling
    temperature, after top_p/top_k, min_new_tokens and repetition_penalty, on both engines (RLinf's
    algorithm.recompute_logprobs: false)."""
    overlong_buffer: int | None = Field(None, ge=1)
    """DAPO's soft overlong punishment: answers longer than generation.sampling.max_new_tokens - overlong_buffer
    tokens lose up to `overlong_penalty`, linearly, reaching it at max_new_tokens; off when unset."""
    overlong_penalty: float = Field(1.0, gt=0)
    """The largest overlong punishment (subtracted from the clipped score), with overlong_buffer."""
    eos_penalty: float | None = None
    """Score added (use a negative value) to answers that end without the end-of-text token (cut off at
    max_new_tokens), before any estimator sees the score (gae, grpo, rloo and reinforce_pp alike)."""
    ptx_coef: float = Field(27.8, ge=0)
    """Weight of the pretraining-mix loss (InstructGPT's gamma), used when `pretrain_data` is set."""
    pretrain_data: Annotated[list[str], PathField()] = Field(default_factory=list)
    """mmap corpus prefixes (PREFIX.bin/.idx) for the pretraining-mix loss; empty disables it."""
    ema: EmaSpec = Field(default_factory=EmaSpec)
    dynamic_sampling: DynamicSamplingSpec = Field(default_factory=DynamicSamplingSpec)
    mode: Literal["sync", "async"] = "sync"
    """async overlaps generating batch k+1 with training on batch k."""
    rollouts_ahead: int = Field(1, ge=1)
    """async mode: how many rollouts generation may run ahead of the update, generating or scored and waiting in
    the replay buffer, besides the one being trained on. 1 generates the next rollout while one trains (one policy
    version stale); more keep the engines busy when generation is uneven, at the price of staler experience: the
    buffer then evicts the oldest beyond buffer_capacity and refuses experience over max_staleness (both counted as
    buffer/evicted and buffer/refused_stale). An engine takes a weight update after the rollouts queued before it."""
    max_staleness: int = Field(1, ge=0)
    """Experience more than this many policy versions behind the learner is refused by the replay buffer (async
    mode trains on batches one version old, so it needs at least 1)."""
    buffer_capacity: int = Field(4, ge=1)
    """Experience batches the replay buffer holds; when full, the oldest is dropped (and counted)."""
    @property
    def prompts_per_rollout(self) -> int:
        """Prompts sampled per iteration: rollout_batch_size, times dynamic_sampling.oversample when enabled."""
        if not self.dynamic_sampling.enabled:
            return self.rollout_batch_size
        return math.ceil(self.rollout_batch_size * self.dynamic_sampling.oversample)

    @model_validator(mode="after")
    def _best_needs_its_evaluation(self) -> "PPOSpec":
        if self.keep_best is None:
            return self
        if self.eval_prompts == 0:
            raise FieldProblem("keep_best", f"{self.keep_best} is scored on held-out prompts and eval_prompts is 0: "
                                            "give ppo.eval_prompts some (and ppo.eval_every to score during training)")
        if self.keep_best.startswith("sampled_") and self.eval_samples == 0:
            raise FieldProblem("keep_best", f"{self.keep_best} is scored on sampled answers and eval_samples is 0: "
                                            "set ppo.eval_samples, or keep the best by greedy "
                                            f"{self.keep_best.removeprefix('sampled_')}")
        return self

    @model_validator(mode="after")
    def _options_the_estimator_reads(self) -> "PPOSpec":
        if self.dynamic_sampling.enabled and not self.estimator.groups:
            raise FieldProblem("dynamic_sampling.enabled", f"dynamic sampling keeps groups of answers to one prompt "
                               f"whose scores differ; advantage_estimator {self.advantage_estimator} has no groups "
                               "(use grpo or rloo)")
        if self.critic_warmup >= self.iterations:
            raise FieldProblem("critic_warmup", f"{self.critic_warmup} warm-up iterations of {self.iterations} leave "
                               "the policy none to train in: lower it below ppo.iterations")
        if self.old_logprobs == "engine" and self.tis_cap is not None:
            raise FieldProblem("tis_cap", "with old_logprobs: engine the old log-probs are the engine's, so the "
                               "truncated importance weights pi_learner/pi_engine are all 1: remove tis_cap (the PPO "
                               "ratio already corrects for the engine), or set old_logprobs: policy")
        if self.mode == "sync" and self.rollouts_ahead != 1:
            raise FieldProblem("rollouts_ahead", "sync mode samples each rollout with the weights of the update "
                               "before it (one at a time); set ppo.mode: async to let generation run ahead")
        # a value other than the default (a dumped and re-validated spec carries every field, set or not)
        for name in sorted(n for n in OPTIONS if getattr(self, n) != type(self).model_fields[n].default):
            if name not in self.estimator.reads:
                raise FieldProblem(name, f"advantage_estimator {self.advantage_estimator} does not use {name} "
                                         f"({OPTIONS[name]}; used by {', '.join(readers(name))}): remove it")
        return self

    eval_prompts: int = Field(64, ge=0)
    """Held-out prompts scored before and after training (summary.json's reward_before / reward_after; 0 skips
    both evaluations and leaves them null)."""
    eval_every: int = Field(0, ge=0)
    """Also evaluate the held-out prompts every this many iterations (eval/* lines at those steps), so the reward's
    score and the held-out check (`accuracy_function`, else the dataset's rule) can be watched side by side while
    training (reward over-optimisation shows as the first rising while the second falls: the job then warns, see
    `hacking_warning_evaluations`); 0: only before and after training."""
    hacking_warning_evaluations: int = Field(2, ge=0)
    """Warn (once) when, at this many consecutive held-out evaluations, the reward rose and the held-out check fell
    against the evaluation before, for greedy or sampled answers; the warning names the iteration where the two
    parted (metrics: eval/reward_hacking_signs, eval/parted_at). 0 turns the warning off."""
    entropy_warning_ratio: float = Field(0.1, ge=0, lt=1)
    """Warn once when the policy's entropy falls below this fraction of the first iteration's (of this run or
    resumed attempt): the policy has nearly stopped exploring (entropy collapse); 0 turns the warning off."""
    eval_samples: int = Field(4, ge=0)
    """Answers sampled per held-out prompt with `generation.sampling` (rounded up to a multiple of
    n_samples_per_prompt) for summary.json's sampled_reward_* and sampled_task_accuracy_*: the policy PPO
    optimises, where greedy answers show only its most likely one. 0 skips them."""
    accuracy_function: str | None = Field(None, pattern=r"^[\w.]+:\w+$")
    """Import path (`package.module:function`) of the held-out check: the rule that marks held-out answers right
    (1.0) or wrong (0.0), or a graded truth in [0, 1] (its mean is reported), for summary.json's task_accuracy_*
    and every evaluation's eval/task_accuracy, beside the reward; called like a reward function:
    `fn(prompts, answers, **columns)`. Unset: the dataset's own rule where it has one (demo/sort and
    demo/arithmetic: the exact answer; demo/word-problems: the last number; demo/descriptions: its gold score), else
    no task accuracy. E.g. `rlhf_ray.data.answers:last_number_reward` for an instruct
    model that explains before it answers."""
    keep_best: Literal["reward", "task_accuracy", "sampled_reward", "sampled_task_accuracy"] | None = None
    """Also keep the policy of the best held-out evaluation by this score (before training, every `eval_every`
    iterations, after training; a later one must beat it, a tie keeps the earlier): exported to `best_model/` beside
    `model/` (the last policy), with best.json saying the iteration and score (iteration 0: training never beat the
    starting policy). Held-out curves of RL often peak before the end (docs/jobs.md). task_accuracy needs a rule
    (`accuracy_function` or the dataset's own), sampled_* need `eval_samples`."""
