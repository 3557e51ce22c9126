"""The policy learner: scores its own samples (old log-probs), takes clipped PPO steps on them, optionally keeps
the language-model loss on a pretraining mix (PPO-ptx) and an exponential moving average of its weights, and
publishes its weights for the generation engines."""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf_ray.actors.payload import by_reference
from rlhf_ray.algorithms.experience import logprob_gap, mismatch_kl
from rlhf_ray.algorithms.losses import (PolicyLoss, aggregated_sum, lm_loss_sum, loss_tokens, policy_token_loss,
                                       truncated_is_weights)
from rlhf_ray.algorithms.masked import masked_mean
from rlhf_ray.algorithms.rewards import kl_estimate
from rlhf_ray.algorithms.batch import Experience, RolloutBatch
from rlhf_ray.learners.ppo_base import PPOLearnerRank, TrainReport
from rlhf_ray.learners.pretrain_mix import PretrainMix
from rlhf_ray.models.loading import load_causal_lm
from rlhf_ray.models.shared_prompt import answer_logprobs_and_entropy
from rlhf_ray.models.weight_buckets import pack
from rlhf_ray.models.weight_handoff import HandoffPart, HandoffSender, ParameterFile

EMA_FILE = "ema.pt"
GATHER_BYTES = 2**28


@dataclass
class SentWeights:
    """Policy rank 0's answer to `broadcast_weights` or `publish_weights`."""

    bytes: int
    """Bytes sent."""
    seconds: float
    refs: list = field(default_factory=list)
    """publish_weights: ObjectRefs of the buckets, in order (empty for a broadcast: the engines have them)."""


