"""Forward-only roles of PPO: the reference model (log-probs of answers) and the reward model (a score per
answer). Neither trains: each replica holds a plain HF module in eval mode on its device, or, with `sharded: true`,
its shard of the weights in a ZeRO-3 inference group (actors/sharding.py).

Each replica scores rows [lo, hi) of the batch it is handed by reference and answers with a reference to its
result, so experience tensors go from actor to actor through the object store, never through the driver."""

from __future__ import annotations

import torch

from rlhf_ray.actors.payload import by_reference
from rlhf_ray.actors.sharding import ForwardRole, device
from rlhf_ray.algorithms.batch import RolloutBatch
from rlhf_ray.algorithms.experience import pad_answer_columns, unpack_rollouts
from rlhf_ray.algorithms.micro_batches import used_columns
from rlhf_ray.algorithms.reward_loss import end_scores
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.models.loading import load_causal_lm, load_scalar_model, token_values
from rlhf_ray.models.packing import pack, packed_values
from rlhf_ray.models.shared_prompt import answer_logprobs_and_entropy


class ReferenceWorker(ForwardRole):
    """Log-probs of answer tokens under the frozen starting policy, at the sampling temperature."""

    def __init__(self, *, temperature: float, **kwargs):
        self.temperature = temperature
        super().__init__(**kwargs)

    def load_model(self) -> torch.nn.Module:
        return load_causal_lm(self.spec)

    @by_reference
    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, lo: int, hi: int) -> torch.Tensor:
        answer_len = batch.answer_width
        out = torch.zeros(hi - lo, answer_len)
        for part in self.micro_batches(lo, hi, len(batch), batch.sequences[lo:hi], batch.attention_mask[lo:hi],
                                       batch.action_mask[lo:hi]):
            micro = batch.select(part if part is not None else [0]).trimmed()
            seq, mask, action = (t.to(device()) for t in (micro.sequences, micro.attention_mask, micro.action_mask))
            logp, _ = answer_logprobs_and_entropy(self.forward, self.model, seq, mask, action.shape[1],
                                                  self.temperature, share_prompts=not self.sharded,
                                                  chunked=not self.sharded, with_entropy=False, packed=self.packed)
            if part is not None:
                out[torch.as_tensor(part - lo)] = pad_answer_columns((logp * action).cpu().float(), answer_len)
        return out


class RewardWorker(ForwardRole):
    """The reward model's score of each (prompt, answer): its head at the last real token of the sequence.

    A reward model with another tokenizer than the policy's (`bridge_from`: the policy's tokenizer) cannot read
    the policy's token ids: each row is decoded to text with the policy's tokenizer (special tokens dropped) and
    tokenised again with the reward model's conventions, its end-of-text kept only on answers that ended."""

    def __init__(self, *, tokens: TokenConventions, bridge_from: str | None = None, **kwargs):
        self.tokens = tokens
        super().__init__(**kwargs)
        self.bridge = None
        if bridge_from is not None:
            from transformers import AutoTokenizer

            self.bridge = (AutoTokenizer.from_pretrained(bridge_from),
                           AutoTokenizer.from_pretrained(self.spec.tokenizer_path))

    def load_model(self) -> torch.nn.Module:
        return load_scalar_model(self.spec, self.tokens.pad_id)

    def retokenize(self, batch: RolloutBatch, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows [lo, hi) as the reward model's tokenizer writes them, right-padded, with their mask."""
        policy, own = self.bridge
        rows = []
        for (prompt_ids, answer_ids), ended in zip(unpack_rollouts(batch, lo, hi), batch.ended[lo:hi]):
            prompt = policy.decode(prompt_ids, skip_special_tokens=True)
            answer = policy.decode(answer_ids, skip_special_tokens=True)
            ids = own(answer, add_special_tokens=False)["input_ids"]
            rows.append(self.tokens.encode_prompt(own, prompt) + (ids + [self.tokens.eos_id] if ended else ids))
        longest = max(len(r) for r in rows)
        seq = torch.full((len(rows), longest), self.tokens.pad_id, dtype=torch.long)
        mask = torch.zeros_like(seq)
        for i, r in enumerate(rows):
            seq[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        return seq, mask

    @by_reference
    @torch.no_grad()
    def score(self, batch: RolloutBatch, lo: int, hi: int) -> torch.Tensor:
        if self.bridge is not None and hi > lo:
            seq, mask = self.retokenize(batch, lo, hi)
        else:
            seq, mask = batch.sequences[lo:hi], batch.attention_mask[lo:hi]
        out = torch.zeros(hi - lo)
        # lengths for the token budget: the retokenised rows are right-padded (all "answer"); the batch's are its layout
        answers = mask if self.bridge is not None else mask[:, mask.shape[1] - batch.answer_width:]
        for part in self.micro_batches(lo, hi, len(batch), seq, mask, answers):
            if part is None:  # a sharded replica keeping step with the others: one pad token, result dropped
                token_values(self.model, torch.full((1, 1), self.tokens.pad_id, device=device()),
                             torch.ones(1, 1, dtype=torch.long, device=device()), forward=self.forward)
                continue
            rows, rows_mask = used_columns(seq[part - lo], mask[part - lo])
            if self.packed:  # each row's tokens as one sequence, scored at its last
                packed = pack(rows.to(device()), rows_mask.to(device()), answer_len=0)
                scores = packed_values(self.model, packed, self.forward)[packed.ends]
            else:
                values = token_values(self.model, rows.to(device()), rows_mask.to(device()), forward=self.forward)
                scores = end_scores(values, rows_mask.to(device()))
            out[torch.as_tensor(part - lo)] = scores.cpu().float()
        return out

    def set_threads(self, n: int) -> int:
        """Score on `n` threads from now on (the held-out evaluation, when the other roles idle, gives it the
        node's cores); returns the count it had."""
        before = torch.get_num_threads()
        torch.set_num_threads(max(1, n))
        return before

