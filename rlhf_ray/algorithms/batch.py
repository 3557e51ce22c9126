"""The records that carry rollouts between roles: a packed rollout batch (what the reference, reward, critic and
policy score), and the experience PPO trains on (the batch plus its targets). Every field is named here; the
optional ones say when they are there."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Self

import torch

SEQUENCE_FIELDS = ("sequences", "attention_mask")
"""The [B, P + A] tensors of a batch; its other 2-D tensors are [B, A]: one value per answer token."""


@dataclass(kw_only=True)
class RolloutBatch:
    """Rows laid out as [left-padded prompt | right-padded answer]: every answer starts at column `prompt_width`,
    so the answer tensors of every role are [B, A] slices of one layout (algorithms.experience.pack_rollouts)."""

    sequences: torch.Tensor
    """[B, P + A] token ids."""
    attention_mask: torch.Tensor
    """[B, P + A]: 1 on prompt and answer tokens, 0 on padding."""
    action_mask: torch.Tensor
    """[B, A] float: 1 on the tokens the policy sampled (0 on padding and on a multi-turn episode's observations)."""
    prompt_width: int
    ended: torch.Tensor | None = None
    """[B] bool: the answer ended on a stop id (not cut at max_new_tokens). Rollouts only."""
    columns: list[dict] | None = None
    """Each row's dataset columns (e.g. the ground truth), for reward functions. Rollouts only."""
    engine_logp: torch.Tensor | None = None
    """[B, A]: the engine's log-probs of the tokens it sampled. Rollouts only."""
    version: torch.Tensor | None = None
    """[B]: the policy version that sampled each row (the oldest of its tokens'). Rollouts only."""
    token_version: torch.Tensor | None = None
    """[B, A]: the policy version that sampled each answer token (several per row when a weight update reached
    the engine mid-answer: generation.partial_rollouts; 0 on padding). Rollouts only."""

    def __len__(self) -> int:
        return self.sequences.shape[0]

    @property
    def answer_width(self) -> int:
        return self.action_mask.shape[1]

    def padding(self, packed: bool = False) -> tuple[int, int]:
        """(padding tokens, tokens) of a forward over this batch's [B, P + A] layout as it stands (trim it first
        for a micro-batch's own width): the share of a role's compute spent on pads. Packed (models/packing.py):
        no pads, the real tokens."""
        if packed:
            return 0, int(self.attention_mask.sum())
        tokens = self.attention_mask.numel()
        return tokens - int(self.attention_mask.sum()), tokens

    def select(self, rows) -> Self:
        """The rows `rows` (indices or a slice) of every per-row field; `prompt_width` kept."""
        index = torch.arange(len(self))[rows] if isinstance(rows, slice) else torch.as_tensor(rows, dtype=torch.long)
        n, picked = len(self), {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
                value = value[index]
            elif isinstance(value, list) and len(value) == n:
                value = [value[i] for i in index.tolist()]
            picked[f.name] = value
        return type(self)(**picked)

    def trimmed(self) -> Self:
        """Without the columns none of the rows uses: the prompt padding every row has on the left, the answer padding
        every row has on the right. A micro-batch of short prompts and answers then runs at its own width, not the
        rollout's longest. Answer tensors lose the same trailing columns as the sequences; nothing a kept token sees
        changes (attention is causal and masks pads; rotary positions are relative; OPT counts positions from the
        mask). One answer column always stays."""
        answer_len = self.answer_width
        prompt_len = self.sequences.shape[1] - answer_len
        used = self.attention_mask[:, :prompt_len].any(0).nonzero()
        left = int(used[0]) if len(used) else prompt_len
        acted = self.action_mask.any(0).nonzero()
        keep = int(acted[-1]) + 1 if len(acted) else 1
        if left == 0 and keep == answer_len:
            return self
        changed = {"prompt_width": prompt_len - left}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in SEQUENCE_FIELDS:
                changed[f.name] = value[:, left: prompt_len + keep]
            elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == answer_len:
                changed[f.name] = value[:, :keep]
        return dataclasses.replace(self, **changed)

    def to(self, device) -> Self:
        """Every tensor on `device`."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})


@dataclass(kw_only=True)
class PPOTargets:
    """What algorithms.experience.make_experience computes from a rollout's scores: the advantages and the rest of
    what the policy and critic losses read."""

    advantages: torch.Tensor
    """[B, A]."""
    rewards: torch.Tensor
    """[B, A]: per-token rewards (the score on the last token, a KL penalty when it is in the reward)."""
    ref_logp: torch.Tensor | None = None
    """[B, A]: the reference's log-probs of the answer tokens (the KL term). None when the run has no reference (no
    KL term)."""
    old_logp: torch.Tensor | None = None
    """[B, A]: the policy's log-probs when the rollout was scored. None when the KL is in the loss and the update is the
    rollout's only one: the training forward's (detached) are the same."""
    kl: torch.Tensor | None = None
    """[B]: mean KL to the reference per row (with old_logp and ref_logp)."""
    values: torch.Tensor | None = None
    """[B, A]: the critic's values when the rollout was scored (GAE only)."""
    returns: torch.Tensor | None = None
    """[B, A]: value targets (GAE only)."""


@dataclass(kw_only=True)
class Experience(RolloutBatch, PPOTargets):
    """A rollout batch with its PPO targets: what the replay buffer holds a reference to and the learners train on."""

    @classmethod
    def of(cls, batch: RolloutBatch, targets: PPOTargets) -> Experience:
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(RolloutBatch)}
        return cls(**fields, **{f.name: getattr(targets, f.name) for f in dataclasses.fields(PPOTargets)})
