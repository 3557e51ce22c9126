"""DPO learner rank: the policy's log-probs of each pair's chosen and rejected answers against the frozen
reference's (computed by the reference role and handed in by the driver), through algorithms/dpo_loss.py's loss."""

from __future__ import annotations

import torch

from rlhf_ray.algorithms.dpo_loss import dpo_loss, pack_pairs, pair_sequence_logps
from rlhf_ray.learners.rank import SupervisedRank
from rlhf_ray.models.loading import load_causal_lm
from rlhf_ray.models.shared_prompt import answer_logprobs_and_entropy


TIE = 1e-5
"""Implicit-reward margins this close to 0 are ties: the policy and the reference compute the same log-probs in
different processes and kernels, so at the start their margins are rounding noise (~1e-8), not preferences."""


class DPOLearner(SupervisedRank):
    def __init__(self, *, beta: float, loss: str, label_smoothing: float, rpo_alpha: float, **kwargs):
        super().__init__(**kwargs)
        self.beta, self.loss_type, self.label_smoothing, self.rpo_alpha = beta, loss, label_smoothing, rpo_alpha
        self.reference: dict[str, dict[int, tuple[float, float]]] = {"train": {}, "eval": {}}
        """Reference log-probs (chosen, rejected) of the pairs, by split and row index."""

    def build_model(self) -> torch.nn.Module:
        return load_causal_lm(self.model_spec)

    def set_reference_logps(self, split: str, indices: list[int], chosen: list[float], rejected: list[float]) -> int:
        table = self.reference[split]
        table.update({i: (c, r) for i, c, r in zip(indices, chosen, rejected)})
        return len(table)

    def _reference_of(self, split: str, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.reference[split]
        missing = [i for i in indices if i not in table]
        if missing:
            raise RuntimeError(f"no reference log-probs for {split} pairs {missing[:5]}: the driver hands them in "
                               f"before the step (dpo.reference.precompute)")
        pairs = torch.tensor([table[i] for i in indices], dtype=torch.float64, device=self.deepspeed.device)
        return pairs[:, 0], pairs[:, 1]

    def _loss(self, split: str, indices: list[int], rows: list[dict]) -> tuple[torch.Tensor, dict, dict]:
        """(mean loss, dpo_loss's metrics, per pair: the implicit-reward margin and the policy's own log-prob gap
        chosen - rejected) of a micro-batch of pairs."""
        batch = pack_pairs(rows, self.pad_token_id).to(self.deepspeed.device)
        zero3 = self.deepspeed.zero_optimization_stage() == 3
        logp, _ = answer_logprobs_and_entropy(
            self.deepspeed, self.deepspeed.module, batch.sequences, batch.attention_mask, batch.answer_width, 1.0,
            share_prompts=not (zero3 and self.world_size > 1), chunked=not zero3, with_entropy=False)
        policy = pair_sequence_logps(logp, batch.action_mask)
        ref_chosen, ref_rejected = (t.to(logp.dtype) for t in self._reference_of(split, indices))
        loss, metrics = dpo_loss(policy["chosen"], policy["rejected"], ref_chosen, ref_rejected, self.beta,
                                 self.loss_type, self.label_smoothing, policy["chosen_tokens"],
                                 policy["rejected_tokens"], self.rpo_alpha)
        margin = self.beta * ((policy["chosen"] - ref_chosen) - (policy["rejected"] - ref_rejected))
        return loss, metrics, {"margin": margin.detach(), "logp_gap": (policy["chosen"] - policy["rejected"]).detach()}

    def train_step(self, step: int) -> dict:
        self.deepspeed.train()
        sums: dict[str, float] = {}
        pairs = 0
        for indices in self.step_indices(step):
            loss, metrics, _ = self._loss("train", indices, [self.train_rows[i] for i in indices])
            self.deepspeed.backward(loss)
            self.optimizer_step()
            for key, value in {"loss": loss.detach(), **metrics}.items():
                sums[key] = sums.get(key, 0.0) + float(value) * len(indices)
            pairs += len(indices)
        keys = sorted(sums)
        *totals, pairs = self.all_reduce_sum([sums[k] for k in keys] + [float(pairs)])
        return {**{k: v / pairs for k, v in zip(keys, totals)}, **self.step_info()}

    @torch.no_grad()
    def evaluate(self) -> dict:
        """On the whole held-out split: the loss; the implicit-reward accuracy (share of pairs whose chosen answer
        gets the larger beta x log-ratio; a margin within rounding, as the reference's own, counts half: 0.5 at
        the start); the model's own preference accuracy (share of pairs whose chosen answer it finds likelier:
        the SFT model's at the start); the mean margin, implicit rewards and log-probs."""
        self.deepspeed.eval()
        keys = ("loss", "accuracy", "logp_accuracy", "margin", "chosen_reward", "rejected_reward", "chosen_logp",
                "rejected_logp")
        sums = dict.fromkeys(keys, 0.0)
        pairs = 0
        for indices, counted in self.eval_batches():
            loss, metrics, pair = self._loss("eval", indices, [self.eval_rows[i] for i in indices])
            if not counted:
                continue
            pairs += len(indices)
            n, margins = len(indices), pair["margin"]
            tie = margins.abs() <= TIE
            for key, value in (("loss", loss.item() * n),
                               ("accuracy", ((margins > 0) & ~tie).sum().item() + 0.5 * tie.sum().item()),
                               ("logp_accuracy", (pair["logp_gap"] > 0).sum().item()),
                               ("margin", margins.sum().item()), ("chosen_reward", metrics["rewards/chosen"].item() * n),
                               ("rejected_reward", metrics["rewards/rejected"].item() * n),
                               ("chosen_logp", metrics["logps/chosen"].item() * n),
                               ("rejected_logp", metrics["logps/rejected"].item() * n)):
                sums[key] += value
        *totals, n = self.all_reduce_sum([sums[k] for k in keys] + [float(pairs)])
        n = max(n, 1.0)
        return {**{f"eval_{k}": v / n for k, v in zip(keys, totals)}, "eval_pairs": n}
