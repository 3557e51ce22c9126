"""The reference worker scores answers from the logits of the last A + 1 positions only (transformers'
`logits_to_keep`), and gets the log-probs a full forward gives."""

from __future__ import annotations

import pytest
import torch

from rlhf_ray.actors.scoring import ReferenceWorker
from rlhf_ray.algorithms.experience import pack_rollouts
from rlhf_ray.algorithms.logprobs import answer_logprobs


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked projection", "logits_to_keep"])
def test_the_reference_asks_for_answer_logits_only_and_matches_a_full_forward(tiny_model, monkeypatch, chunked):
    """Either way only the last A + 1 positions reach the LM head (`logits_to_keep`). By default the head is then
    applied a chunk of positions at a time outside the forward, which returns hidden states; a model whose head
    cannot be split (soft-capped logits) gets those positions' logits from the forward."""
    import rlhf_ray.models.shared_prompt as shared_prompt

    if not chunked:
        monkeypatch.setattr(shared_prompt, "projection_head", lambda model: None)
    worker = ReferenceWorker(rank=0, world_size=1, model={"path": str(tiny_model), "dtype": "fp32"},
                             micro_batch_size=2, temperature=0.7)
    batch = pack_rollouts([[5, 6, 7, 8, 9, 10], [11, 12]], [[13, 14], [15, 16, 17]], pad_id=0)
    seen = []
    forward = worker.model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append((kwargs.get("logits_to_keep"), *out.logits.shape[1:]))
        return out

    worker.model.forward = recording
    unwrapped = ReferenceWorker.logprobs.computes  # without by_reference's record
    kept = unwrapped(worker, batch, 0, 2)
    # answer width 3: its 3 tokens are predicted by the last 4 positions
    width = worker.model.config.hidden_size if chunked else worker.model.config.vocab_size
    assert seen == [(4, 4, width)]

    with torch.no_grad():
        logits = forward(input_ids=batch.sequences, attention_mask=batch.attention_mask).logits
    assert logits.shape[1] == 9  # what it computed before: every position, the prompt's included
    full = answer_logprobs(logits, batch.sequences, 3, 0.7) * batch.action_mask
    torch.testing.assert_close(kept, full, rtol=0, atol=1e-5)


def test_each_micro_batch_runs_at_its_own_width_with_the_same_log_probs(tiny_model):
    """A micro-batch of a short prompt and a short answer drops the pad columns its rows share (the prompt's left
    padding, the answer's right padding) instead of running at the rollout's longest; log-probs are unchanged."""
    worker = ReferenceWorker(rank=0, world_size=1, model={"path": str(tiny_model), "dtype": "fp32"},
                             micro_batch_size=1, temperature=0.7)
    batch = pack_rollouts([[5, 6, 7, 8, 9, 10], [11, 12]], [[13], [15, 16, 17, 18]], pad_id=0)
    widths = []
    forward = worker.model.forward

    def recording(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    worker.model.forward = recording
    trimmed = ReferenceWorker.logprobs.computes(worker, batch, 0, 2)
    assert widths == [7, 6]  # row 0: 6 prompt + 1 answer token; row 1: 2 + 4 (the batch is 6 + 4 wide)
    with torch.no_grad():
        logits = forward(input_ids=batch.sequences, attention_mask=batch.attention_mask).logits
    full = answer_logprobs(logits, batch.sequences, 4, 0.7) * batch.action_mask
    assert trimmed.shape == full.shape == (2, 4)
    torch.testing.assert_close(trimmed, full, rtol=0, atol=1e-5)


def test_sft_loss_asks_for_answer_logits_only_and_matches_a_full_forward(tiny_model):
    """SFT's loss skips the vocabulary projection of the prompt columns that no row's labels need."""
    from types import SimpleNamespace

    from rlhf_ray.algorithms.losses import lm_loss_sum
    from rlhf_ray.data.collate import collate_lm
    from rlhf_ray.learners.sft import SFTLearner
    from rlhf_ray.models.loading import load_causal_lm
    from rlhf_ray.config import ModelSpec

    model = load_causal_lm(ModelSpec(path=str(tiny_model), dtype="fp32"))
    seen = []
    forward = model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append((kwargs.get("logits_to_keep"), out.logits.shape[1]))
        return out

    model.forward = recording

    def engine(**kwargs):  # what a DeepSpeed engine does with a forward call
        return model(**kwargs)

    engine.module, engine.device = model, torch.device("cpu")
    rank = SimpleNamespace(deepspeed=engine, pad_token_id=0)
    rows = [{"input_ids": [5, 6, 7, 8, 9, 10, 11], "labels": [-100, -100, -100, -100, 9, 10, 11]},
            {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, -100, 8, 9]}]
    kept = SFTLearner.lm_loss_sum(rank, collate_lm(rows, 0))
    assert seen == [(5, 5)]  # the earliest label is column 3, predicted by column 2: columns 2..6 are kept

    batch = collate_lm(rows, 0)
    with torch.no_grad():
        full = lm_loss_sum(forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                           batch["labels"])
    torch.testing.assert_close(kept.detach(), full, rtol=0, atol=1e-5)


