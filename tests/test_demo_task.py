"""The bundled arithmetic task: deterministic, disjoint splits, right/wrong answers, and the reward rule."""

from __future__ import annotations

import re

import pytest

from rlhf_ray.config.data import DatasetSpec
from rlhf_ray.data import demo, registry


def test_generation_is_deterministic_and_seeded():
    first, again, other = demo.load(), demo.load(), demo.load(seed=1)
    assert (first.train, first.eval, first.fingerprint) == (again.train, again.eval, again.fingerprint)
    assert first.train != other.train and first.fingerprint != other.fingerprint
    assert first.train[0].prompt == " Human: What is 41 - 18? Assistant:"  # pinned: a change must bump VERSION


def test_registered_as_demo_arithmetic_with_the_default_sizes():
    raw = registry.load_raw(DatasetSpec(name="demo/arithmetic"))
    assert raw.name == demo.NAME == "demo/arithmetic"
    assert (len(raw.train), len(raw.eval)) == (demo.TRAIN_SIZE, demo.EVAL_SIZE)
    assert raw.fingerprint == registry.fingerprint(DatasetSpec(name="demo/arithmetic"))
    assert raw.dropped == {}


def test_train_and_eval_prompts_are_disjoint_and_distinct():
    raw = demo.load()
    train, held_out = [s.prompt for s in raw.train], [s.prompt for s in raw.eval]
    assert len(set(train)) == len(train) and len(set(held_out)) == len(held_out)
    assert not set(train) & set(held_out)
    assert demo.heldout_prompts() == held_out


def test_chosen_is_always_right_and_rejected_always_wrong():
    raw = demo.load()
    for sample in raw.train + raw.eval:
        assert re.fullmatch(r" Human: What is \d{1,2} [+-] \d{1,2}\? Assistant:", sample.prompt)
        assert re.fullmatch(r" \d{1,2}", sample.chosen) and re.fullmatch(r" \d{1,2}", sample.rejected)
        assert demo.check_answer(sample.prompt, sample.chosen)
        assert not demo.check_answer(sample.prompt, sample.rejected)
        assert sample.prompt_and_chosen == sample.prompt + sample.chosen


def test_every_kind_of_mistake_shows_up():
    raw = demo.load()
    gaps = {abs(int(s.chosen) - int(s.rejected)) for s in raw.train}
    assert {1, 10} <= gaps and any(s.rejected.strip() == s.chosen.strip()[::-1] for s in raw.train)


@pytest.mark.parametrize("answer, right", [
    (" 71", True), ("71", True), ("  71 \n", True), (" 71<|endoftext|>", True), (" 71</s></s>", True),
    (" 71 <|endoftext|>\n", True), (" 70", False), (" 071", False), (" 71 Human:", False), ("", False),
    (" seventy-one", False), (" 71.0", False),
])
def test_check_answer_tolerates_whitespace_and_end_tokens_only(answer, right):
    assert demo.check_answer(" Human: What is 23 + 48? Assistant:", answer) is right


def test_check_answer_finds_the_question_in_a_decoded_prompt_and_rejects_others():
    assert demo.check_answer("<pad><pad><s> Human: What is 50 - 7? Assistant:", " 43")
    with pytest.raises(ValueError, match="not a demo/arithmetic prompt"):
        demo.check_answer(" Human: Hello? Assistant:", " 1")


def test_score_is_a_one_zero_reward_function():
    prompts = [" Human: What is 2 + 2? Assistant:", " Human: What is 9 - 3? Assistant:"]
    assert demo.score(prompts, [" 4<|endoftext|>", " 5"]) == [1.0, 0.0]
    assert demo.score([], []) == []
    with pytest.raises(ValueError, match="2 prompts but 1 answers"):
        demo.score(prompts, [" 4"])


def test_too_many_rows_for_disjoint_splits_is_refused():
    with pytest.raises(ValueError, match="distinct problems"):
        demo.load(n_train=len(demo.all_problems()), n_eval=1)
