"""The sorting demo task: deterministic, disjoint splits, rule-checked answers, near-miss rejections."""

from rlhf_ray.data import demo_sort
from rlhf_ray.data.registry import load_raw
from rlhf_ray.config.data import DatasetSpec


def test_splits_are_deterministic_and_disjoint():
    raw = demo_sort.load()
    assert (len(raw.train), len(raw.eval)) == (demo_sort.TRAIN_SIZE, demo_sort.EVAL_SIZE)
    assert raw.fingerprint == demo_sort.load().fingerprint and raw.train == demo_sort.load().train
    assert not {s.prompt for s in raw.train} & {s.prompt for s in raw.eval}
    assert load_raw(DatasetSpec(name="demo/sort")).train == raw.train


def test_chosen_is_right_and_rejected_is_wrong_by_the_rule():
    raw = demo_sort.load()
    lengths = []
    for s in raw.train + raw.eval:
        assert demo_sort.check_answer(s.prompt, s.chosen)
        assert not demo_sort.check_answer(s.prompt, s.rejected)
        lengths.append(len(s.rejected.split()))
    # a digit dropped or repeated in about LENGTH_MISS of the rejections, so a reward model learns the length too;
    # the rest have the right length, so length alone never tells most rejections apart
    assert set(lengths) == {demo_sort.LENGTH - 1, demo_sort.LENGTH, demo_sort.LENGTH + 1}
    off = sum(n != demo_sort.LENGTH for n in lengths) / len(lengths)
    assert abs(off - demo_sort.LENGTH_MISS) < 0.03


def test_check_answer_and_score():
    prompt = " Human: Sort 6 0 4 6 Assistant:"
    assert demo_sort.check_answer(prompt, " 0 4 6 6<|endoftext|>")
    assert not demo_sort.check_answer(prompt, " 0 4 6")
    assert not demo_sort.check_answer(prompt, " 0 6 4 6")
    assert demo_sort.score([prompt, prompt], [" 0 4 6 6", "0 4 6 7"]) == [1.0, 0.0]
