"""The PPO job's watch over its own numbers: warnings for what users otherwise find too late in plots (the pure
signals are computed in rlhf_ray/algorithms/diagnostics.py)."""

from __future__ import annotations

import logging

from rlhf_ray.algorithms.diagnostics import entropy_collapsed, reward_hacking_signs
from rlhf_ray.jobs.held_out import Evaluation

log = logging.getLogger(__name__)


class Diagnostics:
    """Warnings a user should not have to find in plots: reward over-optimisation (the held-out reward keeps rising
    while the held-out check falls, over `evaluations` consecutive evaluations) and entropy collapse (each warned
    once)."""

    def __init__(self, before: Evaluation, entropy_ratio: float, evaluations: int = 2, check: str = "the rule"):
        self.entropy_ratio, self.evaluations, self.check = entropy_ratio, evaluations, check
        self.history: list[tuple[int, Evaluation]] = [(0, before)] if before else []
        self.first_entropy: float | None = None
        self.warned: set[str] = set()

    @staticmethod
    def opening(before: Evaluation) -> dict[str, float]:
        """Metrics for the line of the evaluation before training: eval/reward_hacking_signs 0 where there is a
        check, so the series exists from the job's start (a short job's later evaluations can fall between two
        Prometheus scrapes)."""
        return {"eval/reward_hacking_signs": 0.0} if before.has_check else {}

    def iteration(self, step: int, result: dict[str, float]) -> None:
        entropy = result.get("policy/entropy")
        if entropy is None or not self.entropy_ratio:
            return
        if self.first_entropy is None:
            self.first_entropy = entropy
        elif entropy_collapsed(self.first_entropy, entropy, self.entropy_ratio) and "entropy" not in self.warned:
            self.warned.add("entropy")
            log.warning("iteration %d: policy entropy %.4f is below %.2f x its first value %.4f: the policy has "
                        "nearly stopped exploring (entropy collapse); consider a lower learning rate, a larger "
                        "ppo.kl_coef or ppo.clip_ratio_high", step, entropy, self.entropy_ratio, self.first_entropy)

    def evaluation(self, step: int, now: Evaluation) -> dict[str, float]:
        """Metrics for an evaluation line: eval/reward_hacking_signs (0, 1 or 2: greedy, sampled answers whose reward
        and check are parting now) and, while they part, eval/parted_at (the iteration where they began to).
        Warns the first time they do."""
        self.history.append((step, now))
        signs = reward_hacking_signs(self.series(), self.evaluations)
        if signs and "hacking" not in self.warned:
            self.warned.add("hacking")
            log.warning("iteration %d: possible reward over-optimisation (reward hacking): the reward keeps rising "
                        "while the held-out check (%s) falls; they parted after iteration %d: %s. The policy is "
                        "finding what the reward rewards beyond the task; consider the policy of iteration %d "
                        "(ppo.keep_best), a larger ppo.kl_coef, fewer iterations or a better reward model", step,
                        self.check, min(s.parted_at for s in signs), "; ".join(s.describe() for s in signs),
                        min(s.parted_at for s in signs))
        if not now.has_check or len(self.history) < 2:
            return {}
        return {"eval/reward_hacking_signs": float(len(signs))} | (
            {"eval/parted_at": float(min(s.parted_at for s in signs))} if signs else {})

    def series(self) -> dict[str, list[tuple[int, float, float]]]:
        """For greedy and sampled answers: (iteration, reward, check) of each evaluation so far that had a check."""
        out: dict[str, list[tuple[int, float, float]]] = {}
        for step, evaluation in self.history:
            for what, answered in evaluation.answers().items():
                if answered.check is not None:
                    out.setdefault(what, []).append((step, answered.reward, answered.check))
        return out
