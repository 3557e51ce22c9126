"""Scoring answers with each distinct prompt run once (models/shared_prompt.py) gives the whole-sequence forward's
logits and gradients, on every model family, while the prompt runs once per distinct prompt."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_ray.algorithms.experience import pack_rollouts
from rlhf_ray.algorithms.logprobs import answer_logprobs, token_logprobs
from rlhf_ray.models.families import FAMILIES, build_family_model
from rlhf_ray.models.shared_prompt import distinct_rows, forward_answer_logits

# three prompts of different lengths (left-padded), answered 3, 1 and 2 times, in mixed order, ragged answers
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
ROWS = [(0, [20, 21, 22]), (1, [23]), (0, [24, 25]), (2, [26, 27, 28, 29]), (0, [30]), (2, [31, 32])]


def batch() -> dict[str, torch.Tensor]:
    return pack_rollouts([PROMPTS[p] for p, _ in ROWS], [a for _, a in ROWS], pad_id=0)


def test_distinct_rows_finds_the_first_row_of_each_and_maps_every_row_to_it():
    rows = torch.tensor([[1, 2], [3, 4], [1, 2], [5, 6], [3, 4]])
    first, inverse = distinct_rows(rows)
    assert torch.equal(rows[first][inverse], rows)
    assert sorted(first.tolist()) == [0, 1, 3]  # first occurrences, not later ones


def forwards(model):
    """The model's forward, recording the shape of every input it runs."""
    shapes = []

    def forward(**kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return model(**kwargs)

    return forward, shapes


def full_logprobs(model, b, temperature=0.7):
    """The whole sequence's forward, every token at its position within its row (as the engines number them)."""
    positions = (b.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b.sequences, attention_mask=b.attention_mask, position_ids=positions).logits
    return answer_logprobs(logits, b.sequences, b.action_mask.shape[1], temperature) * b.action_mask


def shared_logprobs(forward, model, b, temperature=0.7):
    answer_len = b.action_mask.shape[1]
    logits = forward_answer_logits(forward, model, b.sequences, b.attention_mask, answer_len)
    return token_logprobs(logits, b.sequences[:, -answer_len:], temperature) * b.action_mask


def test_shared_prompts_give_the_full_forward_log_probs_and_gradients(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.train()  # dropout is 0 in the tiny model: training mode only keeps the graph
    b = batch()
    forward, shapes = forwards(model)
    shared = shared_logprobs(forward, model, b)
    prompt_len, answer_len = b.sequences.shape[1] - 4, 4
    assert shapes == [(3, prompt_len), (6, answer_len)]  # 3 prompts once, then the 6 answers on their cache
    full = full_logprobs(model, b)
    torch.testing.assert_close(shared, full, rtol=0, atol=1e-5)

    shared.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    full_logprobs(model, b).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_distinct_prompts_and_gradient_checkpointing_run_the_whole_sequence(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    b = pack_rollouts([PROMPTS[0], PROMPTS[1]], [[20, 21], [22]], pad_id=0)
    forward, shapes = forwards(model)
    with torch.no_grad():
        torch.testing.assert_close(shared_logprobs(forward, model, b), full_logprobs(model, b), rtol=0, atol=1e-5)
    assert shapes == [tuple(b.sequences.shape)]

    model.gradient_checkpointing_enable()
    model.train()
    forward, shapes = forwards(model)
    shared_logprobs(forward, model, batch())
    assert shapes == [tuple(batch().sequences.shape)]  # the checkpointed forward drops the cache


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_scores_shared_prompts_like_the_whole_sequence(family, tmp_path):
    path = build_family_model(family, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    b = batch()
    forward, shapes = forwards(model)
    with torch.no_grad():
        shared = shared_logprobs(forward, model, b)
        full = full_logprobs(model, b)
    torch.testing.assert_close(shared, full, rtol=0, atol=1e-4)
    prompt_len, answer_len = b.sequences.shape[1] - 4, 4
    assert shapes == [(3, prompt_len), (6, answer_len)], f"{family}: the prompts did not run once"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_rows_log_probs_do_not_depend_on_the_padding_its_batch_gave_it(family, tmp_path):
    """Each row scored in the padded batch (left-padded prompt, right-padded answer) against the same row alone,
    no pads: equal. A model with absolute position embeddings (GPT-2) counted the pads as positions before."""
    from rlhf_ray.models.shared_prompt import answer_logprobs_and_entropy

    model = AutoModelForCausalLM.from_pretrained(build_family_model(family, tmp_path / family), dtype=torch.float32)
    b = batch()
    with torch.no_grad():
        padded, _ = answer_logprobs_and_entropy(model.eval(), model, b.sequences, b.attention_mask, 4, 0.7,
                                                share_prompts=False, with_entropy=False)
        for r, (p, answer) in enumerate(ROWS):
            alone = pack_rollouts([PROMPTS[p]], [answer], pad_id=0)
            logp, _ = answer_logprobs_and_entropy(model, model, alone.sequences, alone.attention_mask, len(answer),
                                                  0.7, with_entropy=False)
            torch.testing.assert_close(padded[r, : len(answer)], logp[0], rtol=0, atol=1e-4)


def test_a_sequence_longer_than_the_sliding_window_runs_whole(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(build_family_model("gemma2", tmp_path / "g"), dtype=torch.float32)
    model.config.sliding_window = 8  # shorter than the batch's 10 positions: the prompt's cache would be cut
    b = batch()
    forward, shapes = forwards(model.eval())
    with torch.no_grad():
        torch.testing.assert_close(shared_logprobs(forward, model, b), full_logprobs(model, b), rtol=0, atol=1e-4)
    assert shapes == [tuple(b.sequences.shape)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gets_the_same_log_probs_entropy_and_gradients_from_the_chunked_projection(family, tmp_path):
    """The LM head applied a chunk of positions at a time (never [B, A, V] logits) against the whole logits;
    Gemma 2 soft-caps its logits, so it keeps the logits path."""
    from rlhf_ray.models.shared_prompt import projection_head

    from rlhf_ray.models.loading import disable_dropout

    model = AutoModelForCausalLM.from_pretrained(build_family_model(family, tmp_path / family), dtype=torch.float32)
    disable_dropout(model)
    model.train()
    b, answer_len = batch(), 4
    results = {chunked: scores_and_gradients(model, b, answer_len, chunked=chunked) for chunked in (True, False)}
    assert (projection_head(model) is None) == (family == "gemma2")
    assert_same_scores(results[True], results[False])


def scores_and_gradients(model, b, answer_len: int, **kwargs):
    """(log-probs, entropies, parameter gradients of the log-probs' sum) of the batch's answers at T = 0.7."""
    from rlhf_ray.models.shared_prompt import answer_logprobs_and_entropy

    model.zero_grad()
    logp, ent = answer_logprobs_and_entropy(model, model, b.sequences, b.attention_mask, answer_len, 0.7, **kwargs)
    (logp * b.action_mask).sum().backward()
    return logp * b.action_mask, ent * b.action_mask, [p.grad.clone() for p in model.parameters()
                                                       if p.grad is not None]


def assert_same_scores(got, want):
    (lp1, ent1, grads1), (lp0, ent0, grads0) = got, want
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-4)
    assert len(grads1) == len(grads0)
    for g1, g0 in zip(grads1, grads0):
        torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-5)


def test_the_chunked_projection_never_holds_more_than_a_chunk_of_logits():
    from rlhf_ray.algorithms.logprobs import projected_logprobs

    hidden = torch.randn(2, 6, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    tokens = torch.randint(0, 50, (2, 6))
    seen = []

    original = torch.Tensor.__matmul__  # record every matmul's output shape, forward and backward

    def matmul(a, b):
        out = original(a, b)
        seen.append(tuple(out.shape))
        return out

    torch.Tensor.__matmul__ = matmul
    try:
        logp, _ = projected_logprobs(hidden, weight, tokens, chunk=5)
        logp.sum().backward()
    finally:
        torch.Tensor.__matmul__ = original
    logits_shapes = [s for s in seen if s[-1] == 50]
    assert logits_shapes and all(s[0] <= 5 for s in logits_shapes), seen  # 12 positions, at most 5 at a time
