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
    unwrapped = ReferenceWorker.logprobs.__wrapped__  # without by_reference's ray.put
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
    trimmed = ReferenceWorker.logprobs.__wrapped__(worker, batch, 0, 2)
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
