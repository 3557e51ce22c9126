"""Forward-only roles of PPO: the reference model (log-probs of answers) and the reward model (a score per
answer). Neither trains, so neither needs DeepSpeed: a plain HF module in eval mode on the actor's device.

Each replica scores rows [lo, hi) of the batch it is handed by reference and answers with a reference to its
result, so experience tensors go from actor to actor through the object store, never through the driver."""

from __future__ import annotations

import os

import torch

from rlhf_ray.actors.payload import by_reference
from rlhf_ray.algorithms.experience import unpack_rollouts
from rlhf_ray.algorithms.logprobs import token_logprobs
from rlhf_ray.algorithms.reward_loss import end_scores
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.models.loading import load_causal_lm, load_scalar_model, token_values
from rlhf_ray.models.shared_prompt import forward_answer_logits


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class ReferenceWorker:
    """Log-probs of answer tokens under the frozen starting policy, at the sampling temperature."""

    def __init__(self, *, rank: int, world_size: int, model: dict, micro_batch_size: int, temperature: float):
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.spec = ModelSpec.model_validate(model)
        self.model = load_causal_lm(self.spec).to(_device()).eval()
        self.micro, self.temperature = micro_batch_size, temperature

    @by_reference
    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        seq, mask = batch["sequences"][lo:hi], batch["attention_mask"][lo:hi]
        answer_len = batch["action_mask"].shape[1]
        parts = []
        for s in micro_batches(len(seq), self.micro):
            rows = seq[s].to(_device())
            logits = forward_answer_logits(self.model, self.model, rows, mask[s].to(_device()), answer_len)
            logits.div_(self.temperature)  # in place: no second vocabulary-sized tensor
            parts.append(token_logprobs(logits, rows[:, -answer_len:]).cpu())
        return torch.cat(parts) * batch["action_mask"][lo:hi]

    def ping(self) -> int:
        return 0


class RewardWorker:
    """The reward model's score of each (prompt, answer): its head at the last real token of the sequence.

    A reward model with another tokenizer than the policy's (`bridge_from`: the policy's tokenizer) cannot read
    the policy's token ids: each row is decoded to text with the policy's tokenizer (special tokens dropped) and
    tokenised again with the reward model's conventions, its end-of-text kept only on answers that ended."""

    def __init__(self, *, rank: int, world_size: int, model: dict, micro_batch_size: int, tokens: TokenConventions,
                 bridge_from: str | None = None):
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.spec = ModelSpec.model_validate(model)
        self.tokens = tokens
        self.model = load_scalar_model(self.spec, tokens.pad_id).to(_device()).eval()
        self.micro = micro_batch_size
        self.bridge = None
        if bridge_from is not None:
            from transformers import AutoTokenizer

            self.bridge = (AutoTokenizer.from_pretrained(bridge_from),
                           AutoTokenizer.from_pretrained(self.spec.tokenizer_path))

    def retokenize(self, batch: dict[str, torch.Tensor], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows [lo, hi) as the reward model's tokenizer writes them, right-padded, with their mask."""
        policy, own = self.bridge
        rows = []
        for (prompt_ids, answer_ids), ended in zip(unpack_rollouts(batch, lo, hi), batch["ended"][lo:hi]):
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
    def score(self, batch: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        if self.bridge is not None:
            seq, mask = self.retokenize(batch, lo, hi)
        else:
            seq, mask = batch["sequences"][lo:hi], batch["attention_mask"][lo:hi]
        parts = []
        for s in micro_batches(len(seq), self.micro):
            values = token_values(self.model, seq[s].to(_device()), mask[s].to(_device()))
            parts.append(end_scores(values, mask[s].to(_device())).cpu())
        return torch.cat(parts)

    def set_threads(self, n: int) -> int:
        """Score on `n` threads from now on (the held-out evaluation, when the other roles idle, gives it the
        node's cores); returns the count it had."""
        before = torch.get_num_threads()
        torch.set_num_threads(max(1, n))
        return before

    def ping(self) -> int:
        return 0
