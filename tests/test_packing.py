"""Packed rows (models/packing.py, `pack_sequences`): a micro-batch as one row of its real tokens, attention block
by block, a shared prompt once. On every model family the answers' log-probs, entropies and gradients, and a
scalar head's values, equal the padded forward's; what cannot be packed is refused, naming why."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf_ray.models import packing
from rlhf_ray.models.families import FAMILIES, build_family_model
from rlhf_ray.models.loading import disable_dropout, token_values
from tests.test_shared_prompt import PROMPTS, ROWS, assert_same_scores, batch, scores_and_gradients

ANSWER = 4  # the batch's answer columns


def test_the_packed_row_holds_each_rows_tokens_once_and_points_at_their_predictions():
    b = batch()
    alone, shared = packing.pack(b.sequences, b.attention_mask, ANSWER), \
        packing.pack(b.sequences, b.attention_mask, ANSWER, share_prompts=True)
    assert alone.tokens == int(b.attention_mask.sum()) == 41
    assert shared.tokens == (6 + 3 + 2 + 1) + (2 + 1) + (4 + 4 + 2) == 25  # each prompt once, then its answers
    for rows in (alone, shared):
        ids = rows.input_ids[0]
        for r, (p, answer) in enumerate(ROWS):  # token j is predicted at token j - 1; the first at the prompt's last
            assert ids[rows.answer_index[r, 1: len(answer)]].tolist() == answer[:-1]
            assert ids[rows.answer_index[r, 0]].item() == PROMPTS[p][-1]
            assert ids[rows.ends[r]].item() == answer[-1]
    # positions count from 0 per row; an answer that shares its prompt continues after it
    assert shared.position_ids[0, :9].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # prompt 0, then its first answer
    assert shared.position_ids[0, 9:11].tolist() == [6, 7]  # its second answer


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_packed_gives_the_padded_log_probs_entropy_gradients_and_values(family, tmp_path):
    folder = build_family_model(family, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    disable_dropout(model)
    if reason := packing.problem(type(model), model.config.to_dict()):
        assert family == "gemma2" and "soft-caps" in reason  # the one family whose attention SDPA cannot run
        with pytest.raises(ValueError, match="pack_sequences: Gemma2ForCausalLM soft-caps"):
            packing.enable(model)
        return
    packing.enable(model)
    model.train()
    b = batch()
    assert_same_scores(scores_and_gradients(model, b, ANSWER, packed=True), scores_and_gradients(model, b, ANSWER))

    scalar = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32,
                                                                pad_token_id=0).eval()
    packing.enable(scalar)
    with torch.no_grad():
        padded = token_values(scalar, b.sequences, b.attention_mask)
        rows = packing.pack(b.sequences, b.attention_mask, ANSWER, share_prompts=True)
        values = packing.packed_values(scalar, rows)
    start = b.sequences.shape[1] - ANSWER - 1  # the critic's values: the head where each answer token is predicted
    torch.testing.assert_close(values[rows.answer_index] * b.action_mask,
                               padded[:, start: start + ANSWER] * b.action_mask, rtol=0, atol=1e-5)
    last = b.attention_mask.shape[1] - 1 - b.attention_mask.flip(1).argmax(1)  # a reward model's score
    torch.testing.assert_close(values[rows.ends], padded[torch.arange(len(b)), last], rtol=0, atol=1e-5)
    with torch.no_grad():  # as the reward worker packs: every row its own sequence, no prompt / answer split
        alone = packing.pack(b.sequences, b.attention_mask, answer_len=0)
        scores = packing.packed_values(scalar, alone)[alone.ends]
    assert alone.tokens == int(b.attention_mask.sum())
    torch.testing.assert_close(scores, padded[torch.arange(len(b)), last], rtol=0, atol=1e-5)


def test_rows_with_pads_between_their_tokens_are_refused():
    b = batch()
    mask = b.attention_mask.clone()
    mask[3, -3] = 0  # a hole in row 3's answer
    with pytest.raises(ValueError, match="row 3 has pads between its tokens"):
        packing.pack(b.sequences, mask, ANSWER)


def test_unpacked_forwards_of_an_enabled_model_stay_the_models_own(tiny_model):
    """Packing enabled, a padded forward (a sharded replica's, generation's) gets its usual masks."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    b = batch()
    with torch.no_grad():
        before = model(input_ids=b.sequences, attention_mask=b.attention_mask).logits
        packing.enable(model)
        after = model(input_ids=b.sequences, attention_mask=b.attention_mask).logits
    keep = b.attention_mask.bool()
    torch.testing.assert_close(after[keep], before[keep], rtol=0, atol=1e-5)


def test_the_default_packs_models_that_can_and_gain(tiny_model, tmp_path):
    """pack_sequences unset: a model large enough to gain is packed, the tiny one (hidden 128: the block loop costs
    more than its pads) and one that cannot run packed attention are not; true packs the tiny one anyway."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert not packing.enable_if(tiny, None) and not packing.enable_if(tiny, False)
    assert packing.enable_if(tiny, True)
    config = json.loads((tiny_model / "config.json").read_text()) | {"hidden_size": 256, "intermediate_size": 512}
    wide = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures",)}))
    assert packing.worth_packing(wide.config.to_dict()) and packing.enable_if(wide, None)
    capped = {"hidden_size": 512, "attn_logit_softcapping": 50.0}
    assert packing.problem(LlamaForCausalLM, capped) is not None  # such a model stays padded by default
