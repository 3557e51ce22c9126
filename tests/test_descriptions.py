"""The preference task with a hidden truth (rlhf_ray/data/descriptions.py) and the Bradley-Terry labelling of pairs
(rlhf_ray/data/pairs.py): what the gold score rewards, that the held-out topics are unseen, that the SFT
demonstrations sit low on it, and that labels are noisy the way the temperature says and reproducible."""

from __future__ import annotations

import math
import statistics

import pytest

from rlhf_ray.config import load_job
from rlhf_ray.data import descriptions
from rlhf_ray.data.pairs import label_pairs, pair_up, preference
from rlhf_ray.data.registry import load_raw, task_rule
from rlhf_ray.config.data import DatasetSpec
from tests.conftest import ROOT

GOOD = ("A fox is a small wild animal with red fur and a bushy tail. Foxes live in forests and fields, hunt mice "
        "and rabbits at night, and raise their cubs in dens.")


def test_the_gold_score_multiplies_length_topic_repetition_and_a_finished_sentence():
    assert len(descriptions.words_of(GOOD)) in range(24, 41)
    assert descriptions.gold(["p"], [GOOD], ["fox"]) == [1.0]
    short = descriptions.attributes("A fox is an animal.", "fox")
    assert short.length == pytest.approx(5 / 24) and short.gold == pytest.approx(5 / 24)
    assert descriptions.attributes(GOOD, "otter").gold == 0.0  # off topic
    assert descriptions.attributes(GOOD.rstrip("."), "fox").gold == 0.0  # stopped mid-sentence (cut)
    assert descriptions.attributes(GOOD + "!", "fox").finished == 1.0
    padded = descriptions.attributes(GOOD + " " + GOOD, "fox")  # too long and repeating itself
    assert padded.length == pytest.approx(1 - (len(descriptions.words_of(GOOD)) * 2 - 40) / 40)
    assert padded.distinct < 0.6 and padded.gold < 0.3
    assert descriptions.attributes("Ponies are small horses.", "pony").on_topic == 1.0  # the stem, not the word
    assert descriptions.length_score(80) == 0.0 and descriptions.length_score(12) == 0.5


def test_the_task_holds_out_topics_and_its_demonstrations_score_low():
    data = load_raw(DatasetSpec(name="demo/descriptions"))
    assert (len(data.train), len(data.eval)) == (700, 400)
    train_topics = {r.columns["topic"] for r in data.train}
    eval_topics = {r.columns["topic"] for r in data.eval}
    assert len(eval_topics) == descriptions.EVAL_TOPICS and not train_topics & eval_topics
    assert not {r.prompt for r in data.train} & {r.prompt for r in data.eval}
    assert data.train[0].prompt.startswith(" Human: ") and data.train[0].prompt.endswith(" Assistant:")
    golds = descriptions.gold([r.prompt for r in data.train], [r.chosen for r in data.train],
                              [r.columns["topic"] for r in data.train])
    assert statistics.mean(golds) <= 0.4 and max(golds) < 1.0  # SFT learns the form, not the length wanted
    assert load_raw(DatasetSpec(name="demo/descriptions")).fingerprint == data.fingerprint  # the same everywhere
    assert task_rule("demo/descriptions") is descriptions.gold  # the task's own held-out check


def answers(*texts_per_prompt):
    return [{"prompt": f"p{i}", "answer": a, "columns": {"topic": "fox"}}
            for i, texts in enumerate(texts_per_prompt) for a in texts]


def test_pairs_are_two_answers_to_one_prompt_and_ties_are_left_out():
    rows = answers(("A fox.", GOOD), (GOOD, GOOD), ("A fox is red.",), (GOOD, "A fox is an animal.", "x"))
    assert [(a["prompt"], b["prompt"]) for a, b in pair_up(rows)] == [("p0", "p0"), ("p1", "p1"), ("p3", "p3")]
    labelled = label_pairs(rows, descriptions.gold, temperature=0.0, seed=0)
    assert labelled.ties == 1 and len(labelled.rows) == 2  # p1's answers are equal; p2 has one answer
    assert all(r["chosen"] == GOOD and r["gold_chosen"] == 1.0 for r in labelled.rows)  # noiseless: the better one
    assert labelled.ceiling == 1.0 and labelled.rows[0]["columns"] == {"topic": "fox"}


