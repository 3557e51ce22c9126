"""The data side of the pretrain job, without Ray: the held-out split, the batches each rank trains on, the config, and
the corpus checks that refuse a broken corpus before any actor starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ray

from rlhf_ray.cli import EXIT_BAD_CONFIG, main
from rlhf_ray.config import ConfigError, PipelineJob, PretrainJob, load_job
from rlhf_ray.data.heldout import HeldOutSplit
from rlhf_ray.data.mmap_corpus import CorpusWriter, corpus_paths
from rlhf_ray.learners.pretrain_mix import PretrainMix


@pytest.mark.parametrize("n,fraction,cap", [(2, 0.01, 10), (10, 0.1, 10), (100, 0.01, 256), (1000, 0.05, 7),
                                            (37, 0.5, 1000), (101, 0.3, 5)])
def test_heldout_split_partitions_every_corpus_into_spread_disjoint_parts(n, fraction, cap):
    split = HeldOutSplit(n, fraction, cap)
    heldout = split.heldout_indices()
    train = split.train_indices(np.arange(split.num_train))
    assert 1 <= split.num_heldout <= min(cap, n - 1)
    assert split.num_heldout >= min(cap, int(np.ceil(n * fraction)), n // 2)
    assert sorted(np.concatenate([heldout, train]).tolist()) == list(range(n))  # disjoint and complete
    assert np.all(np.diff(train) > 0)  # training sample t is the t-th non-held-out sample
    if split.num_heldout > 1:  # spread over the corpus, not bunched at its end
        assert heldout[0] < n // 2 + 1 and np.max(np.diff(heldout)) == split.stride
    with pytest.raises(IndexError):
        split.train_indices([split.num_train])


def test_a_one_sample_corpus_cannot_be_split():
    with pytest.raises(ValueError, match="at least 2"):
        HeldOutSplit(1, 0.1, 10)


def identity_corpus(prefix: Path, corpus: int, samples: int) -> str:
    """Sample i of corpus c is [c, i // 256, i % 256, ...]: its tokens say which sample it is."""
    with CorpusWriter(prefix, vocab_size=1000) as writer:
        for i in range(samples):
            writer.add([100 + corpus, i // 256, i % 256] + [7] * (i % 5))
    return str(prefix)


def keys(rows: list[dict]) -> list[tuple[int, int]]:
    return [(r["input_ids"][0] - 100, r["input_ids"][1] * 256 + r["input_ids"][2]) for r in rows]


def test_a_step_trains_the_same_samples_on_any_rank_count_and_never_a_heldout_one(tmp_path):
    prefixes = [identity_corpus(tmp_path / "a", 0, 50), identity_corpus(tmp_path / "b", 1, 23)]
    mix = PretrainMix(prefixes, global_batch_size=12, seed=3, pad_token_id=0, weights=[2.0, 1.0], heldout=(0.1, 4))
    heldout = {(j, int(i)) for j in range(2) for i in mix.splits[j].heldout_indices()}
    assert {key for j in range(2) for key in keys(mix.heldout_rows(j))} == heldout
    seen: list[tuple[int, int]] = []
    for step in range(20):
        per_world = {w: [k for r in range(w) for k in keys(mix.rank_rows(step, r, w))] for w in (1, 2, 4)}
        assert per_world[1] == per_world[2] == per_world[4]  # dealt out in rank order, contiguously
        batch = per_world[1]
        assert sum(1 for j, _ in batch if j == 0) == 8 and sum(1 for j, _ in batch if j == 1) == 4  # weights 2:1
        assert not heldout & set(batch)
        seen += batch
    # an epoch of a corpus covers each of its training samples once before any repeats
    first_epoch_b = [k for k in seen if k[0] == 1][: mix.splits[1].num_train]
    assert len(set(first_epoch_b)) == mix.splits[1].num_train
    parts = mix.micro_batches(5, 1, 2, micro_batch_size=2)
    assert len(parts) == 3 and all(p["input_ids"].shape[0] == 2 for p in parts)
    assert (parts[0]["labels"][parts[0]["attention_mask"] == 0] == -100).all()  # padding carries no loss


def test_max_seq_len_cuts_long_samples(tmp_path):
    prefix = tmp_path / "long"
    with CorpusWriter(prefix, vocab_size=1000) as writer:
        for i in range(10):
            writer.add(list(range(1, 30)))
    mix = PretrainMix([str(prefix)], 2, 0, 0, heldout=(0.2, 2), max_seq_len=8)
    assert {len(r["input_ids"]) for r in mix.rank_rows(0, 0, 1)} == {8}


# ---- config ------------------------------------------------------------------------------------------------------

def pretrain_yaml(write_yaml, model: Path, corpora: list[str], extra: str = "") -> Path:
    listed = "".join(f"    - path: {c}\n" for c in corpora)
    return write_yaml(f"""\
kind: pretrain
output_dir: {Path(corpora[0]).parent / 'out'}
model:
  path: {model}
  dtype: fp32
data:
  corpora:
{listed}train:
  micro_batch_size: 2
  max_steps: 3
deepspeed:
  zero_stage: 0
placement:
  replicas: 1
{extra}""")


def test_a_corpus_whose_weight_rounds_to_nothing_is_refused_naming_it(write_yaml, tiny_model, tmp_path):
    path = pretrain_yaml(write_yaml, tiny_model, [str(tmp_path / "a"), str(tmp_path / "b")])
    with pytest.raises(ConfigError, match=r"--set data.corpora.1.weight=0.01: data\.corpora\.1\.weight: weight 0\.01 of 1\.01 rounds to 0"):
        load_job(path, ["data.corpora.1.weight=0.01"])
    with pytest.raises(ConfigError, match=r"data.corpora is a list of 2 items; '2' is not one of its indices"):
        load_job(path, ["data.corpora.2.weight=1"])
    with pytest.raises(ConfigError, match=r"data\.corpora\.1\.name: corpus 1 and corpus 0 are both called 'a'"):
        load_job(path, [f"data.corpora.1.path={tmp_path / 'x' / 'a'}"])


def test_a_pipeline_pretrain_stage_feeds_sft():
    job = PipelineJob.model_validate({"output_dir": "o", "pretrain": {"model": {"path": "base"},
                                                                      "data": {"corpora": [{"path": "c"}]}},
                                      "sft": {}, "dpo": {}})
    assert [(s.kind, s.model.path) for s in job.stages()] == [("pretrain", "base"), ("sft", "o/pretrain/model"),
                                                              ("dpo", "o/sft/model")]
    assert isinstance(job.pretrain, PretrainJob) and job.pretrain.output_dir == "o/pretrain"


# ---- a broken corpus is refused before Ray starts ---------------------------------------------------------------

@pytest.fixture
def no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ray.init was called: the bad corpus was not caught before Ray started")

    monkeypatch.setattr(ray, "init", refuse)


def tokenizer_corpus(prefix: Path, tiny_model: Path) -> str:
    from transformers import AutoTokenizer

    size = len(AutoTokenizer.from_pretrained(tiny_model))
    with CorpusWriter(prefix, vocab_size=size) as writer:
        for i in range(20):
            writer.add([1 + i, 2, 3, 4])
    return str(prefix)


def breakages(tiny_model: Path):
    def missing_idx(prefix: Path) -> str:
        corpus_paths(prefix)[1].unlink()
        return f"{prefix}.idx: corpus file not found"

    def half_written(prefix: Path) -> str:
        bin_path = corpus_paths(prefix)[0]
        bin_path.write_bytes(bin_path.read_bytes()[:-10])
        return f"{prefix}.bin: truncated"

    def wrong_dtype(prefix: Path) -> str:
        with CorpusWriter(prefix, vocab_size=70000) as writer:  # uint32: another tokenizer's corpus
            writer.add([1, 2, 3])
            writer.add([4, 5])
        return f"{prefix}.idx: token dtype uint32, but preprocess writes uint16"

    def foreign_ids(prefix: Path) -> str:
        with CorpusWriter(prefix, vocab_size=60000) as writer:
            writer.add([1, 59000])
            writer.add([4, 5])
        return f"{prefix}.bin: token id 59000 is out of this model's vocabulary"

    return [missing_idx, half_written, wrong_dtype, foreign_ids]


@pytest.mark.parametrize("breakage", range(4))
def test_a_broken_corpus_is_refused_naming_the_file_before_any_actor_starts(breakage, write_yaml, tiny_model,
                                                                            tmp_path, capsys, no_ray):
    good = tokenizer_corpus(tmp_path / "good", tiny_model)
    bad = tmp_path / "bad"
    tokenizer_corpus(bad, tiny_model)
    expected = breakages(tiny_model)[breakage](bad)
    path = pretrain_yaml(write_yaml, tiny_model, [good, str(bad)])
    for command in (["validate", "--quiet", str(path)], ["pretrain", "--config", str(path)]):
        code = main(command)
        out = " ".join("".join(capsys.readouterr()).split())
        assert code == EXIT_BAD_CONFIG, out
        assert f"{path}:9: data.corpora.1.path: {expected}" in out, out
        assert "data.corpora.0" not in out
