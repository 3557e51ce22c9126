"""Tokenised phase data: labels, end-of-text, truncation accounting, padding sides, caching by content."""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoTokenizer

from rlhf_ray.config.data import DataSpec, DatasetSpec
from rlhf_ray.data.build import build_phase_data
from rlhf_ray.data.collate import collate_pairs, collate_prompts, collate_lm
from rlhf_ray.data.errors import DataError
from rlhf_ray.data.raw import RawSample
from rlhf_ray.data.tokenized import IGNORE_INDEX, pack, tokenize_pairs, tokenize_prompts, tokenize_sft
from rlhf_ray.data.tokens import TokenConventions


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def conv(tok, tiny_model):
    return TokenConventions.from_tokenizer(tok, tiny_model)


SAMPLE = RawSample(" Human: Sort 3 1 2 0 Assistant:", " 0 1 2 3", " 0 2 1 3")


def test_sft_labels_mask_the_prompt_and_end_with_eos(tok, conv):
    (row,), report = tokenize_sft([SAMPLE], tok, conv, max_seq_len=64)
    prompt = tok(SAMPLE.prompt, add_special_tokens=False)["input_ids"]
    assert row["input_ids"][: len(prompt)] == prompt and row["input_ids"][-1] == tok.eos_token_id
    assert row["labels"][: len(prompt)] == [IGNORE_INDEX] * len(prompt)
    assert row["labels"][len(prompt):] == row["input_ids"][len(prompt):]
    (row,), _ = tokenize_sft([SAMPLE], tok, conv, max_seq_len=64, train_on_prompt=True)
    assert row["labels"] == row["input_ids"]
    assert report.kept == 1 and not report.dropped


def test_overlong_samples_keep_eos_and_are_counted(tok, conv):
    answer_len = len(tok(SAMPLE.chosen, add_special_tokens=False)["input_ids"]) + 1
    rows, report = tokenize_sft([SAMPLE], tok, conv, max_seq_len=answer_len + 2)
    assert len(rows[0]["input_ids"]) == answer_len + 2 and rows[0]["input_ids"][-1] == tok.eos_token_id
    assert sum(report.repaired.values()) == 1
    rows, report = tokenize_sft([SAMPLE], tok, conv, max_seq_len=answer_len + 2, overlong="drop")
    assert rows == [] and sum(report.dropped.values()) == 1 and "dropped 1" in report.summary()
    rows, report = tokenize_sft([SAMPLE], tok, conv, max_seq_len=answer_len - 1)  # the answer alone does not fit
    assert rows == [] and sum(report.dropped.values()) == 1


