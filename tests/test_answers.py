"""Answer checkers for verifiable tasks (golden cases, tricky strings) and reward functions that take the dataset's
ground truth as a keyword argument."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rlhf_ray.functions import RewardFunctionError, column_arguments
from rlhf_ray.data.answers import (boxed, boxed_reward, exact_match_reward, first_line_number_reward, last_number,
                                   last_number_reward, normalize, same_answer)


@pytest.mark.parametrize("text,value", [
    ("59 + 63 = 122.", 122), ("It costs $1,200.50 in total", Fraction(2401, 2)), ("\u22125 degrees", -5),
    ("first 3, then 4, so 7", 7), ("x2 is 7", 7), ("version 3.10.2", None), ("no digits", None),
    ("3/4 of it", Fraction(3, 4)), ("answer: 0.25.", Fraction(1, 4)), ("1,234,567 items", 1234567),
    ("+8", 8), ("12%", 12),
])
def test_last_number(text, value):
    assert last_number(text) == value


@pytest.mark.parametrize("text,content", [
    (r"so \boxed{\frac{1}{2}} and", r"\frac{1}{2}"), (r"\boxed{12} then \boxed{13}", "13"),
    (r"\fbox{x}", "x"), (r"\boxed{12", None), ("no box", None), (r"\boxed{}", ""),
])
def test_boxed(text, content):
    assert boxed(text) == content


def test_normalisation_and_equal_answers():
    assert normalize('  The Answer: Paris. ') == "the answer: paris" and normalize(' "Paris". ') == "paris"
    assert normalize(r"\text{Paris}") == "paris"
    assert same_answer("3.50", "3.5") and same_answer("1,000", "1000") and same_answer("$12", "12")
    assert same_answer("1/2", "0.5") and not same_answer("0.333", "1/3") and not same_answer("12", "21")


def test_reward_functions_compare_with_the_ground_truth_column():
    answers = ["so 59 + 63 = 122.", "it is 121", r"\boxed{122}", "122"]
    truth = ["122"] * 4
    assert last_number_reward([], answers, answer=truth) == [1.0, 0.0, 1.0, 1.0]
    assert boxed_reward([], answers, answer=truth) == [0.0, 0.0, 1.0, 0.0]
    assert exact_match_reward([], answers, answer=truth) == [0.0, 0.0, 0.0, 1.0]
    assert last_number_reward([], ["7"], answer=["8"]) == [0.0]  # the same text scores by its own truth
    with pytest.raises(ValueError, match="2 answers but 1 ground-truth"):
        last_number_reward([], ["1", "2"], answer=["1"])
    # a base model answers on its first line and goes on with the next question
    rambling = [" 12 + 7 = 19\nQuestion: What is 3 + 4", "\n\n 19.\n20", " 18\n19"]
    assert first_line_number_reward([], rambling, answer=["19"] * 3) == [1.0, 1.0, 0.0]
    assert last_number_reward([], rambling, answer=["19"] * 3) == [0.0, 0.0, 1.0]


def test_columns_become_keyword_arguments_and_a_missing_one_is_named():
    def needs_answer(prompts, answers, answer):
        return [0.0] * len(answers)

    def takes_all(prompts, answers, **columns):
        return [0.0] * len(answers)

    def takes_none(prompts, answers):
        return [0.0] * len(answers)

    columns = [{"answer": "1", "level": 2}, {"answer": "5", "level": 3}]
    assert column_arguments(needs_answer, columns) == {"answer": ["1", "5"]}
    assert column_arguments(takes_all, columns) == {"answer": ["1", "5"], "level": [2, 3]}
    assert column_arguments(takes_none, columns) == {}
    with pytest.raises(RewardFunctionError, match=r"needs_answer needs the dataset column\(s\) \['answer'\], but "
                                                  r"the samples carry none"):
        column_arguments(needs_answer, [{}, {}])


def test_generated_tasks_carry_their_ground_truth():
    from rlhf_ray.data import demo, demo_sort

    sample = demo.load().train[0]
    assert sample.columns["answer"] == str(demo.parse_prompt(sample.prompt).value)
    sort = demo_sort.load().train[0]
    assert sort.columns["answer"] == " ".join(map(str, sorted(demo_sort.parse_prompt(sort.prompt))))


def test_word_problems_are_deterministic_disjoint_and_right():
    import re

    from rlhf_ray.data import word_problems
    from rlhf_ray.data.answers import last_number_reward
    from rlhf_ray.data.registry import load_raw, task_rule
    from rlhf_ray.config.data import DatasetSpec

    data = load_raw(DatasetSpec(name="demo/word-problems"))
    assert len(data.train) == word_problems.TRAIN_SIZE and len(data.eval) == word_problems.EVAL_SIZE
    assert not {s.prompt for s in data.train} & {s.prompt for s in data.eval}
    assert word_problems.load().train[:5] == data.train[:5]  # the same on every call (fixed seed)
    steps = [len(re.findall(r"Then ", s.prompt)) for s in data.train]
    assert set(steps) == {1, 2, 3}
    for s in data.train[:200]:
        # the worked answer's arithmetic holds, ends on the ground truth; the rejected one does not
        for a, op, b, result in re.findall(r"(\d+) ([-+x]) (\d+) = (\d+)", s.chosen):
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "x": int(a) * int(b)}[op] == int(result)
        assert int(s.columns["answer"]) >= 0
        assert last_number_reward([s.prompt] * 2, [s.chosen, s.rejected], answer=[s.columns["answer"]] * 2) == [1, 0]
    assert task_rule("demo/word-problems") is last_number_reward


def test_word_problems_stay_the_same_and_their_calculator_conversations_solve_them():
    """demo/word-problems' samples are pinned (a changed generator would silently change every benchmark on them);
    demo/word-problems-calculator holds the same problems in the same splits, each solved through the calculator
    environment: its first message is the environment's for that problem, its call computes the answer, and the
    environment scores its final reply 1."""
    import hashlib
    import json

    from rlhf_ray.config.data import DatasetSpec
    from rlhf_ray.data.registry import load_raw
    from rlhf_ray.envs.calculator import CalculatorEnv

    plain = load_raw(DatasetSpec(name="demo/word-problems"))
    pinned = json.dumps([(s.prompt, s.chosen, s.rejected, s.columns) for s in plain.train + plain.eval])
    assert hashlib.sha256(pinned.encode()).hexdigest().startswith("8c56d4fc9dbfaa9f")
    tools = load_raw(DatasetSpec(name="demo/word-problems-calculator"))
    assert [s.columns for s in tools.train] == [s.columns for s in plain.train]
    assert [s.columns for s in tools.eval] == [s.columns for s in plain.eval]
    for plain_sample, sample in zip(plain.eval[:50], tools.eval[:50]):
        first, call, result, final = sample.messages[:-3], *sample.messages[-3:]
        env = CalculatorEnv()
        assert list(first) == env.reset({"prompt": plain_sample.prompt, "answer": plain_sample.columns["answer"]})
        step = env.step(call["content"])
        assert step.valid_call and result == {"role": "tool", "content": step.observation}
        assert step.observation == plain_sample.columns["answer"]
        assert env.step(final["content"]).reward == 1.0


def test_step_error_pairs_slip_in_one_step_and_stay_consistent_after_it():
    """demo/word-problems-steps: demo/word-problems' prompts, chosen answers and ground truth; each rejected answer
    has exactly one wrong equation, every later equation is right on the wrong number, and its final number is its
    own last result (so only checking the steps' arithmetic separates it from the chosen one)."""
    import re

    from rlhf_ray.config.data import DatasetSpec
    from rlhf_ray.data.registry import load_raw, task_rule

    plain = load_raw(DatasetSpec(name="demo/word-problems"))
    steps = load_raw(DatasetSpec(name="demo/word-problems-steps"))
    assert [(s.prompt, s.chosen, s.columns) for s in steps.train + steps.eval] == \
        [(s.prompt, s.chosen, s.columns) for s in plain.train + plain.eval]
    for s in steps.train + steps.eval:
        equations = re.findall(r"(\d+) ([-+x]) (\d+) = (-?\d+)", s.rejected)
        wrong = [i for i, (a, op, b, c) in enumerate(equations)
                 if {"+": int(a) + int(b), "-": int(a) - int(b), "x": int(a) * int(b)}[op] != int(c)]
        assert len(wrong) == 1, s.rejected
        assert s.rejected.endswith(f"The answer is {equations[-1][3]}.") and equations[-1][3] != s.columns["answer"]
        assert min(int(n) for n in re.findall(r"-?\d+", s.rejected)) >= 0
    assert task_rule("demo/word-problems-steps") is task_rule("demo/word-problems")


def test_the_task_accuracy_rule_is_the_named_function_else_the_datasets_own():
    from rlhf_ray.config import ConfigError, load_job
    from rlhf_ray.data import demo
    from rlhf_ray.jobs.ppo.job import accuracy_rule
    from tests.conftest import ROOT

    def job(*overrides):
        return load_job(ROOT / "configs/quickstart/ppo.yaml", ["data.datasets=[{name: demo/arithmetic}]", *overrides])

    rows = [{"columns": {"answer": "71"}}]
    assert accuracy_rule(job(), rows) is demo.score  # the dataset's exact-answer rule
    named = accuracy_rule(job("ppo.accuracy_function=rlhf_ray.data.answers:last_number_reward"), rows)
    assert named is last_number_reward
    # what an instruct model writes: wrong by the exact rule, right by the last number
    prompt, answer = " Human: What is 23 + 48? Assistant:", "23 + 48 = 71"
    assert demo.score([prompt], [answer]) == [0.0] and named([prompt], [answer], answer=["71"]) == [1.0]

    with pytest.raises(ValueError, match=r"ppo.accuracy_function: .*needs the dataset column\(s\) \['answer'\]"):
        accuracy_rule(job("ppo.accuracy_function=rlhf_ray.data.answers:last_number_reward"), [{"columns": {}}])
    assert accuracy_rule(job("ppo.accuracy_function=rlhf_ray.data.answers:last_number_reward"), []) is named  # no eval
    with pytest.raises(ValueError, match=r"ppo.accuracy_function: cannot import 'rlhf_ray.data.answers:nope'"):
        accuracy_rule(job("ppo.accuracy_function=rlhf_ray.data.answers:nope"), rows)
    with pytest.raises(ConfigError, match="accuracy_function"):
        job("ppo.accuracy_function=not a path")


def test_step_credit_reads_the_problem_from_the_prompt_and_credits_right_steps_in_order():
    """rlhf_ray.data.word_problems:step_credit_reward: a right final number scores 1 as the last-number rule does; a
    wrong one earns STEP_CREDIT in proportion to the worked solution's intermediate results it writes after an `=`,
    in order; the problem is read back from the prompt (plain or chat-rendered) for every generated problem."""
    from rlhf_ray.data import word_problems as wp

    train, held_out = wp.problems()
    assert all(wp.question_ops(p.prompt) == (p.start, p.ops) for p in train + held_out)
    three = next(p for p in train if [k for k, _, _ in p.ops] == ["buy", "packs", "give"])
    results = wp.step_results(three.start, three.ops)
    assert len(results) == 4 and results[-1] == three.value  # buy: 1 result, packs: product and sum, give: 1
    chat = f"<|im_start|>user\n{three.prompt.removeprefix(' Human: ').removesuffix(' Assistant:')}<|im_end|>\n"
    first, product, total = results[:3]
    answers = [three.solution(),                                            # right: 1
               three.solution(three.value + 1),                             # every step right, last number wrong
               f"= {first}. = {product}, = {total + 1}. The answer is 0.",  # two of three intermediate results
               f"= {total} and = {first}. The answer is 0.",                # out of order: only one counts
               "I do not know."]
    scores = wp.step_credit_reward([chat] * 5, answers, [str(three.value)] * 5)
    assert scores == [1.0, wp.STEP_CREDIT, wp.STEP_CREDIT * 2 / 3, wp.STEP_CREDIT / 3, 0.0]
    one = next(p for p in train if len(p.ops) == 1)  # nothing between the question and the answer: 1 or 0
    assert wp.step_credit_reward([one.prompt] * 2, [one.solution(), one.solution(one.value + 1)],
                                 [str(one.value)] * 2) == [1.0, 0.0]
    assert wp.step_credit_reward(["no problem here"], ["= 3"], ["4"]) == [0.0]  # no problem read: the plain rule
    with pytest.raises(ValueError, match="1 prompts, 2 answers and 1 ground-truth values"):
        wp.step_credit_reward(["p"], ["a", "b"], ["1"])
