"""mmap corpus format, sentence-aligned greedy packing, streaming preprocessing and the proportional sampler."""

from __future__ import annotations

import argparse
import json
import pickle
import random
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from rlhf_ray.data.errors import DataError
from rlhf_ray.data.mmap_corpus import CorpusWriter, MMapCorpus
from rlhf_ray.data.preprocess import (add_preprocess_arguments, pack_lengths, preprocess, run_preprocess,
                                      split_sentences)
from rlhf_ray.config.pretrain import batch_counts
from rlhf_ray.data.sampler import MixedCorpus, ProportionalSampler, shard

WORDS = "alpha beta gamma delta token corpus sample packing memory stream sentence reader writer".split()
CJK = ["你好", "世界", "数据", "模型", "训练"]


def make_documents(n: int, seed: int = 0) -> list[str]:
    """Documents with short and long sentences, CJK sentences, inner newlines and one over-long sentence."""
    rng = random.Random(seed)
    docs = []
    for d in range(n):
        parts = []
        for _ in range(rng.randint(1, 7)):
            kind = rng.random()
            if kind < 0.15:
                parts.append("".join(rng.choices(CJK, k=rng.randint(1, 6))) + rng.choice("。！？"))
            elif kind < 0.25:
                parts.append(" ".join(rng.choices(WORDS, k=rng.randint(2, 5))) + "\n")
            else:
                parts.append(" ".join(rng.choices(WORDS, k=rng.randint(1, 12))).capitalize() + rng.choice(".!?") + " ")
        if d % 7 == 3:  # no terminator anywhere: one sentence far longer than max_len
            parts.append(" ".join(rng.choices(WORDS, k=60)))
        docs.append("".join(parts).strip())
    return docs


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE trained here and saved in HF format (nothing reaches a hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(make_documents(300, seed=1), trainer)
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def write_inputs(tmp_path: Path, docs: list[str]) -> list[Path]:
    """First half as a blank-line separated text file, second half as JSONL."""
    half = len(docs) // 2
    text, jsonl = tmp_path / "a.txt", tmp_path / "b.jsonl"
    text.write_text("\n\n".join(docs[:half]) + "\n", encoding="utf-8")
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[half:])),
                     encoding="utf-8")
    return [text, jsonl]


# ---------------------------------------------------------------- format


@pytest.mark.parametrize("vocab, dtype", [(400, np.uint16), (65535, np.uint16), (65536, np.uint32),
                                          (200_000, np.uint32)])
def test_writer_reader_roundtrip_and_dtype(tmp_path, vocab, dtype):
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, vocab, size=n) for n in (5, 0, 17, 1, 300)] + [np.array([vocab - 1, 0])]
    with CorpusWriter(tmp_path / "c", vocab) as w:
        for s in samples[:3]:
            w.add(s)
        w.add_packed(np.concatenate(samples[3:]), [len(s) for s in samples[3:]])
    corpus = MMapCorpus(tmp_path / "c")
    assert corpus.dtype == np.dtype(dtype)
    assert (tmp_path / "c.bin").stat().st_size == corpus.num_tokens * corpus.dtype.itemsize
    assert len(corpus) == len(samples) and corpus.num_tokens == sum(map(len, samples))
    for got, want in zip(corpus, samples):
        assert got.tolist() == want.tolist()
    assert corpus[-1].tolist() == [vocab - 1, 0] and corpus.sizes.tolist() == [len(s) for s in samples]
    assert isinstance(corpus._bin, np.memmap) and not corpus[0].flags.writeable
    with pytest.raises(IndexError):
        corpus[len(samples)]
    assert pickle.loads(pickle.dumps(corpus))[4].tolist() == samples[4].tolist()
    corpus.verify()
    assert not list(tmp_path.glob("*.tmp"))


def test_writer_rejects_bad_ids_and_a_failed_write_leaves_the_old_corpus(tmp_path):
    with CorpusWriter(tmp_path / "c", 10) as w:
        w.add([1, 2, 3])
    with pytest.raises(ValueError, match="out of range"):
        with CorpusWriter(tmp_path / "c", 10) as w:
            w.add([4, 5])
            w.add([10])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.idx"]
    assert MMapCorpus(tmp_path / "c")[0].tolist() == [1, 2, 3]
    with CorpusWriter(tmp_path / "empty", 10):
        pass
    assert len(MMapCorpus(tmp_path / "empty")) == 0 and MMapCorpus(tmp_path / "empty").num_tokens == 0