def test_pairs_share_the_prompt_and_identical_pairs_are_dropped(tok, conv):
    rows, report = tokenize_pairs([SAMPLE, RawSample(SAMPLE.prompt, " 1", " 1")], tok, conv, max_seq_len=64)
    assert len(rows) == 1 and report.dropped["chosen == rejected"] == 1
    c, r = rows[0]["chosen_ids"], rows[0]["rejected_ids"]
    n = len(tok(SAMPLE.prompt, add_special_tokens=False)["input_ids"])
    assert c[:n] == r[:n] and c != r and c[-1] == r[-1] == tok.eos_token_id
    batch = collate_pairs(rows * 2, tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"][0].tolist()[: len(c)] == c


def test_prompts_are_cut_from_the_left_and_left_padded(tok, conv):
    long = RawSample(" Human: " + "word " * 50 + "Sort 1 0 Assistant:")
    limit = len(tok(SAMPLE.prompt, add_special_tokens=False)["input_ids"])
    rows, report = tokenize_prompts([SAMPLE, long], tok, conv, max_prompt_len=limit)
    assert len(rows[1]["prompt_ids"]) == limit and sum(report.repaired.values()) == 1
    assert tok.decode(rows[1]["prompt_ids"]).endswith("Assistant:")  # the end the answer follows is kept
    batch = collate_prompts(rows, tok.pad_token_id)
    assert batch["input_ids"][:, -1].tolist() == [rows[0]["prompt_ids"][-1], rows[1]["prompt_ids"][-1]]
    short = tokenize_prompts([RawSample(" Human: Sort 1 Assistant:")], tok, conv, max_prompt_len=limit)[0]
    batch = collate_prompts(short + rows, tok.pad_token_id)
    assert batch["attention_mask"][0, 0] == 0 and batch["input_ids"][0, 0] == tok.pad_token_id
    assert batch["attention_mask"][0, -1] == 1


def test_sft_collation_pads_right_without_labels_and_packing_keeps_samples_whole(tok, conv):
    rows, _ = tokenize_sft([SAMPLE, RawSample(" Human: hi Assistant:", " yes")], tok, conv, max_seq_len=64)
    batch = collate_lm(rows, tok.pad_token_id)
    short = min(range(2), key=lambda i: len(rows[i]["input_ids"]))
    n = len(rows[short]["input_ids"])
    assert (batch["labels"][short, n:] == IGNORE_INDEX).all() and (batch["input_ids"][short, n:] == tok.pad_token_id).all()
    packed = pack(rows, max_seq_len=64)
    assert len(packed) == 1 and packed[0]["input_ids"] == rows[0]["input_ids"] + rows[1]["input_ids"]


def test_phases_are_disjoint_and_deterministic(tok, tmp_path):
    spec = DataSpec(datasets=[DatasetSpec(name="demo/sort")], max_seq_len=64, max_prompt_len=32)
    phases = {p: build_phase_data(spec, tok, p, seed=1, cache_dir=tmp_path) for p in ("sft", "rm", "ppo")}
    sft_prompts = {tuple(r["input_ids"][: r["labels"].index(next(x for x in r["labels"] if x != IGNORE_INDEX))])
                   for r in phases["sft"].train}
    ppo_prompts = {tuple(r["prompt_ids"]) for r in phases["ppo"].train}
    assert sft_prompts and ppo_prompts and not sft_prompts & ppo_prompts
    again = build_phase_data(spec, tok, "ppo", seed=1, cache_dir=tmp_path / "other")
    assert again.train == phases["ppo"].train
    assert build_phase_data(spec, tok, "ppo", seed=2, cache_dir=tmp_path).train != phases["ppo"].train


def test_a_changed_local_file_invalidates_the_cache(tok, tmp_path):
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(40)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = DataSpec(datasets=[DatasetSpec(name="Dahoas/synthetic-instruct-gptj-pairwise", path=str(data))],
                    split="1,0,0", max_seq_len=64)
    first = build_phase_data(spec, tok, "sft", seed=0, cache_dir=tmp_path / "cache")
    assert build_phase_data(spec, tok, "sft", seed=0, cache_dir=tmp_path / "cache").cache_file == first.cache_file
    rows[0]["chosen"] = "a changed answer"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    os.utime(data, ns=(1, 1))  # even with an old mtime, the size changed
    second = build_phase_data(spec, tok, "sft", seed=0, cache_dir=tmp_path / "cache")
    assert second.cache_file != first.cache_file
    texts = [tok.decode(r["input_ids"]) for r in second.train + second.eval]
    assert any("a changed answer" in t for t in texts)


def test_a_phase_with_no_share_is_an_error_before_training(tok, tmp_path):
    spec = DataSpec(datasets=[DatasetSpec(name="demo/sort")], split="1,0,0")
    with pytest.raises(DataError, match="demo/sort: the rm phase gets no training samples"):
        build_phase_data(spec, tok, "rm", seed=0, cache_dir=tmp_path)


def test_conversations_train_on_assistant_replies_and_name_a_bad_message(tmp_path, tiny_model):
    """A `format: {messages_field: ...}` dataset: every assistant reply carries labels (its stop id included),
    user turns are context; a conversation too long for max_seq_len is dropped and counted; a malformed message is
    refused naming file, line and the message's field."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    talk = [{"role": "user", "content": "sort 3 1 2"}, {"role": "assistant", "content": "3 1 2"},
            {"role": "user", "content": "That is not right. Try again."}, {"role": "assistant", "content": "1 2 3"}]
    rows = [{"messages": talk, "id": i} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    spec = DataSpec.model_validate({"datasets": [{"name": "custom", "path": str(tmp_path / "train.jsonl"),
                                                  "format": {"messages_field": "messages"}}],
                                    "split": "1,0,0", "max_seq_len": 64})
    data = build_phase_data(spec, tokenizer, "sft", seed=1, cache_dir=tmp_path / "cache")
    row = data.train[0]
    text = tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])
    eos = tokenizer.eos_token
    assert text == f" 3 1 2{eos} 1 2 3{eos}", text  # both replies, each with its stop id; no user turn
    assert tokenizer.decode(row["input_ids"]) == tokenizer.apply_chat_template(talk, tokenize=False)

    with pytest.raises(DataError, match="conversation longer than 12 tokens"):
        build_phase_data(spec.model_copy(update={"max_seq_len": 12}), tokenizer, "sft", seed=1,
                         cache_dir=tmp_path / "cache")

    bad = [*rows[:3], {"messages": [talk[0], {"role": "assistant", "content": 7}]}]
    (tmp_path / "bad.jsonl").write_text("\n".join(json.dumps(r) for r in bad))
    spec_bad = spec.model_copy(update={"datasets": [spec.datasets[0].model_copy(
        update={"path": str(tmp_path / "bad.jsonl")})]})
    with pytest.raises(DataError, match=r"bad.jsonl:4: field .messages\.1\.content"):
        build_phase_data(spec_bad, tokenizer, "sft", seed=1, cache_dir=tmp_path / "cache")


def test_a_template_that_rewrites_earlier_turns_is_refused_for_conversations():
    """Some templates drop or change earlier turns as the conversation grows (e.g. reasoning models that strip past
    thinking): such a conversation cannot be trained turn by turn, and the error says so."""
    from rlhf_ray.data.adapters import conversation_pieces

    class Forgetful:  # renders only the last assistant reply in full
        chat_template = "x"
        name_or_path = "forgetful"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
            text = "".join(f"<{m['role']}>{m['content'] if m['role'] != 'assistant' or i == last else ''}</>"
                           for i, m in enumerate(messages))
            return text + ("<assistant>" if add_generation_prompt else "")

    talk = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"})
    with pytest.raises(ValueError, match="forgetful rewrites earlier turns when message 3 is added"):
        conversation_pieces(talk, Forgetful())
    with pytest.raises(ValueError, match="no assistant message"):
        conversation_pieces(talk[:1], Forgetful())

    class NoTemplate:
        chat_template = None
        name_or_path = "plain"

    with pytest.raises(ValueError, match="plain has no chat template, and conversation rows"):
        conversation_pieces(talk, NoTemplate())


def test_a_prompt_template_rewraps_the_question_for_a_base_model(tok, conv, tmp_path):
    spec = DataSpec(datasets=[DatasetSpec(name="demo/arithmetic", prompt_template="Question: {prompt}\nAnswer:")],
                    split="0,0,1", max_prompt_len=64)
    data = build_phase_data(spec, tok, "ppo", seed=0, cache_dir=tmp_path, tokens=conv)
    text = tok.decode(data.eval[0]["prompt_ids"])
    assert text.startswith("Question: What is ") and text.endswith("?\nAnswer:") and "Human" not in text
    plain = DataSpec(datasets=[DatasetSpec(name="demo/arithmetic")], split="0,0,1", max_prompt_len=64)
    assert build_phase_data(plain, tok, "ppo", seed=0, cache_dir=tmp_path, tokens=conv).cache_file != data.cache_file


def test_eval_max_samples_keeps_the_first_held_out_samples_and_says_so(tiny_model, tmp_path):
    """`train.eval_max_samples`: an SFT, RM or DPO job evaluates on the first N held-out samples of its phase (the
    same ones every run), the training split untouched; the data report names the cut."""
    from rlhf_ray.config import load_job
    from rlhf_ray.jobs.supervised import prepared
    from tests.conftest import ROOT

    def sft(*overrides):
        return load_job(ROOT / "configs/quickstart/sft.yaml",
                        [f"model.path={tiny_model}", f"output_dir={tmp_path}", *overrides])

    *_, whole, _ = prepared(sft(), "sft")
    *_, cut, _ = prepared(sft("train.eval_max_samples=5"), "sft")
    assert len(whole.eval) > 5 and cut.eval == whole.eval[:5] and cut.train == whole.train
    assert cut.report["eval"] == f"{whole.report['eval']}; evaluated on the first 5 (train.eval_max_samples)"
    *_, same, _ = prepared(sft(f"train.eval_max_samples={len(whole.eval)}"), "sft")
    assert same.eval == whole.eval and same.report == whole.report
