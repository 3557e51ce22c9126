"""`rlhf-ray sample` (rlhf_ray/jobs/teacher_answers.py) on the tiny model with the hf engine: a PPO config's
training prompts answered by a model, on the config's cluster (here the session's shared embedded Ray), and
written as a dataset an SFT job reads back with the same prompt ids the PPO job samples from. The refusals start
nothing."""

from __future__ import annotations

import json

import pytest

from rlhf_ray.cli import EXIT_BAD_CONFIG, EXIT_OK, main
from rlhf_ray.config import load_job
from rlhf_ray.config.data import DataSpec
from rlhf_ray.data.build import build_phase_data
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.config.pipeline_job import ANSWERS_FORMAT
from rlhf_ray.jobs.teacher_answers import job_and_model, sample_answers
from rlhf_ray.models.loading import load_tokenizer
from tests.conftest import ROOT

GRPO = ROOT / "configs/quickstart/grpo.yaml"


def grpo_on(model, tmp_path, *more):
    return ["--set", "policy.model.gguf_file=null", "--set", f"policy.model.path={model}",
            "--set", "generation.engine=hf", "--set", f"output_dir={tmp_path / 'grpo'}",
            "--set", "cluster.dashboard=false", *more]


def printed(capsys) -> str:
    captured = capsys.readouterr()
    return " ".join((captured.out + captured.err).split())  # rich wraps long lines


@pytest.mark.system
def test_the_answers_train_an_sft_job_on_the_prompts_ppo_samples_and_unfinished_ones_are_kept_only_if_asked(tiny_model, tmp_path, capsys, monkeypatch,
                                                                       shared_ray):
    out = tmp_path / "answers.jsonl"
    monkeypatch.setattr("rlhf_ray.jobs.teacher_answers.CHUNK", 4)  # two engine calls: the second's answers keep their prompts
    code = main(["sample", str(GRPO), *grpo_on(tiny_model, tmp_path), "--model", str(tiny_model), "--out", str(out),
                 "--prompts", "6", "--keep-unfinished"])
    said = printed(capsys)
    assert code == EXIT_OK
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 * 4  # generation.sampling.n_samples_per_prompt answers per prompt
    assert f"24 answers ({sum(r['tokens'] for r in rows):,} tokens) of {tiny_model} to 6 prompts" in said
    assert '"format": {"prompt_field": "prompt", "chosen_field": "answer", "template": "raw"}' in said

    job = load_job(GRPO, [a for a in grpo_on(tiny_model, tmp_path) if a != "--set"])
    tokenizer = load_tokenizer(job.policy.model)
    tokens = TokenConventions.from_tokenizer(tokenizer, str(tiny_model))
    ppo = build_phase_data(job.data, tokenizer, "ppo", job.seed, tmp_path / "cache", tokens=tokens)
    by_prompt = {r["prompt"]: r for r in ppo.train}
    assert len({r["prompt"] for r in rows}) == 6 and all(r["prompt"] in by_prompt for r in rows)
    for r in rows:  # each answer carries its prompt's ground truth
        assert r["columns"] == by_prompt[r["prompt"]]["columns"] and set(r["columns"]) == {"answer"}

    spec = DataSpec(datasets=[{"name": "custom", "path": str(out), "format": ANSWERS_FORMAT}], split="1,0,0",
                    max_seq_len=512)
    sft = build_phase_data(spec, tokenizer, "sft", job.seed, tmp_path / "cache")
    assert len(sft.train) + len(sft.eval) == len(rows)  # (the split step holds one back for evaluation)
    for row in sft.train + sft.eval:  # SFT reads back the very prompt ids PPO samples from, and trains on the answer alone
        answer_start = next(i for i, label in enumerate(row["labels"]) if label != -100)
        prompt_ids = row["input_ids"][:answer_start]
        (source,) = [r for r in ppo.train if r["prompt_ids"] == prompt_ids]
        written = [r for r in rows if r["prompt"] == source["prompt"]]
        assert tokenizer.decode(row["input_ids"][answer_start:]) in {
            r["answer"] if r["finished"] else r["answer"] + tokenizer.eos_token for r in written}

    # without --keep-unfinished the same sample (same seed: the same answers) less those cut at max_new_tokens
    ppo_job, model = job_and_model(job, str(tiny_model))
    dropped = sample_answers(ppo_job, model, tmp_path / "finished.jsonl", prompts=6)
    finished = [json.loads(line) for line in (tmp_path / "finished.jsonl").read_text().splitlines()]
    cut = sum(not r["finished"] for r in rows)
    assert cut > 0  # the random model rambles on
    assert (dropped.kept, dropped.unfinished) == (24 - cut, cut) and finished == [r for r in rows if r["finished"]]