def test_reader_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.idx.*not found"):
        MMapCorpus(tmp_path / "nope")
    with CorpusWriter(tmp_path / "c", 1000) as w:
        w.add(list(range(100)))
        w.add(list(range(50)))
    bin_path, idx_path = tmp_path / "c.bin", tmp_path / "c.idx"
    good_idx, good_bin = idx_path.read_bytes(), bin_path.read_bytes()

    bin_path.write_bytes(good_bin[:-10])
    with pytest.raises(DataError, match=r"c\.bin: truncated"):
        MMapCorpus(tmp_path / "c")
    bin_path.write_bytes(good_bin + b"\0\0")
    with pytest.raises(DataError, match=r"c\.bin: .*do not belong together"):
        MMapCorpus(tmp_path / "c")
    bin_path.write_bytes(good_bin)
    idx_path.write_bytes(b"NOTACORP" + good_idx[8:])
    with pytest.raises(DataError, match=r"c\.idx: not a corpus index: bad magic"):
        MMapCorpus(tmp_path / "c")
    idx_path.write_bytes(good_idx[:8] + struct.pack("<I", 99) + good_idx[12:])
    with pytest.raises(DataError, match=r"c\.idx: unsupported corpus index version 99"):
        MMapCorpus(tmp_path / "c")
    idx_path.write_bytes(good_idx[:-8])
    with pytest.raises(DataError, match=r"c\.idx: .*truncated"):
        MMapCorpus(tmp_path / "c")
    bin_path.unlink()
    idx_path.write_bytes(good_idx)
    with pytest.raises(DataError, match=r"c\.bin: corpus file not found"):
        MMapCorpus(tmp_path / "c")


# ---------------------------------------------------------------- splitting and packing


def test_split_sentences_keeps_every_character():
    text = 'Hello world. This is it! 你好。世界！Really?  Yes.\nNext line\n\nend'
    assert split_sentences(text) == ["Hello world.", " This is it!", " 你好。", "世界！", "Really?", "  Yes.\n",
                                     "Next line\n\n", "end"]
    for doc in make_documents(50):
        assert "".join(split_sentences(doc)) == doc


def test_pack_lengths_greedy_rule():
    assert pack_lengths([300, 300, 300, 500, 200, 100], 1024) == [900, 800]  # KnowLM's example, no overlap
    assert pack_lengths([1000, 30, 1000, 20], 1024) == [1000, 30, 1020]
    assert pack_lengths([5, 2500, 10, 3], 1024) == [5, 1024, 1024, 465]  # cut, the remainder packs on
    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.randint(0, 40) for _ in range(rng.randint(1, 20))]
        out = pack_lengths(lens, 32)
        assert sum(out) == sum(lens) and all(0 < n <= 32 for n in out)
        assert all(a + b > 32 for a, b in zip(out, out[1:]))


# ---------------------------------------------------------------- preprocessing


def test_preprocess_roundtrip_and_packing(tmp_path, tokenizer_dir, hf_tok):
    docs = make_documents(60)
    max_len = 24
    stats = preprocess(write_inputs(tmp_path, docs), tokenizer_dir, tmp_path / "out", max_len=max_len,
                       workers=1, chunk_docs=7, progress=False)
    corpus = MMapCorpus(tmp_path / "out")
    assert corpus.dtype == np.uint16 and stats["documents"] == len(docs) and stats["sentence_split_exact"]
    assert (stats["samples"], stats["tokens"]) == (len(corpus), corpus.num_tokens)
    eos, pos, cut = hf_tok.eos_token_id, 0, 0
    for doc in docs:
        sentences = [hf_tok(s, add_special_tokens=False)["input_ids"] for s in split_sentences(doc)]
        sentences[-1] = sentences[-1] + [eos]
        expected = [t for s in sentences for t in s]
        samples, got = [], []
        while len(got) < len(expected):
            samples.append(corpus[pos].tolist())
            got += samples[-1]
            pos += 1
        assert got == expected  # exact round trip, document boundaries respected
        assert hf_tok.decode(got[:-1]) == doc
        assert all(len(s) <= max_len for s in samples)
        assert all(len(a) + len(b) > max_len for a, b in zip(samples, samples[1:]))  # nothing mergeable
        bounds = np.cumsum([0] + [len(s) for s in sentences])
        cuts = np.cumsum([len(s) for s in samples])[:-1]
        for c in cuts:  # a cut inside a sentence only when that sentence was too long
            i = np.searchsorted(bounds, c, side="right") - 1
            if c != bounds[i]:
                assert len(sentences[i]) > max_len
                cut += 1
    assert pos == len(corpus) and cut > 0 and stats["cut_sentences"] > 0


def test_workers_give_byte_identical_files(tmp_path, tokenizer_dir):
    inputs = write_inputs(tmp_path, make_documents(120, seed=3))
    for workers in (1, 2):
        stats = preprocess(inputs, tokenizer_dir, tmp_path / f"w{workers}", max_len=32, workers=workers,
                           chunk_docs=5, progress=False)
        assert stats["workers"] == workers
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()


def test_no_eos_and_cli(tmp_path, tokenizer_dir, hf_tok, capsys):
    (tmp_path / "d.txt").write_text("One. Two!\n\nThree?\n")
    parser = add_preprocess_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--input", str(tmp_path / "d.txt"), "--tokenizer", str(tokenizer_dir), "--out",
                              str(tmp_path / "x"), "--max-len", "64", "--workers", "1", "--no-eos", "--quiet"])
    assert run_preprocess(args) == 0
    assert json.loads(capsys.readouterr().out)["documents"] == 2
    corpus = MMapCorpus(tmp_path / "x")
    assert [hf_tok.decode(s) for s in corpus] == ["One. Two!", "Three?"]
    assert hf_tok.eos_token_id not in np.concatenate(list(corpus)).tolist()


