"""`rlhf-ray compare`: answers of two models to the same prompts, side by side (DeepSpeed-Chat's prompt_eval),
with the rule-based score of each answer when a scoring function is given."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_ray.data.adapters import apply_chat_template
from rlhf_ray.data.collate import collate_prompts
from rlhf_ray.data.raw import RawSample
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.functions import column_arguments, load_function


@torch.no_grad()
def generate(model_path: str, prompts: Sequence[str], max_new_tokens: int, greedy: bool = True,
             seed: int = 0, chat_template: bool = False) -> list[str]:
    """Each model's answers; with `chat_template`, each prompt (DeepSpeed-Chat " Human: ... Assistant:" turns or
    plain text) is rendered with the model's own chat template first, as a job with `chat_template: true` does."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokens = TokenConventions.from_tokenizer(tokenizer, model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    torch.manual_seed(seed)
    if chat_template:
        prompts = [apply_chat_template(RawSample(p), tokenizer).prompt for p in prompts]
    batch = collate_prompts([{"prompt_ids": tokens.encode_prompt(tokenizer, p)} for p in prompts], tokens.pad_id)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=not greedy,
                         pad_token_id=tokens.pad_id, eos_token_id=list(tokens.stop_ids))
    answers = [tokens.cut(row)[0] for row in out[:, batch["input_ids"].shape[1]:].tolist()]
    return tokenizer.batch_decode(answers, skip_special_tokens=True)


def compare(base: str, finetuned: str, prompts: Sequence[str], max_new_tokens: int = 64,
            score: str | None = None, columns: Sequence[dict] | None = None, chat_template: bool = False) -> dict:
    """Generate with both models; returns the answers and, with `score`, each model's mean score. `columns`: each
    prompt's dataset columns (its ground truth), passed to the scoring function as a reward job passes them."""
    answers = {key: generate(path, prompts, max_new_tokens, chat_template=chat_template)
               for key, path in (("base", base), ("finetuned", finetuned))}
    result: dict = {"prompts": list(prompts), **answers}
    if score is not None:
        scorer = load_function(score)
        kwargs = column_arguments(scorer, list(columns or [{} for _ in prompts]))
        for key in ("base", "finetuned"):
            values = [float(v) for v in scorer(list(prompts), answers[key], **kwargs)]
            result[f"{key}_scores"] = values
            result[f"{key}_mean_score"] = sum(values) / max(len(values), 1)
    return result


def render(result: dict, base: str, finetuned: str) -> Table:
    table = Table(title="compare", show_lines=True)
    table.add_column("prompt")
    table.add_column(f"base: {base}")
    table.add_column(f"finetuned: {finetuned}")
    for i, prompt in enumerate(result["prompts"]):
        cells = []
        for key in ("base", "finetuned"):
            mark = f" [{result[f'{key}_scores'][i]:g}]" if f"{key}_scores" in result else ""
            cells.append(result[key][i] + mark)
        table.add_row(prompt, *cells)
    if "base_mean_score" in result:
        table.caption = f"mean score: base {result['base_mean_score']:.3f}, finetuned {result['finetuned_mean_score']:.3f}"
    return table


SIDE_BY_SIDE_COLUMNS = 120
"""Narrower than this (a pipe, a CI log, `ray job logs`: 80), three columns of text wrap into slivers: each prompt
is a block of lines instead."""


def blocks(result: dict, base: str, finetuned: str) -> list[str]:
    """The comparison as text blocks, one per prompt: the prompt, then each model's answer on its own line."""
    out = [f"compare: base = {base}, finetuned = {finetuned}"]
    for i, prompt in enumerate(result["prompts"]):
        out += ["", f"prompt: {prompt}"]
        for key in ("base", "finetuned"):
            mark = f"  [score {result[f'{key}_scores'][i]:g}]" if f"{key}_scores" in result else ""
            out.append(f"  {key}: {result[key][i]}{mark}")
    if "base_mean_score" in result:
        out += ["", f"mean score: base {result['base_mean_score']:.3f}, finetuned {result['finetuned_mean_score']:.3f}"]
    return out


def print_comparison(result: dict, base: str, finetuned: str) -> None:
    console = Console(soft_wrap=True)
    if console.is_terminal and console.width >= SIDE_BY_SIDE_COLUMNS:
        console.print(render(result, base, finetuned))
    else:
        console.print("\n".join(blocks(result, base, finetuned)), markup=False, highlight=False)