def test_sampling_needs_a_model_of_the_policys_tokenizer(tiny_model, tmp_path, capsys):
    code = main(["sample", str(GRPO), *grpo_on(tiny_model, tmp_path), "--out", str(tmp_path / "a.jsonl")])
    assert code == EXIT_BAD_CONFIG and "which model answers? give --model PATH" in printed(capsys)
    code = main(["sample", str(GRPO), *grpo_on(tiny_model, tmp_path), "--model", str(tmp_path / "nothing"),
                 "--out", str(tmp_path / "a.jsonl")])
    assert code == EXIT_BAD_CONFIG and f"no model folder at {tmp_path / 'nothing'}" in printed(capsys)
    code = main(["sample", str(ROOT / "configs/quickstart/sft.yaml"), "--model", str(tiny_model),
                 "--out", str(tmp_path / "a.jsonl")])
    assert code == EXIT_BAD_CONFIG and "this is a sft config" in printed(capsys)
    assert not (tmp_path / "a.jsonl").exists()


def test_a_model_of_another_tokenizer_is_refused_naming_both(tiny_model, tmp_path, capsys):
    from rlhf_ray.models.families import build_family_model

    other = build_family_model("qwen2", tmp_path / "qwen2")
    code = main(["sample", str(GRPO), *grpo_on(tiny_model, tmp_path), "--model", str(other),
                 "--out", str(tmp_path / "a.jsonl")])
    assert code == EXIT_BAD_CONFIG
    assert f"the model at {other} and the policy at {tiny_model} have different tokenizers" in printed(capsys)


def sorted_share(prompts, answers, answer):
    """A graded gold score for demo/sort answers: the share of the right digits in the right places."""
    from rlhf_ray.data.demo import strip_answer

    scores = []
    for text, right in zip(answers, answer):
        got, want = strip_answer(text).split(), right.split()
        scores.append(sum(a == b for a, b in zip(got, want)) / len(want) - 0.01 * abs(len(got) - len(want)))
    return scores


@pytest.mark.system
def test_a_pipeline_labels_pairs_of_the_sft_models_answers_and_its_rm_stage_trains_on_them(sft_model, tmp_path,
                                                                                            shared_ray):
    """The pipeline's `pairs` step on the tiny SFT model: two answers to each of 16 + 4 PPO training prompts, each
    scored by the gold function, labelled by a Bradley-Terry draw, written as train/eval pairs that the rm stage's
    data reads (its held-out pairs: its eval split); written once and reused."""
    from rlhf_ray.jobs.pipeline import preference_pairs

    import yaml

    config = yaml.safe_load((ROOT / "configs/quickstart/pipeline.yaml").read_text())
    del config["rm"]["data"]["datasets"], config["rm"]["data"]["split"]  # it reads the pairs, all of them
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    job = load_job(tmp_path / "pipeline.yaml", [
        f"output_dir={tmp_path}", f"sft.output_dir={sft_model.parent}", "ppo.generation.engine=hf",
        "pairs.gold_function=tests.test_sample:sorted_share", "pairs.prompts=16", "pairs.eval_prompts=4",
        "pairs.temperature=0.05", "cluster.dashboard=false", "logging.progress=false"])
    made = preference_pairs(job, sample=True)
    folder = tmp_path / "rm" / "pairs"
    rows = {split: [json.loads(line) for line in (folder / f"{split}.jsonl").read_text().splitlines()]
            for split in ("train", "eval")}
    assert (made.train, made.eval) == (len(rows["train"]), len(rows["eval"])) and not made.reused
    # how many of the 20 pairs tie depends on the CPU's arithmetic (10 on an Intel Xeon with AMX, fewer on an AMD
    # EPYC): every pair is accounted for, and both splits have some
    assert made.train + made.eval + made.ties == 20 and made.train >= 1 and made.eval >= 1
    assert not {r["prompt"] for r in rows["train"]} & {r["prompt"] for r in rows["eval"]}
    for row in rows["train"] + rows["eval"]:  # each label's gold scores are the function's, on the answer's text
        assert row["chosen"] != row["rejected"] and row["gold_chosen"] != row["gold_rejected"]
        golds = sorted_share([row["prompt"]] * 2, [row["chosen"], row["rejected"]], [row["columns"]["answer"]] * 2)
        assert golds == pytest.approx([row["gold_chosen"], row["gold_rejected"]], abs=0.011)  # less the stop token
    ceiling = sum(r["gold_chosen"] > r["gold_rejected"] for r in rows["eval"]) / len(rows["eval"])
    assert made.gold_eval_accuracy == pytest.approx(ceiling, abs=1e-4)
    again = preference_pairs(job, sample=False)  # kept: not sampled again
    assert again.reused and (again.train, again.eval, again.ties) == (made.train, made.eval, made.ties)
    tokenizer = load_tokenizer(job.ppo.policy.model.model_copy(update={"path": str(sft_model)}))
    rm_data = build_phase_data(job.rm.data, tokenizer, "rm", job.seed, tmp_path / "cache")  # what the rm stage reads
    assert (len(rm_data.train), len(rm_data.eval)) == (made.train, made.eval)  # train.jsonl to train, eval.jsonl to check