def test_prefix_space_tokenizer_is_detected(tmp_path, caplog):
    """SentencePiece-style tokenizers add a "▁" before every encoded text: reported, not silently accepted."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    tok.train_from_iterator(make_documents(50), trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "sp")
    (tmp_path / "d.txt").write_text("Hello world. Next one!\n")
    stats = preprocess([tmp_path / "d.txt"], tmp_path / "sp", tmp_path / "c", workers=1, progress=False)
    assert stats["sentence_split_exact"] is False and "differs from encoding running text" in caplog.text


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_json_names_file_and_line_and_leaves_nothing(tmp_path, tokenizer_dir, workers):
    lines = [json.dumps({"text": d}) for d in make_documents(40)]
    lines[33] = '{"text": "broken'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:34: malformed JSON"):
        preprocess([bad], tokenizer_dir, tmp_path / "out", workers=workers, chunk_docs=4, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: no string field 'text'"):
        preprocess([bad], tokenizer_dir, tmp_path / "out", workers=1, progress=False)
    with pytest.raises(DataError, match=r"missing\.txt: input file not found"):
        preprocess([tmp_path / "missing.txt"], tokenizer_dir, tmp_path / "out", workers=1, progress=False)


# ---------------------------------------------------------------- sampler


def test_batch_counts_largest_remainder():
    assert batch_counts([0.1, 0.2, 0.7], 10) == [1, 2, 7]
    assert batch_counts([1, 1, 1], 8) == [3, 3, 2]  # ties go to the lower index
    assert batch_counts([100, 50, 10], 16) == [10, 5, 1]  # KnowLM's example
    assert batch_counts([0.5, 0.3, 0.2], 7) == [4, 2, 1]  # 3.5, 2.1, 1.4 -> 3,2,1 + the .5 seat
    assert sum(batch_counts([0.37, 0.41, 0.22], 1512)) == 1512
    with pytest.raises(ValueError, match="gets 0 of 8"):
        ProportionalSampler([10, 10], [0.99, 0.01], 8, seed=0)


def test_sampler_counts_every_batch_and_mixes_within_each_rank():
    sampler = ProportionalSampler([50, 7, 300], [0.5, 0.25, 0.25], global_batch_size=24, seed=1)
    assert sampler.counts == [12, 6, 6]
    for _ in range(40):
        batch = next(sampler)
        assert Counter(j for j, _ in batch) == {0: 12, 1: 6, 2: 6}
        assert all(0 <= i < sampler.corpus_sizes[j] for j, i in batch)
        for rank in range(4):  # contiguous per-rank slices still see every corpus in about the ratio
            got = Counter(j for j, _ in shard(batch, rank, 4))
            assert all(abs(got[j] - c * 6 / 24) < 2 for j, c in enumerate(sampler.counts))


def test_same_seed_same_stream_and_resume_equals_uninterrupted():
    make = lambda seed: ProportionalSampler([37, 5, 1000], [3, 1, 4], 16, seed=seed)  # noqa: E731
    a, b = make(7), make(7)
    full = [next(a) for _ in range(60)]
    assert full == [next(b) for _ in range(60)]
    assert full != [next(make(8)) for _ in range(60)]
    for k in (0, 1, 13, 59):
        resumed = make(7)
        resumed.load_state_dict({"position": k, **{key: v for key, v in a.state_dict().items() if key != "position"}})
        assert [next(resumed) for _ in range(60 - k)] == full[k:]
    assert a.state_dict()["position"] == 60 and make(7).batch(42) == full[42]
    with pytest.raises(ValueError, match="counts"):
        ProportionalSampler([37, 5, 1000], [1, 1, 1], 16, seed=7).load_state_dict(a.state_dict())


def test_exhaustion_reshuffles_and_covers_each_sample_once_per_epoch():
    sampler = ProportionalSampler([13, 40], [0.3, 0.7], 10, seed=3)  # 3 + 7 per batch: epochs straddle batches
    draws: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(13 * 4):
        for j, i in next(sampler):
            draws[j].append(i)
    for j, n in enumerate(sampler.corpus_sizes):
        epochs = [draws[j][e * n:(e + 1) * n] for e in range(len(draws[j]) // n)]
        assert len(epochs) >= 3
        assert all(sorted(e) == list(range(n)) for e in epochs)
        assert len({tuple(e) for e in epochs}) == len(epochs)  # a new order each epoch
    assert sampler.epochs_done()[0] == pytest.approx(52 * 3 / 13)


def test_mixed_corpus_fetches_batches(tmp_path):
    for name, base in (("a", 0), ("b", 100)):
        with CorpusWriter(tmp_path / name, 1000) as w:
            for i in range(5):
                w.add([base + i] * (i + 1))
    mixed = MixedCorpus.open([tmp_path / "a", tmp_path / "b"])
    sampler = ProportionalSampler(mixed.sizes, [1, 1], 4, seed=0)
    batch = next(sampler)
    assert [int(x[0]) for x in mixed.fetch(batch)] == [(0 if j == 0 else 100) + i for j, i in batch]
    assert mixed[(1, 4)].tolist() == [104] * 5