def test_values_come_from_the_root_forward_and_equal_the_heads_output_at_every_position(tiny_model):
    """ZeRO-3 prefetches parameters from hooks on the root module's forward: the critic and reward model must call
    it, not the backbone inside it."""
    from rlhf_ray.config import ModelSpec
    from rlhf_ray.models.loading import load_scalar_model, scalar_head, token_values

    model = load_scalar_model(ModelSpec(path=str(tiny_model), dtype="fp32"), pad_token_id=0)
    roots = []
    model.register_forward_pre_hook(lambda module, args: roots.append(1))
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
    mask = (ids != 0).long()
    values = token_values(model, ids, mask)
    assert roots == [1] and values.shape == (2, 5)
    with torch.no_grad():
        backbone = getattr(model, model.base_model_prefix)
        expected = scalar_head(model)(backbone(input_ids=ids, attention_mask=mask).last_hidden_state).squeeze(-1)
    torch.testing.assert_close(values.detach(), expected, rtol=0, atol=1e-6)


def test_a_token_budget_and_packing_score_the_rows_with_the_same_numbers_and_fewer_pads(tiny_model):
    """Reference log-probs and reward scores with `max_tokens_per_micro_batch`: rows of similar length run
    together, many short ones to a forward, and every row's result lands in its own place, equal to the row-count
    path's; packed (`pack_sequences`), every micro-batch runs as one row of its real tokens, the same numbers."""
    from rlhf_ray.actors.scoring import RewardWorker
    from rlhf_ray.data.tokens import TokenConventions
    from rlhf_ray.models.loading import load_tokenizer
    from rlhf_ray.config import ModelSpec

    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18], [19, 20], [21, 22, 23], [19, 20]]
    answers = [[30, 31, 32, 33, 34, 35], [36], [37, 38, 39, 40, 41, 42], [43], [44, 45], [46]]
    batch = pack_rollouts(prompts, answers, pad_id=0)
    model = {"path": str(tiny_model), "dtype": "fp32"}
    tokens = TokenConventions.from_tokenizer(load_tokenizer(ModelSpec(**model)), str(tiny_model))
    results, cost = {}, {}
    for budget, packed in ((None, False), (24, False), (None, True), (24, True)):
        shapes = []
        reference = ReferenceWorker(rank=0, world_size=1, model=model, micro_batch_size=2, temperature=0.7,
                                    max_tokens_per_micro_batch=budget, pack_sequences=packed)
        torch.manual_seed(0)  # the same fresh score head
        reward = RewardWorker(rank=0, world_size=1, model=model, micro_batch_size=2, tokens=tokens,
                              max_tokens_per_micro_batch=budget, pack_sequences=packed)
        for worker in (reference, reward):
            forward = worker.model.forward

            def recording(*args, forward=forward, **kwargs):
                shapes.append(tuple(kwargs["input_ids"].shape))
                return forward(*args, **kwargs)

            worker.model.forward = recording
        results[budget, packed] = (ReferenceWorker.logprobs.computes(reference, batch, 1, 6),
                                   RewardWorker.score.computes(reward, batch, 1, 6))
        cost[budget, packed] = sum(rows * width for rows, width in shapes)
        assert not packed or all(rows == 1 for rows, _ in shapes)
    for key in results:
        torch.testing.assert_close(results[key][0], results[None, False][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(results[key][1], results[None, False][1], rtol=0, atol=1e-5)
    assert results[24, False][0].shape == (5, 6) and results[24, False][1].shape == (5,)
    # rows 1-5 are 3, 12, 3, 5 and 3 tokens long: by twos in order they run as 2 x 12 + 2 x 5 + 1 x 3 = 37 tokens
    # per role; by length within 24 tokens as 4 x 5 (the four short ones) + 1 x 12 = 32, where the reference runs
    # the short ones' 3 distinct prompts (3 x 3) and their answers on them (4 x 2): 29. Packed: their 26 tokens;
    # within 24 tokens rows 3 and 5 (one prompt) run together and the reference reads their prompt once
    assert cost == {(None, False): 2 * 37, (24, False): 32 + 29, (None, True): 2 * 26, (24, True): 26 + 24}
