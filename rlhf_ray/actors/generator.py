"""A generation engine replica (Ray actor): samples answers with transformers `generate`, batched and
left-padded, and loads new policy weights in place. (The vLLM engine behind the same interface is issue #8.)"""

from __future__ import annotations

import os

import torch

from rlhf_ray.config.generation import GenerationSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.models.loading import load_causal_lm, load_tokenizer


class GenerationWorker:
    def __init__(self, *, rank: int, world_size: int, model: dict, generation: dict, seed: int):
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.rank = rank
        self.model_spec = ModelSpec.model_validate(model)
        self.spec = GenerationSpec.model_validate(generation)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_causal_lm(self.model_spec).to(self.device).eval()
        tokenizer = load_tokenizer(self.model_spec)
        self.eos, self.pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.version = 0

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seed: int, greedy: bool = False) -> list[dict]:
        """`n_samples_per_prompt` answers per prompt (1 when greedy), consecutive per prompt, with the sampling
        log-probs (log softmax(logits / T) of each drawn token) and the policy version that produced them."""
        sampling = self.spec.sampling
        n = 1 if greedy else sampling.n_samples_per_prompt
        expanded = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        torch.manual_seed(seed)
        out: list[dict] = []
        for start in range(0, len(expanded), self.spec.hf.batch_size):
            chunk = expanded[start: start + self.spec.hf.batch_size]
            out += self._generate_batch(chunk, greedy)
        return out

    def _generate_batch(self, chunk: list[tuple[int, list[int]]], greedy: bool) -> list[dict]:
        sampling = self.spec.sampling
        width = max(len(p) for _, p in chunk)
        ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (_, p) in enumerate(chunk):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        kwargs = dict(do_sample=not greedy, max_new_tokens=sampling.max_new_tokens,
                      min_new_tokens=sampling.min_new_tokens, eos_token_id=self.eos, pad_token_id=self.pad,
                      output_logits=True, return_dict_in_generate=True,
                      repetition_penalty=sampling.repetition_penalty)
        if not greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        result = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs)
        answers = result.sequences[:, width:].cpu()
        logits = torch.stack(result.logits, dim=1).float().cpu() / sampling.temperature
        logprobs = torch.log_softmax(logits, -1).gather(-1, answers.unsqueeze(-1)).squeeze(-1)
        rows = []
        for row, (index, prompt) in enumerate(chunk):
            tokens = answers[row].tolist()
            finished = self.eos in tokens
            length = tokens.index(self.eos) + 1 if finished else len(tokens)
            rows.append({"prompt_index": index, "prompt_ids": prompt, "answer_ids": tokens[:length],
                         "logprobs": logprobs[row, :length].tolist(), "finished": finished,
                         "version": self.version})
        return rows

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Copy the learner's weights into this engine in place (names as in the HF model's state dict)."""
        params = dict(self.model.named_parameters())
        missing = [name for name in params if name not in state]
        if missing:
            raise KeyError(f"weight update lacks {len(missing)} parameters, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name].to(param.device, param.dtype))
        self.version = version
        return version

    def get_version(self) -> int:
        return self.version
