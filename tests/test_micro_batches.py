"""Micro-batches cut by a token budget (algorithms/micro_batches.py, `max_tokens_per_micro_batch`): the cut itself,
and golden checks on real DeepSpeed engines that it changes only the padding, never the numbers: log-probs,
values, losses and the updated weights equal the row-count path's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from rlhf_ray.algorithms.micro_batches import by_token_budget, padded_tokens, row_lengths, split_to


def test_rows_sorted_by_length_are_cut_within_the_budget_and_padding_falls():
    """16 prompts x 4 answers (GRPO-like: the answers to one prompt are neighbours, prompts of 20-120 tokens,
    answers of 10-64)."""
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(16), 4)
    prompt, answer = rng.integers(20, 120, 16)[groups], rng.integers(10, 65, 64)
    parts = by_token_budget(prompt, answer, 900, groups)
    order = np.concatenate(parts)
    assert sorted(order.tolist()) == list(range(64))  # every row once
    assert all(padded_tokens(prompt[p], answer[p]) <= 900 for p in parts)
    assert (np.diff(prompt[order]) >= 0).all() or (np.diff(np.maximum.reduceat(answer[order], np.arange(0, 64, 4))) >= 0).all()
    assert all(len(set(order[i: i + 4] // 4)) == 1 for i in range(0, 64, 4))  # a prompt's answers stay together
    for a, b in zip(parts, parts[1:]):  # one more row would pass the budget
        both = np.concatenate([a, b[:1]])
        assert padded_tokens(prompt[both], answer[both]) > 900
    by_rows = [np.arange(i, i + 8) for i in range(0, 64, 8)]  # the row-count path: 8 rows in prompt order

    def padding(split):
        cost = sum(padded_tokens(prompt[p], answer[p]) for p in split)
        return (cost - int((prompt + answer).sum())) / cost

    assert padding(parts) < padding(by_rows), (padding(parts), padding(by_rows))
    # rows of their own (PPO), answers varying more than prompts: sorted by answer length, most pads go
    prompt, answer = rng.integers(60, 80, 64), rng.integers(5, 300, 64)
    parts, by_rows = by_token_budget(prompt, answer, 1500), [np.arange(i, i + 4) for i in range(0, 64, 4)]
    assert (np.diff(answer[np.concatenate(parts)]) >= 0).all()
    assert padding(parts) < 0.35 * padding(by_rows), (padding(parts), padding(by_rows))


def test_a_rank_that_needs_fewer_micro_batches_halves_its_costliest_until_the_counts_match():
    prompt, answer = np.array([2, 2, 2, 2, 9, 9]), np.array([1, 1, 1, 1, 9, 9])
    parts = by_token_budget(prompt, answer, 40)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5]]
    four = split_to(parts, prompt, answer, 4)
    assert [p.tolist() for p in four] == [[0, 1], [2, 3], [4], [5]]
    assert [p.tolist() for p in split_to(parts, prompt, answer, 3)] == [[0, 1, 2, 3], [4], [5]]  # the 36-token one
    with pytest.raises(ValueError, match="7 micro-batches asked of 6 rows"):
        split_to(parts, prompt, answer, 7)


def test_row_lengths_read_the_layout():
    attention = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0, 0]])
    action = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]).float()  # the answers: the last 4 columns
    prompt, answer = row_lengths(attention, action)
    assert prompt.tolist() == [2, 3, 1] and answer.tolist() == [2, 3, 1]


GOLDEN = """
import os, torch
from types import SimpleNamespace
os.environ["DS_ACCELERATOR"] = "cpu"
from rlhf_ray.algorithms.batch import Experience
from rlhf_ray.config.deepspeed import DeepSpeedSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.optim import OptimizerSpec
from rlhf_ray.distributed import init_process_group, listen
from rlhf_ray.learners.critic import CriticLearner
from rlhf_ray.learners.deepspeed_setup import build_deepspeed
from rlhf_ray.algorithms.losses import PolicyLoss
from rlhf_ray.learners.policy import PolicyLearner
from rlhf_ray.models import packing

