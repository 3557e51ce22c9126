"""init-model, compare and preprocess as a user runs them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_ray.cli import EXIT_BAD_CONFIG, EXIT_OK, main
from rlhf_ray.models.tiny import TinyModelSpec


def test_init_model_builds_a_loadable_model_with_distinct_pad_and_eos(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["init-model", "--out", str(out), "--seed", "3"]) == EXIT_OK
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer("<|endoftext|>", add_special_tokens=False)["input_ids"] == [tokenizer.eos_token_id]
    text = " Human: Sort 3 1 2 0 Assistant: 0 1 2 3 — ünïcode ✓"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert model.config.hidden_size // model.config.num_attention_heads >= 32  # vLLM CPU attention needs it
    ids = tokenizer(" Human: hi Assistant:", return_tensors="pt")
    assert model.generate(**ids, max_new_tokens=3, do_sample=False).shape[1] > ids["input_ids"].shape[1]
    assert main(["init-model", "--out", str(out)]) == EXIT_BAD_CONFIG  # never overwrites silently
    assert "not empty" in capsys.readouterr().err
    assert main(["init-model", "--out", str(tmp_path / "again"), "--seed", "3"]) == EXIT_OK
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert main(["init-model", "--out", str(tmp_path / "x"), "--preset", "huge"]) == EXIT_BAD_CONFIG


def test_tiny_spec_refuses_head_dim_below_32():
    with pytest.raises(ValueError, match="head_dim 16"):
        TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=4, vocab_size=100)


def test_compare_prints_both_models_and_scores(tiny_model, tmp_path, capsys):
    result_file = tmp_path / "compare.json"
    code = main(["compare", "--base", str(tiny_model), "--finetuned", str(tiny_model), "--prompts-from",
                 "demo/sort", "--num-prompts", "3", "--max-new-tokens", "6", "--score",
                 "rlhf_ray.data.demo_sort:score", "--json", str(result_file)])
    assert code == EXIT_OK
    result = json.loads(result_file.read_text())
    assert len(result["prompts"]) == 3 and result["base"] == result["finetuned"]  # same model, greedy
    assert set(result["base_scores"]) <= {0.0, 1.0}
    printed = capsys.readouterr().out  # not a terminal: a block of lines per prompt, no table
    assert "mean score" in printed and printed.count("\nprompt: ") == 3
    first = result["prompts"][0]
    assert f"prompt: {first}\n  base: {result['base'][0]}  [score " in printed
    assert "│" not in printed and "─" not in printed
    assert main(["compare", "--base", "a", "--finetuned", "b"]) == EXIT_BAD_CONFIG
    # a rule that reads the dataset's ground truth gets each prompt's columns, as in a reward job
    code = main(["compare", "--base", str(tiny_model), "--finetuned", str(tiny_model), "--prompts-from",
                 "demo/word-problems", "--num-prompts", "2", "--max-new-tokens", "4", "--score",
                 "rlhf_ray.data.answers:last_number_reward", "--json", str(result_file)])
    assert code == EXIT_OK and len(json.loads(result_file.read_text())["base_scores"]) == 2


def test_preprocess_command_writes_a_readable_corpus(tiny_model, tmp_path, capsys):
    from rlhf_ray.data.mmap_corpus import MMapCorpus

    text = tmp_path / "doc.txt"
    text.write_text("One sentence here. Another one follows!\n\nA second document.\n")
    prefix = tmp_path / "corpus"
    assert main(["preprocess", "--input", str(text), "--tokenizer", str(tiny_model), "--out", str(prefix),
                 "--workers", "1", "--quiet", "--max-len", "64"]) == EXIT_OK
    corpus = MMapCorpus(prefix)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    decoded = tokenizer.decode([int(t) for sample in corpus for t in sample])
    assert "One sentence here." in decoded and "A second document." in decoded


def test_every_command_of_the_parser_has_a_handler_and_every_job_kind_is_one(monkeypatch):
    """A job kind is registered in one place (config/kinds.py JOB_KINDS): the CLI's parser and dispatch follow it,
    so a kind added there is a command without editing cli.py."""
    import argparse

    from rlhf_ray import cli
    from rlhf_ray.config.jobs import SFTJob

    def commands() -> set[str]:
        (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
        return set(sub.choices)

    assert commands() == set(cli.TOOLS) | set(cli.JOB_KINDS)
    assert all(cli.command(name) for name in commands())

    class ToyJob(SFTJob):
        kind: str = "toy"

    monkeypatch.setitem(cli.JOB_KINDS, "toy", ToyJob)
    assert "toy" in commands() and cli.command("toy") is cli.cmd_job


def test_the_command_leaves_without_pythons_teardown_yet_every_line_and_its_exit_code_arrive(capsys):
    """`rlhf-ray` ends with os._exit after flushing (cli.entry): a finished job's driver was crashed at exit by a
    C++ thread of Ray or torch during Python's teardown (exit -11 after its summary; `ray job submit` then reports
    a failure). Through a pipe, as `ray job submit` reads it, the whole output and main's exit code still arrive,
    and no teardown code runs (an atexit handler stands for it)."""
    import subprocess
    import sys
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[1] / "configs/quickstart/grpo.yaml")
    assert main(["validate", config]) == EXIT_OK
    expected = capsys.readouterr().out
    program = ("import atexit, sys; from rlhf_ray import cli; atexit.register(lambda: print('TEARDOWN')); "
               "sys.argv = ['rlhf-ray', *sys.argv[1:]]; cli.entry()")
    done = subprocess.run([sys.executable, "-c", program, "validate", config], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    assert done.stdout == expected and "TEARDOWN" not in done.stdout
    refused = subprocess.run([sys.executable, "-c", program, "validate", config, "--set", "ppo.iterations=0"],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == EXIT_BAD_CONFIG and "ppo.iterations" in refused.stderr
