"""The dataset registry: every adapter's exact strings, every local layout, fingerprints, and bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_ray.config.data import DatasetFormatSpec, DatasetSpec
from rlhf_ray.data import registry
from rlhf_ray.data.adapters import apply_chat_template, remove_citations
from rlhf_ray.data.errors import DataError
from rlhf_ray.data.raw import RawSample

S = RawSample

# name -> (rows in the dataset's own schema, the samples they must give, rows dropped by reason)
CASES: dict[str, tuple[list[dict], list[RawSample], dict[str, int]]] = {
    "Dahoas/rm-static": (
        [{"prompt": "\n\nHuman: Hi there\n\nAssistant:", "chosen": " Hello!", "rejected": " Go away.",
          "response": " Hello!"}],
        [S("\n\nHuman: Hi there\n\nAssistant:", " Hello!", " Go away.")], {}),
    "Dahoas/full-hh-rlhf": (
        [{"prompt": "\n\nHuman: Tea?\n\nAssistant:", "chosen": " Yes please.", "rejected": " No."}],
        [S("\n\nHuman: Tea?\n\nAssistant:", " Yes please.", " No.")], {}),
    "Dahoas/synthetic-instruct-gptj-pairwise": (
        [{"prompt": "Name a fruit.", "chosen": "Apple.", "rejected": "Car."}],
        [S(" Human: Name a fruit. Assistant:", " Apple.", " Car.")], {}),
    "yitingxie/rlhf-reward-datasets": (
        [{"prompt": "\n\nHuman: Bake bread?\n\n", "chosen": "Assistant: Knead it.", "rejected": "Assistant: No."},
         {"prompt": "Human: a ", "chosen": "Assistant: b Human: c Assistant: d", "rejected": "Assistant: e"}],
        [S("\n\nHuman: Bake bread?\n\nAssistant:", " Knead it.", " No."),
         S("Human: a Assistant:", " d", " e")], {}),
    "openai/webgpt_comparisons": (
        [{"question": {"id": "q1", "full_text": "Why is the sky blue?", "dataset": "eli5"},
          "answer_0": "Blue light scatters more [1][2]. It is short-wave[3].", "score_0": 1.0,
          "answer_1": "Because (obviously) it is.", "score_1": -1.0},
         {"question": {"id": "q2", "full_text": "Tie?", "dataset": "eli5"},
          "answer_0": "First [4].", "score_0": 0.0, "answer_1": "Second.", "score_1": 0.0},
         {"question": {"id": "q3", "full_text": "Second wins?", "dataset": "eli5"},
          "answer_0": "Worse.", "score_0": -0.5, "answer_1": "Better (see [5]) answer.", "score_1": 0.5}],
        [S(" Human: Why is the sky blue? Assistant:", " Blue light scatters more. It is short-wave.",
           " Because it is."),
         S(" Human: Tie? Assistant:", " First.", " Second."),
         S(" Human: Second wins? Assistant:", " Better) answer.", " Worse.")], {}),
    "stanfordnlp/SHP": (
        [{"post_id": "p", "history": "Is it safe?", "human_ref_A": "Yes.", "human_ref_B": "No.", "labels": 1,
          "score_A": 5, "score_B": 1},
         {"post_id": "p", "history": "Why?", "human_ref_A": "Meh.", "human_ref_B": "Because.", "labels": 0,
          "score_A": 1, "score_B": 9}],
        [S(" Human: Is it safe? Assistant:", " Yes.", " No."),
         S(" Human: Why? Assistant:", " Because.", " Meh.")], {}),
    "pvduy/sharegpt_alpaca_oa_vicuna_format": (
        [{"prompt": "USER: Hi ASSISTANT:", "label": "Hello."},
         {"prompt": "", "label": "orphan"},
         {"prompt": "USER: Only a prompt ASSISTANT:", "label": ""}],
        [S("Human: Hi Assistant:", " Hello."), S("Human: Only a prompt Assistant:")], {"empty prompt": 1}),
    "wangrui6/Zhihu-KOL": (
        [{"INSTRUCTION": "如何学习？", "RESPONSE": "多练习。", "SOURCE": "zhihu", "METADATA": "{}"},
         {"INSTRUCTION": None, "RESPONSE": "x", "SOURCE": "zhihu", "METADATA": "{}"}],
        [S(" Human: 如何学习？ Assistant:", " 多练习。")], {"null prompt": 1}),
    "Hello-SimpleAI/HC3-Chinese": (
        [{"id": "1", "question": "什么是猫？", "human_answers": ["一种动物。"], "chatgpt_answers": ["猫。"]},
         {"id": "2", "question": "空？", "human_answers": [], "chatgpt_answers": ["?"]}],
        [S(" Human: 什么是猫？ Assistant:", " 一种动物。"), S(" Human: 空？ Assistant:")], {}),
    "Cohere/miracl-zh-queries-22-12": (
        [{"query_id": "1", "query": "长城多长？", "emb": [0.1],
          "positive_passages": [{"docid": "a", "text": "两万公里。", "title": "长城"}],
          "negative_passages": [{"docid": "b", "text": "故宫很大。", "title": "故宫"}]}],
        [S(" Human: 长城多长？ Assistant:", " 两万公里。", " 故宫很大。")], {}),
    "Cohere/miracl-ja-queries-22-12": (
        [{"query_id": "1", "query": "富士山の高さは？",
          "positive_passages": [{"docid": "a", "text": "3776メートル。", "title": "富士山"}],
          "negative_passages": []}],
        [S(" Human: 富士山の高さは？ Assistant:", " 3776メートル。")], {}),
    "mkqa-Chinese": (
        [{"example_id": 1, "queries": {"en": "Who?", "zh_cn": "谁？", "ja": "誰？"},
          "answers": {"en": [{"type": 1, "text": "Me"}], "zh_cn": [{"type": 1, "text": "我"}],
                      "ja": [{"type": 1, "text": "私"}]}}],
        [S(" Human: 谁？ Assistant:", " 我")], {}),
    "mkqa-Japanese": (
        [{"example_id": 1, "queries": {"en": "Who?", "zh_cn": "谁？", "ja": "誰？"},
          "answers": {"en": [{"type": 1, "text": "Me"}], "zh_cn": [{"type": 1, "text": "我"}],
                      "ja": [{"type": 1, "text": "私"}]}}],
        [S(" Human: 誰？ Assistant:", " 私")], {}),
    "lmqg/qg_jaquad": (
        [{"question": "日本の首都は？", "sentence": "東京です。", "paragraph": "長い文。", "answer": "東京"}],
        [S(" Human: 日本の首都は？ Assistant:", " 東京です。")], {}),
    "lmqg/qag_jaquad": (
        [{"questions": ["最初の質問？", "次の質問？"], "answers": ["a", "b"], "paragraph": "段落。"}],
        [S(" Human: 最初の質問？ Assistant:", " 段落。")], {}),
    "local/jsonfile": (
        [{"prompt": "Human: Hi Assistant:", "chosen": "Hello", "rejected": "Bye"},
         {"prompt": "Human: SFT only Assistant:", "chosen": "Sure"}],
        [S(" Human: Hi Assistant:", " Hello", " Bye"), S(" Human: SFT only Assistant:", " Sure")], {}),
}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    else:
        path.write_text(json.dumps(rows, ensure_ascii=False, indent=1), encoding="utf-8")
    return path


def load(name: str, path: Path, **extra) -> registry.RawDataset:
    return registry.load_raw(DatasetSpec(name=name, path=str(path), **extra))


def test_every_registered_dataset_has_a_case():
    assert set(registry.registered_names()) == set(CASES) | {"demo/arithmetic", "demo/sort", "demo/word-problems",
                                                                  "demo/word-problems-calculator",
                                                                  "demo/word-problems-steps", "demo/descriptions"}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_adapter_gives_deepspeed_chat_strings(tmp_path, name, suffix):
    rows, expected, dropped = CASES[name]
    raw = load(name, write_rows(tmp_path / f"train{suffix}", rows))
    assert raw.name == name
    assert raw.train == expected
    assert raw.eval is None  # a single file is the train split; eval is carved later
    assert raw.dropped == dropped


def test_webgpt_citation_removal_matches_deepspeed_chat():
    assert remove_citations("A [1] b [2][3]. C(d) e") == "A b. C e"


def test_json_array_folder_and_save_to_disk_layouts_read_the_same(tmp_path):
    import datasets

    rows = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(4)]
    held_out = [{"prompt": "q", "chosen": "a", "rejected": "b"}]
    name = "Dahoas/synthetic-instruct-gptj-pairwise"
    expected_train = [S(f" Human: p{i} Assistant:", f" c{i}", f" r{i}") for i in range(4)]
    expected_eval = [S(" Human: q Assistant:", " a", " b")]

    assert load(name, write_rows(tmp_path / "one.json", rows)).train == expected_train
    for suffix in (".json", ".jsonl", ".parquet"):
        folder = tmp_path / f"folder{suffix}"
        write_rows(folder / f"train{suffix}", rows)
        write_rows(folder / f"test{suffix}", held_out)
        raw = load(name, folder)
        assert (raw.train, raw.eval) == (expected_train, expected_eval), suffix

    shards = tmp_path / "hub_snapshot"
    write_rows(shards / "data" / "train-00000-of-00002.parquet", rows[:2])
    write_rows(shards / "data" / "train-00001-of-00002.parquet", rows[2:])
    write_rows(shards / "data" / "validation-00000-of-00001.parquet", held_out)
    raw = load(name, shards)
    assert (raw.train, raw.eval) == (expected_train, expected_eval)

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "validation": datasets.Dataset.from_list(held_out)}).save_to_disk(tmp_path / "dict")
    raw = load(name, tmp_path / "dict")
    assert (raw.train, raw.eval) == (expected_train, expected_eval)
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "single")
    raw = load(name, tmp_path / "single")
    assert (raw.train, raw.eval) == (expected_train, None)


def test_local_jsonfile_reads_deepspeed_chats_data_folder(tmp_path):
    write_rows(tmp_path / "data" / "train.json", [{"prompt": "Human: a Assistant:", "chosen": "b", "rejected": "c"}])
    write_rows(tmp_path / "data" / "eval.json", [{"prompt": "Human: d Assistant:", "chosen": "e", "rejected": None}])
    raw = load("local/jsonfile", tmp_path)
    assert raw.train == [S(" Human: a Assistant:", " b", " c")]
    assert raw.eval == [S(" Human: d Assistant:", " e")]


def test_split_names_follow_the_adapter_then_the_spec(tmp_path):
    folder = tmp_path / "shp"
    row = CASES["stanfordnlp/SHP"][0][0]
    for split in ("train", "validation", "test", "train_prefs"):
        write_rows(folder / f"{split}.jsonl", [{**row, "history": split}])
    raw = load("stanfordnlp/SHP", folder)
    assert raw.eval[0].prompt == " Human: validation Assistant:"  # SHP's own held-out split wins over test
    raw = load("stanfordnlp/SHP", folder, train_split="train_prefs", eval_split="test")
    assert (raw.train[0].prompt, raw.eval[0].prompt) == (" Human: train_prefs Assistant:", " Human: test Assistant:")
    with pytest.raises(DataError, match="no split 'nope'"):
        load("stanfordnlp/SHP", folder, eval_split="nope")


def test_fingerprint_changes_when_a_local_file_changes(tmp_path):
    path = write_rows(tmp_path / "train.jsonl", CASES["Dahoas/rm-static"][0])
    spec = DatasetSpec(name="Dahoas/rm-static", path=str(path))
    first = registry.fingerprint(spec)
    assert registry.load_raw(spec).fingerprint == first == registry.fingerprint(spec)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000))  # same size, newer
    assert registry.fingerprint(spec) != first
    second = registry.fingerprint(spec)
    path.write_text(path.read_text() + "\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000))  # same mtime, other size
    assert registry.fingerprint(spec) not in (first, second)
    other = DatasetSpec(name="Dahoas/rm-static", path=str(path), format=None, train_split="train")
    assert registry.fingerprint(other) != registry.fingerprint(spec)


def test_hub_load_uses_hub_name_subset_revision_and_split_names(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, subset=None, revision=None):
        calls.append((name, subset, revision))
        rows, _, _ = CASES["mkqa-Chinese"]
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    raw = registry.load_raw(DatasetSpec(name="mkqa-Chinese", subset="default", revision="abc123"))
    assert calls == [("mkqa", "default", "abc123")]
    assert (raw.train, raw.eval) == (CASES["mkqa-Chinese"][1], None)
    fingerprints = {registry.fingerprint(DatasetSpec(name="mkqa-Chinese", revision=r)) for r in (None, "a", "b")}
    assert len(fingerprints) == 3


def test_unreachable_hub_is_a_data_error_that_suggests_a_local_path(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"cannot load 'Dahoas/rm-static' from the hub .*no network.*set path"):
        registry.load_raw(DatasetSpec(name="Dahoas/rm-static"))


# --- bad input -------------------------------------------------------------------------------------------------


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n\n{"prompt": "a", "chosen": \n')
    with pytest.raises(DataError) as info:
        load("Dahoas/rm-static", path)
    assert str(info.value).startswith(f"{path}:3: malformed JSON line")
    array = tmp_path / "rows.json"
    array.write_text('[\n {"prompt": "a"},\n {"prompt": }\n]')
    with pytest.raises(DataError, match=rf"^{array}:3: malformed JSON"):
        load("Dahoas/rm-static", array)


def test_missing_field_names_file_line_and_field(tmp_path):
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}]
    path = write_rows(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError) as info:
        load("Dahoas/rm-static", path)
    assert str(info.value).startswith(f"{path}:2: field 'rejected' is missing")
    assert info.value.field == "rejected"
    parquet = write_rows(tmp_path / "train.parquet", [{"question": {"id": "x"}, "answer_0": "a", "answer_1": "b",
                                                       "score_0": 1.0, "score_1": 0.0}])
    with pytest.raises(DataError, match=rf"^{parquet}: row index 0: field 'question.full_text' is missing"):
        load("openai/webgpt_comparisons", parquet)
    wrong_type = write_rows(tmp_path / "typed.jsonl", [{"prompt": 3, "chosen": "b", "rejected": "c"}])
    with pytest.raises(DataError, match=rf"^{wrong_type}:1: field 'prompt' is int, expected str"):
        load("Dahoas/rm-static", wrong_type)


def test_empty_split_names_dataset_and_split(tmp_path):
    folder = tmp_path / "data"
    write_rows(folder / "train.jsonl", CASES["Dahoas/rm-static"][0])
    (folder / "test.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"dataset 'Dahoas/rm-static': split 'test' \(.*test.jsonl\) has no rows"):
        load("Dahoas/rm-static", folder)
    only_dropped = write_rows(tmp_path / "zhihu.jsonl", [{"INSTRUCTION": None, "RESPONSE": "x"}])
    with pytest.raises(DataError, match=r"split 'train' .* no usable rows \(all 1 dropped: \{'null prompt': 1\}\)"):
        load("wangrui6/Zhihu-KOL", only_dropped)


def test_unknown_name_lists_registered_names_and_the_closest():
    with pytest.raises(DataError) as info:
        registry.load_raw(DatasetSpec(name="dahoas/rm-statik"))
    message = str(info.value)
    assert "unknown dataset 'dahoas/rm-statik'; did you mean 'Dahoas/rm-static'?" in message
    assert all(name in message for name in registry.registered_names())


def test_substrings_of_registered_names_are_not_matched():
    with pytest.raises(DataError, match="unknown dataset 'Dahoas/rm-static-v2'"):
        registry.resolve_adapter(DatasetSpec(name="Dahoas/rm-static-v2"))


@pytest.mark.parametrize("spec, match", [
    (dict(name="local/jsonfile"), "reads local files only; set path"),
    (dict(name="demo/arithmetic", path="x.jsonl"), "generated by code"),
    (dict(name="Dahoas/rm-static", format={"prompt_field": "q"}), "registered with its own field mapping"),
    (dict(name="Dahoas/rm-static", path="/no/such/file.jsonl"), "does not exist"),
])
def test_misconfigured_specs_are_data_errors(spec, match):
    with pytest.raises(DataError, match=match):
        registry.load_raw(DatasetSpec(**spec))


def test_unsupported_file_and_empty_folder_are_data_errors(tmp_path):
    csv = tmp_path / "train.csv"
    csv.write_text("prompt,chosen\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load("Dahoas/rm-static", csv)
    with pytest.raises(DataError, match="holds no .jsonl, .json, .parquet files"):
        load("Dahoas/rm-static", tmp_path)


# --- datasets described in YAML --------------------------------------------------------------------------------

ROWS = [{"q": {"text": "2+2?"}, "good": "4", "bad": "5"}]


@pytest.mark.parametrize("template, answer_template, expected", [
    ("dschat", None, S(" Human: 2+2? Assistant:", " 4", " 5")),
    ("raw", None, S("2+2?", "4", "5")),
    ("Question: {prompt}\nAnswer:", None, S("Question: 2+2?\nAnswer:", " 4", " 5")),
    ("### {prompt}\n", "{answer}</s>", S("### 2+2?\n", "4</s>", "5</s>")),
])
def test_format_section_maps_fields_and_template(tmp_path, template, answer_template, expected):
    fmt = DatasetFormatSpec(prompt_field="q.text", chosen_field="good", rejected_field="bad", template=template,
                            answer_template=answer_template)
    raw = load("custom", write_rows(tmp_path / "train.jsonl", ROWS), format=fmt)
    assert raw.train == [expected]


def test_unregistered_hub_id_with_format_reads_the_hub(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda name, subset=None, revision=None: datasets.DatasetDict(
        {"train_prefs": datasets.Dataset.from_list(ROWS), "test_prefs": datasets.Dataset.from_list(ROWS)}))
    spec = DatasetSpec(name="someone/prefs", format={"prompt_field": "q.text", "chosen_field": "good"},
                       train_split="train_prefs", eval_split="test_prefs")
    raw = registry.load_raw(spec)
    assert raw.train == raw.eval == [S(" Human: 2+2? Assistant:", " 4")]


def test_chat_template_is_left_to_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    spec = DatasetSpec(name="custom", path=str(write_rows(tmp_path / "train.jsonl", ROWS)),
                       format={"prompt_field": "q.text", "chosen_field": "good", "rejected_field": "bad",
                               "template": "chat_template"})
    assert registry.uses_chat_template(spec)
    (sample,) = registry.load_raw(spec).train
    assert sample == S("2+2?", "4", "5")
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"?": 0}, unk_token="?")),
                                        chat_template=template)
    rendered = apply_chat_template(sample, tokenizer)
    assert rendered == S("<|user|>2+2?<|end|><|assistant|>", "4<|end|>", "5<|end|>")


def test_format_in_a_job_yaml_is_validated(write_yaml):
    from rlhf_ray.config import ConfigError, load_job

    base = ("kind: sft\nmodel: {path: m}\ndata:\n  datasets:\n    - name: custom\n      path: rows.jsonl\n"
            "      format: {prompt_field: q, chosen_field: a, template: %s}\n")
    job = load_job(write_yaml(base % "raw"))
    assert job.data.datasets[0].format.template == "raw"
    with pytest.raises(ConfigError) as info:
        load_job(write_yaml(base % "'Q: {question}'"))
    assert any("datasets.0.format.template" in p or "datasets[0].format.template" in p for p in info.value.problems)
    with pytest.raises(ConfigError):
        load_job(write_yaml(base.replace("      format: {prompt_field: q, chosen_field: a, template: %s}\n", "")))