def test_labels_are_a_bradley_terry_draw_on_the_gold_scores_reproducible_by_seed():
    assert preference(0.6, 0.4, 0.1) == pytest.approx(1 / (1 + math.exp(-2)))
    assert preference(0.4, 0.4, 0.1) == 0.5 and preference(0.5, 0.4, 0.0) == 1.0
    # 2000 pairs whose gold scores differ by 0.1 (12 against 9.6 words): the better one is chosen ~73% of the time
    better, worse = " ".join(["fox"] + [f"w{i}" for i in range(11)]) + ".", " ".join(["fox"] + [f"w{i}" for i in range(9)]) + "."
    rows = answers(*[(better, worse)] * 2000)
    labelled = label_pairs(rows, descriptions.gold, temperature=0.1, seed=3)
    expected = preference(descriptions.gold(["p"], [better], ["fox"])[0], descriptions.gold(["p"], [worse], ["fox"])[0], 0.1)
    assert labelled.ceiling == pytest.approx(expected, abs=0.03) and 0.6 < labelled.ceiling < 0.85
    assert label_pairs(rows, descriptions.gold, 0.1, seed=3).rows == labelled.rows
    assert label_pairs(rows, descriptions.gold, 0.1, seed=4).rows != labelled.rows
    # the stop token is not part of what the gold score reads
    cut = label_pairs(answers((GOOD + "<|im_end|>", "A fox.<|im_end|>")), descriptions.gold, 0.0, 0,
                      text=lambda a: a.removesuffix("<|im_end|>"))
    assert cut.rows[0]["chosen"] == GOOD + "<|im_end|>" and cut.rows[0]["gold_chosen"] == 1.0


RECIPE = ROOT / "configs/recipes/smollm2-descriptions.yaml"


def test_the_recipe_trains_its_reward_model_on_the_labelled_pairs_and_checks_ppo_by_the_gold_score():
    job = load_job(RECIPE)
    (pairs_data,) = job.rm.data.datasets
    assert pairs_data.name == "custom" and pairs_data.path.endswith("outputs/smollm2-descriptions/rm/pairs")
    assert job.rm.data.split == "0,1,0" and pairs_data.format.rejected_field == "rejected"
    assert job.ppo.ppo.accuracy_function == job.pairs.gold_function == "rlhf_ray.data.descriptions:gold"
    assert job.ppo.reward.model.path.endswith("rm/model") and job.ppo.critic is not None  # the learned reward, GAE
    assert job.ppo.reward.function is None and job.ppo.ppo.eval_every > 0


def test_the_recipe_validates_and_its_mistakes_are_refused_at_their_line(capsys, tmp_path):
    from rlhf_ray.cli import EXIT_BAD_CONFIG, EXIT_OK, main

    def validate(*args):
        code = main(["validate", "--quiet", *args])
        captured = capsys.readouterr()
        return code, " ".join((captured.out + captured.err).split())

    assert validate(str(RECIPE))[0] == EXIT_OK  # the pairs folder the rm stage reads is written by the pipeline
    code, out = validate(str(RECIPE), "--set", "pairs.gold_function=rlhf_ray.data.descriptions:gould")
    assert code == EXIT_BAD_CONFIG and "pairs.gold_function: " in out and "gould" in out
    code, out = validate(str(RECIPE), "--set", "rm.data.split=1,1,0")
    assert code == EXIT_BAD_CONFIG and "rm.data.split '1,1,0' gives the labelled pairs to other phases too" in out
    code, out = validate(str(RECIPE), "--set", "rm.data.datasets=[{name: demo/sort}]")
    assert code == EXIT_BAD_CONFIG and "remove rm.data.datasets, or remove pairs" in out
    text = RECIPE.read_text()
    line = text.splitlines().index("pairs:") + 1
    no_rm = tmp_path / "no-rm.yaml"
    no_rm.write_text(text.split("rm:  ")[0] + "ppo:" + text.split("\nppo:")[1])
    code, out = validate(str(no_rm), "--set", "ppo.reward.function=rlhf_ray.data.descriptions:gold")
    assert code == EXIT_BAD_CONFIG and "give both an rm and a ppo section" in out and f"{no_rm}:{line}" in out