class PolicyLearner(PPOLearnerRank):
    role = "policy"

    def __init__(self, *, loss: PolicyLoss, pad_token_id: int, train_batch_size: int, ema_beta: float | None = None,
                 pretrain_data: list[str] | None = None, ptx_coef: float = 0.0, **kwargs):
        """`ema_beta`: keep an EMA of the weights (ppo.ema); `pretrain_data`, `ptx_coef`: PPO-ptx's corpora and
        coefficient; the rest: LearnerRank's and PPOLearnerRank's."""
        super().__init__(**kwargs)
        self.loss, self.loss_aggregation = loss, loss.aggregation
        self.ema_beta, self.ema = ema_beta, None
        self.ptx_coef = ptx_coef
        self.mix = PretrainMix(pretrain_data, train_batch_size, self.seed, pad_token_id) if pretrain_data else None
        self.handoff: HandoffSender | None = None  # rank 0, transport ipc: see handoff_weights
        self._handoff_parts = None  # the sync in progress
        self._handoff_left = 0  # its parts not yet handed over

    def build_model(self) -> torch.nn.Module:
        return load_causal_lm(self.model_spec)

    def setup(self, master_addr: str, master_port: int, total_steps: int, collective_timeout_s: float = 1800.0) -> dict:
        info = super().setup(master_addr, master_port, total_steps, collective_timeout_s)
        if self.ema_beta is not None:
            self.ema = self.gathered_state_dict(GATHER_BYTES)  # the EMA starts at the starting policy
            if self.ema is not None:
                self.ema = host_average(self.ema, self.deepspeed.device)
        return info

    def _logprobs(self, batch: RolloutBatch, with_entropy: bool = False):
        """Answer-token log-probs at the sampling temperature (and the sampling distribution's entropy there)."""
        zero3 = self.deepspeed.zero_optimization_stage() == 3
        logp, ent = answer_logprobs_and_entropy(
            self.deepspeed, self.deepspeed.module, batch.sequences, batch.attention_mask, batch.answer_width,
            self.temperature, share_prompts=not (zero3 and self.world_size > 1), chunked=not zero3,
            with_entropy=with_entropy, packed=self.packed)
        if not with_entropy:
            return logp * batch.action_mask
        return logp * batch.action_mask, ent * batch.action_mask

    @by_reference
    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """Log-probs of this rank's slice of the batch (rank order) at the sampling temperature."""
        return self.over_my_rows(batch, self._logprobs)

    def train(self, minibatches) -> TrainReport:
        def token_loss(micro: Experience):
            logp, ent = self._logprobs(micro, with_entropy=True)
            # without old log-probs in the experience this is the rollout's only update: they equal these
            old_logp = micro.old_logp if micro.old_logp is not None else logp.detach()
            mask = micro.action_mask
            loss, stats = policy_token_loss(logp, old_logp, micro.advantages, mask, self.loss.clip_ratio,
                                            self.loss.dual_clip, self.loss.clip_ratio_high)
            if self.loss.tis_cap is not None:  # the samples came from the engine's distribution, not old_logp's
                weights = truncated_is_weights(old_logp, micro.engine_logp, mask, self.loss.tis_cap)
                loss = loss * weights
                stats |= {"tis_weight": masked_mean(weights, mask),
                          "tis_truncated": masked_mean((weights >= self.loss.tis_cap).float(), mask)}
            tokens = mask.sum().item()
            extra = {}
            # the KL to the reference: in the loss with kl_in_loss, else a metric (detached: no graph kept); none
            # without a reference
            if micro.ref_logp is not None:
                kl = kl_estimate(logp if self.loss.kl_coef else logp.detach(), micro.ref_logp, self.loss.kl_estimator,
                                 mask) * mask
                if self.loss.kl_coef:
                    loss = loss + self.loss.kl_coef * kl
                extra["kl"] = kl.detach().sum().item()
            if micro.old_logp is None and micro.engine_logp is not None:  # the on-policy step: the pure engine gap
                extra["engine_logprob_gap"] = logprob_gap(micro.engine_logp, logp.detach(), mask) * tokens
                extra["engine_mismatch_kl"] = mismatch_kl(micro.engine_logp, logp.detach(), mask) * tokens
            return aggregated_sum(loss, mask, self.loss_aggregation), {
                **{k: v.item() * tokens for k, v in stats.items()}, "entropy": ent.sum().item(), **extra}

        report = self.run_epochs(minibatches, token_loss)
        started = time.perf_counter()
        if self.ema_beta is not None and report.steps_applied:  # unchanged weights: nothing to average in
            self.update_ema()
        ema = time.perf_counter() - started
        return dataclasses.replace(report, seconds=report.seconds + ema, ema_seconds=ema)

    # ---- PPO-ptx ------------------------------------------------------------------------------------------
    def auxiliary_losses(self, minibatches, step: int, micro_batches: int) -> list:
        """ptx_coef x the LM loss of mix batch k (a pure function of the rollout and step: resumable), token-mean over
        the global mix batch; each micro-batch's forward runs when its PPO micro-batch does."""
        if self.mix is None:
            return []
        k = minibatches.meta.rollout_index * len(minibatches.rows) + step
        if self.max_tokens is None:
            parts = self.mix.micro_batches(k, self.rank, self.world_size, self.micro_batch_size)
        else:  # PPO micro-batches cut by tokens: as many mix parts, whatever their rows
            parts = self.mix.split(k, self.rank, self.world_size, micro_batches)
        if len(parts) != micro_batches:
            raise RuntimeError(f"pretraining mix gave {len(parts)} micro-batches for {micro_batches} PPO ones")
        (tokens,) = self.all_reduce_sum([float(sum(loss_tokens(p["labels"]) for p in parts if p is not None))])

        def mix_loss(part: dict) -> tuple[torch.Tensor, dict[str, float]]:
            part = {k: v.to(self.deepspeed.device) for k, v in part.items()}
            logits = self.deepspeed(input_ids=part["input_ids"], attention_mask=part["attention_mask"]).logits
            lm = lm_loss_sum(logits, part["labels"]) / max(tokens, 1.0)
            return self.ptx_coef * lm, {"ptx_loss": lm.item()}

        return [None if part is None else functools.partial(mix_loss, part) for part in parts]

    # ---- EMA ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_ema(self) -> None:
        """ema = beta * ema + (1 - beta) * weights, kept on rank 0's host in fp32 (a collective under ZeRO-3)."""
        for group in self.gathered_groups(GATHER_BYTES, copy=False):
            for name, tensor in group:
                average_into(self.ema[name], tensor, self.ema_beta)
            if self.deepspeed.device.type == "cuda":  # before the group is let go (ZeRO-3 frees what it gathered)
                torch.cuda.synchronize()              # and before anyone reads the host copies

    def save_checkpoint(self, directory: str, client_state: dict) -> None:
        super().save_checkpoint(directory, client_state)
        if self.ema is not None:
            torch.save(self.ema, Path(directory) / EMA_FILE)

    def load_checkpoint(self, directory: str, tag: str = "state") -> dict:
        state = super().load_checkpoint(directory, tag)
        if self.ema_beta is not None and self.rank == 0:
            self.ema = host_average(torch.load(Path(directory) / EMA_FILE), self.deepspeed.device)
        return state

    def export_ema(self, directory: str) -> str | None:
        """The EMA weights as a Hugging Face model (rank 0; the others return None)."""
        if self.rank != 0:
            return None
        from rlhf_ray.learners.export import save_hf_model

        dtype = next(self.deepspeed.module.parameters()).dtype
        return save_hf_model(self.deepspeed.module, {k: v.to(dtype) for k, v in self.ema.items()}, self.model_spec,
                             Path(directory))

    # ---- weights for the engines --------------------------------------------------------------------------
    def join_weight_sync(self, host: str, port: int, world_size: int, timeout_s: float) -> bool:
        """Rank 0 becomes rank 0 of the weight-sync process group with the engines (the other ranks take no part)."""
        if self.rank == 0:
            from rlhf_ray.models.weight_transport import WeightBroadcast

            self.weight_broadcast = WeightBroadcast(host, port, 0, world_size, timeout_s, self.take_listener(port))
        return self.rank == 0

    def broadcast_weights(self, bucket_bytes: int, adapters_only: bool = False) -> SentWeights | None:
        """Rank 0 broadcasts the full weights to the engines, bucket by bucket (a collective under ZeRO-3: every
        rank gathers along)."""
        start = time.perf_counter()
        groups = self.engine_weight_groups(bucket_bytes, adapters_only)
        if self.rank != 0:
            for _ in groups:
                pass
            return None
        return SentWeights(self.weight_broadcast.send(groups), time.perf_counter() - start)

    def publish_weights(self, bucket_bytes: int, adapters_only: bool = False) -> SentWeights | None:
        """Rank 0 puts the full weights in the object store as buckets and returns their refs, bytes and seconds;
        the engines fetch them from there. A collective under ZeRO-3: every rank calls it, groups of parameters
        are gathered in turn."""
        import ray

        start = time.perf_counter()
        refs, total = [], 0
        for group in self.engine_weight_groups(bucket_bytes, adapters_only):  # pack copies while the group is gathered
            for bucket in pack(group):
                refs.append(ray.put(bucket))
                total += bucket.nbytes
        return SentWeights(total, time.perf_counter() - start, refs) if self.rank == 0 else None

    def handoff_weights(self, bucket_bytes: int, adapters_only: bool = False) -> HandoffPart | None:
        """The next bucket of a colocated handoff (transport ipc) on rank 0, None on the others; the last one says
        so (`last`), and the call after it returns None on every rank, once the engines have taken it, freeing it
        (the next call starts a new sync). Every rank calls it (under ZeRO-3 each bucket is gathered together).
        Where the optimizer updates the parameters in place (ZeRO-0, fp32, no LoRA, on CPU), rank 0 keeps them in
        shared memory from the first sync on and hands the whole model over in place."""
        if self._handoff_parts is None:
            in_place = self._parameters_stay_in_place()
            if self.rank == 0 and self.handoff is None:
                self.handoff = HandoffSender(ParameterFile(self.deepspeed.module) if in_place else None)
            whole = in_place or adapters_only  # one part: offsets in one file; an adapter is loaded as a whole
            size = 2**62 if whole else bucket_bytes
            groups = self.engine_weight_groups(size, adapters_only)
            self._handoff_parts = self.handoff.parts(groups) if self.rank == 0 else (None for _ in groups)
            self._handoff_left = self.engine_weight_group_count(size, adapters_only)
        part = next(self._handoff_parts, StopIteration)
        if part is StopIteration:
            self._handoff_parts = None
            return None
        self._handoff_left -= 1
        return dataclasses.replace(part, last=self._handoff_left == 0) if self.rank == 0 else None

    def release_shared_memory(self) -> None:
        """Remove the handoff's file of parameters (at the end of a run; its mapping lives on with the process)."""
        if self.handoff is not None:
            self.handoff.close()

    def _parameters_stay_in_place(self) -> bool:
        e = self.deepspeed
        return (e.device.type == "cpu" and e.zero_optimization_stage() == 0 and not self.model_spec.lora.enabled
                and not (e.fp16_enabled() or e.bfloat16_enabled()))


def host_average(weights: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The EMA's storage: fp32 copies on the host, pinned where the model is on a GPU (so that `average_into`'s
    copies to and from the device run at the bus's speed)."""
    pin = device.type == "cuda"
    return {k: (v.float().pin_memory() if pin else v.float()) for k, v in weights.items()}


def average_into(average: torch.Tensor, weights: torch.Tensor, beta: float) -> None:
    """average = beta * average + (1 - beta) * weights. `average` lives on the host; weights on a GPU are averaged
    there (the host copy goes up and comes back: the host does no arithmetic over the model), so the host is only
    up to date once the device has synchronised."""
    if weights.device == average.device:
        average.lerp_(weights.float(), 1 - beta)
        return
    here = average.to(weights.device, non_blocking=True)
    here.lerp_(weights.float(), 1 - beta)
    average.copy_(here, non_blocking=True)