sock = listen("127.0.0.1")
init_process_group(0, 1, "127.0.0.1", sock.getsockname()[1], sock, 120)
spec = ModelSpec(path="{model}", dtype="fp32", disable_dropout=True)
optim = OptimizerSpec(lr=1e-3, warmup_steps=0)
torch.manual_seed(0)
B, P, A = 8, 6, 7
prompt_len, answer_len = torch.randint(2, P + 1, (B,)), torch.randint(1, A + 1, (B,))
prompt_len[1], prompt_len[6], answer_len[1], answer_len[6] = P, 2, A, 1  # a long row, a short one
seq = torch.randint(3, 60, (B, P + A))
mask = torch.zeros(B, P + A, dtype=torch.long)
action = torch.zeros(B, A)
for i in range(B):
    mask[i, P - prompt_len[i]: P + answer_len[i]] = 1
    action[i, : answer_len[i]] = 1
seq = seq * mask
prompt_len[3] = prompt_len[2]  # rows 2 and 3 answer the same prompt (a GRPO group): packed, they share it
seq[3, :P], mask[3, :P] = seq[2, :P], mask[2, :P]
exp = Experience(sequences=seq, attention_mask=mask, action_mask=action, prompt_width=P,
                 advantages=torch.randn(B, A) * action, ref_logp=-torch.rand(B, A) * action,
                 rewards=torch.zeros(B, A), values=torch.randn(B, A) * action, returns=torch.randn(B, A) * action)
minibatches = SimpleNamespace(rows=[[0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0]],
                              meta=SimpleNamespace(rollout_index=0))

def run(cls, stage, budget, packed=False, **kwargs):
    ds = DeepSpeedSpec(zero_stage=stage, gradient_accumulation_steps=4)
    learner = cls(rank=0, world_size=1, model=spec.model_dump(), optim=optim.model_dump(), deepspeed=ds.model_dump(),
                  micro_batch_size=2, seed=0, temperature=1.0, max_tokens_per_micro_batch=budget, pad_token_id=0,
                  pack_sequences=packed, **kwargs)
    torch.manual_seed(1)  # the critic's value head starts random: the same in both runs
    model = learner.build_model()
    if packed:
        packing.enable(model)
    learner.deepspeed, learner.scheduler = build_deepspeed(model, spec, optim, ds, 2, 1, 10)
    learner.fetch = lambda mb: exp
    forward = learner._logprobs if cls is PolicyLearner else learner._values
    before = learner.over_my_rows(exp, forward)
    metrics = learner.train(minibatches).metrics()
    after = [p.detach().clone() for p in learner.deepspeed.module.parameters()]
    return before, metrics, after, learner.step_counts

for cls, kwargs in ((PolicyLearner, dict(loss=PolicyLoss(kl_coef=0.1), train_batch_size=8)),
                    (CriticLearner, dict(clip_value=0.2))):
    for stage in (0, 2):
        rows = run(cls, stage, None, **kwargs)
        pad_rows = [m for k, m in rows[1].items() if k.endswith("padding_fraction")][0]
        for name, budget, packed in (("budget", 20, False), ("packed", None, True), ("packed budget", 20, True)):
            tokens = run(cls, stage, budget, packed, **kwargs)
            torch.testing.assert_close(tokens[0], rows[0], rtol=0, atol=1e-5)
            for key, value in rows[1].items():
                if key.endswith(("loss", "kl", "entropy", "clip_fraction", "approx_kl", "ratio")):
                    assert abs(tokens[1][key] - value) <= 1e-5 * max(1.0, abs(value)), (cls.__name__, stage, name, key, tokens[1][key], value)
            for a, b in zip(tokens[2], rows[2]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            assert rows[3] == tokens[3] == {{"applied": 2, "skipped": 0}}, (rows[3], tokens[3])
            pad = [m for k, m in tokens[1].items() if k.endswith("padding_fraction")][0]
            assert pad < pad_rows and (pad == 0) == packed, (name, pad, pad_rows)
            print(cls.__name__, stage, name, "padding", round(pad_rows, 3), "->", round(pad, 3))
print("ok")
"""


def test_token_budget_and_packed_micro_batches_give_the_row_count_paths_numbers_with_less_padding(tiny_model):
    """Policy and critic, ZeRO-0 and ZeRO-2, two mini-batches of 8 rows of mixed lengths (two rows answering one
    prompt): 4 micro-batches of 2 rows against micro-batches of at most 20 tokens (a varying count; the optimizer
    steps once per mini-batch either way), against packed rows (models/packing.py: no pads, the shared prompt once)
    of 2 rows and of at most 20 tokens: the scoring forwards, the losses and the weights after both steps agree
    to 1e-5, and the packed runs compute no pad."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(GOLDEN.format(model=tiny_model))],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]
