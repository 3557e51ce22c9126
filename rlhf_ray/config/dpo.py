"""The `dpo:` section of a DPO job: the loss and the frozen reference it is measured against."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.placement import PlacementSpec


class DPOReferenceSpec(StrictModel):
    """The frozen reference: a Ray role of its own that computes each pair's reference log-probs."""

    sharded: ClassVar[bool] = False
    """Whole on each replica (not a YAML field): the memory model reads it as it does PPO's `reference.sharded`."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    """Unset: the model DPO starts from (`model.path`), as DPO assumes."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    micro_batch_size: int = Field(8, ge=1)
    """Pairs per reference forward."""
    precompute: bool = True
    """True: the log-probs of every pair the steps will train on and of the held-out pairs, once, before the first
    step (kept in output_dir for a restart); then the role is stopped and its memory freed while the policy
    trains. False: each step's pairs as the step comes (the role stays up beside the learners; for data too large
    to score up front, or a reference that must not sit idle)."""


class DPOSpec(StrictModel):
    """Direct preference optimisation on (prompt, chosen, rejected) pairs (Rafailov et al. 2023)."""

    beta: float = Field(0.1, gt=0)
    """Strength of the implicit KL constraint: larger keeps the policy nearer the reference."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta h) (with `label_smoothing`: conservative DPO); ipo: (h' - 1/(2 beta))^2 on
    per-token mean log-ratios, as TRL's IPO."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Conservative DPO: the chance that a pair's preference label is wrong (sigmoid only)."""
    rpo_alpha: float = Field(0.0, ge=0)
    """> 0: add rpo_alpha x the chosen answers' per-token negative log-likelihood to the loss (RPO; TRL's
    `rpo_alpha`), so the chosen answers stay likely while the preference is learned. Plain DPO lowers the
    chosen answers' likelihood along with the rejected ones'; with offline pairs unlike the model's own mistakes
    that can cost greedy accuracy (docs/benchmarks.md, "DPO")."""
    reference: DPOReferenceSpec = Field(default_factory=DPOReferenceSpec)

    @model_validator(mode="after")
    def _smoothing_is_for_sigmoid(self) -> "DPOSpec":
        if self.label_smoothing and self.loss != "sigmoid":
            raise FieldProblem("label_smoothing", f"label smoothing is conservative DPO's (loss: sigmoid); the "
                                                  f"{self.loss} loss does not read it: remove it")
        return self
