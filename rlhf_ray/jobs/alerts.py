"""The PPO job's watch over its own numbers: warnings for what users otherwise find too late in plots (the pure
signals are computed in rlhf_ray/algorithms/diagnostics.py)."""

from __future__ import annotations

import logging

from rlhf_ray.algorithms.diagnostics import entropy_collapsed, reward_hacking_signs

log = logging.getLogger(__name__)


class Diagnostics:
    """Warnings a user should not have to find in plots: reward over-optimisation (held-out reward up, rule accuracy
    down, against the evaluation before training) and entropy collapse (each warned once)."""

    def __init__(self, before: dict[str, float], entropy_ratio: float):
        self.before, self.entropy_ratio = before, entropy_ratio
        self.first_entropy: float | None = None
        self.warned: set[str] = set()

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

    def evaluation(self, step: int, now: dict[str, float]) -> dict[str, float]:
        """Metrics for an evaluation line (eval/reward_hacking_signs: 0, 1 or 2); warns on the first signs."""
        signs = reward_hacking_signs(self.before, now)
        if signs and "hacking" not in self.warned:
            self.warned.add("hacking")
            log.warning("iteration %d: possible reward over-optimisation (reward hacking): %s. The policy is finding "
                        "what the reward rewards beyond the task; consider a larger ppo.kl_coef, fewer iterations "
                        "or a better reward model", step, "; ".join(signs))
        has_rule = "task_accuracy" in now or "sampled_task_accuracy" in now
        return {"eval/reward_hacking_signs": float(len(signs))} if has_rule and self.before else {}
