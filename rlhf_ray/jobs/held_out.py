"""A held-out evaluation of the policy, typed: what the PPO job's Evaluator measures and what the progress line, the
over-optimisation watch, the best-model keeper, the checkpoint and the summary read. `metrics()` gives the flat
names metrics.jsonl (as eval/<name>), summary.json and `ppo.keep_best` use."""

from __future__ import annotations

from dataclasses import dataclass

EPISODE_NAMES = ("turns_per_episode", "tool_calls_per_episode", "tool_call_validity")
"""Multi-turn: what the episodes did (envs/episode.py's episode_metrics, without the env/ prefix)."""


@dataclass
class Answered:
    """One way of answering the held-out prompts (greedily, or sampled with the training settings), scored. Each
    `_se` is the standard error over the prompts (jobs/ppo/evaluation.py: mean_and_error)."""

    reward: float
    """The reward role's mean score."""
    reward_se: float
    check: float | None = None
    """The held-out check's mean (the task's rule or `accuracy_function`: task_accuracy); None without one."""
    check_se: float | None = None
    turns_per_episode: float | None = None
    """Multi-turn only, as the two below."""
    tool_calls_per_episode: float | None = None
    tool_call_validity: float | None = None

    def metrics(self, prefix: str = "") -> dict[str, float]:
        named = {"reward": self.reward, "reward_se": self.reward_se, "task_accuracy": self.check,
                 "task_accuracy_se": self.check_se} | {name: getattr(self, name) for name in EPISODE_NAMES}
        return {prefix + name: value for name, value in named.items() if value is not None}

    @classmethod
    def of(cls, flat: dict[str, float], prefix: str = "") -> "Answered | None":
        """From `metrics(prefix)`'s names (a checkpoint keeps them); None when they are not there."""
        if prefix + "reward" not in flat:
            return None
        get = lambda name: flat.get(prefix + name)  # noqa: E731
        return cls(get("reward"), get("reward_se"), get("task_accuracy"), get("task_accuracy_se"),
                   *(get(name) for name in EPISODE_NAMES))


@dataclass
class Evaluation:
    """The held-out prompts answered greedily (the policy's mode) and, with `ppo.eval_samples`, sampled (the
    distribution PPO optimises). Both None: the job has no held-out prompts."""

    greedy: Answered | None = None
    sampled: Answered | None = None

    def __bool__(self) -> bool:
        return self.greedy is not None

    def answers(self) -> dict[str, Answered]:
        """{"greedy": ..., "sampled": ...}, those that were measured."""
        return {what: answered for what, answered in (("greedy", self.greedy), ("sampled", self.sampled))
                if answered is not None}

    @property
    def has_check(self) -> bool:
        return any(answered.check is not None for answered in self.answers().values())

    def metrics(self) -> dict[str, float]:
        """reward, reward_se, task_accuracy, ... and sampled_reward, ...: the names summary.json, best.json and
        metrics.jsonl (as eval/<name>) use."""
        return {name: value for what, answered in self.answers().items()
                for name, value in answered.metrics("sampled_" if what == "sampled" else "").items()}

    @classmethod
    def of(cls, flat: dict[str, float]) -> "Evaluation":
        """From `metrics()` (a checkpoint's eval_before)."""
        return cls(Answered.of(flat), Answered.of(flat, "sampled_"))
