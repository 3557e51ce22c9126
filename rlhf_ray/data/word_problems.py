"""`demo/word-problems`: generated arithmetic word problems for real instruct models, one to three steps with
integer answers, worded like GSM8K. Every sample carries its ground truth as the `answer` column; the chosen
answer is a worked solution ending "The answer is N.", the rejected one the same steps with a wrong result (for
reward-model pairs). The correctness rule (`rlhf_ray.data.answers:last_number_reward`) is the reward and
the accuracy metric. Fixed seed: the same problems, splits and wording on every machine; no prompt is in both
splits."""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from rlhf_ray.data.answers import last_number_reward
from rlhf_ray.data.calculator_tool import calculate, first_message, show
from rlhf_ray.data.raw import RawDataset, RawSample

NAME = "demo/word-problems"
VERSION = 1
SEED = 0
TRAIN_SIZE = 3000
EVAL_SIZE = 300
NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jonas", "Kira", "Liam")
ITEMS = ("apples", "stickers", "marbles", "pencils", "cookies", "stamps", "books", "shells")


@dataclass(frozen=True)
class WordProblem:
    question: str
    steps: tuple[str, ...]
    """One sentence per step, each ending with its intermediate result."""
    value: int
    expression: str
    """The whole computation as one calculator expression, e.g. "23 + 4 * 5 - 7"."""
    start: int = 0
    ops: tuple[tuple[str, int, int], ...] = ()
    """The steps as (kind, n, m): ("buy", n, 0) adds n, ("give", n, 0) takes n away, ("packs", packs, each) adds
    packs x each; from `start`, they give `value`."""

    @property
    def prompt(self) -> str:
        return f" Human: {self.question} Give the final answer as a number. Assistant:"

    def solution(self, value: int | None = None) -> str:
        return " " + " ".join(self.steps) + f" The answer is {self.value if value is None else value}."


def make_problem(rng: random.Random) -> WordProblem:
    """One problem of 1, 2 or 3 steps (equally likely): add, take away, multiply, in GSM8K-like sentences."""
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    start = rng.randint(5, 60)
    sentences, steps, value, expression = [f"{who} has {start} {item}."], [], start, str(start)
    ops: list[tuple[str, int, int]] = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(("buy", "give", "packs"))
        if kind == "give" and value > 2:
            n = rng.randint(2, value - 1)
            sentences.append(f"Then {who} gives {n} {item} to a friend.")
            steps.append(f"{value} - {n} = {value - n}.")
            ops.append(("give", n, 0))
            value -= n
            expression += f" - {n}"
        elif kind == "packs":
            packs, each = rng.randint(2, 6), rng.randint(2, 9)
            sentences.append(f"Then {who} buys {packs} packs of {item} with {each} {item} in each pack.")
            steps.append(f"{packs} x {each} = {packs * each}, and {value} + {packs * each} = {value + packs * each}.")
            ops.append(("packs", packs, each))
            value += packs * each
            expression += f" + {packs} * {each}"
        else:
            n = rng.randint(2, 40)
            sentences.append(f"Then {who} finds {n} more {item}.")
            steps.append(f"{value} + {n} = {value + n}.")
            ops.append(("buy", n, 0))
            value += n
            expression += f" + {n}"
    question = " ".join(sentences) + f" How many {item} does {who} have now?"
    return WordProblem(question, tuple(steps), value, expression, start, tuple(ops))


def worked_steps(start: int, ops: tuple[tuple[str, int, int], ...], slip: tuple[int, int, bool] | None = None
                 ) -> tuple[list[str], int]:
    """The solution's step sentences and final value; `slip` = (step, error, in_product) writes that step's result
    (or, for a packs step with `in_product`, its product) off by `error` and carries the wrong number through every
    later step, so the answer agrees with its own steps."""
    steps, value = [], start
    for i, (kind, n, m) in enumerate(ops):
        error, in_product = (slip[1], slip[2]) if slip is not None and slip[0] == i else (0, False)
        if kind == "give":
            steps.append(f"{value} - {n} = {value - n + error}.")
            value = value - n + error
        elif kind == "packs":
            product = n * m + (error if in_product else 0)
            steps.append(f"{n} x {m} = {product}, and {value} + {product} = {value + product + (0 if in_product else error)}.")
            value = value + product + (0 if in_product else error)
        else:
            steps.append(f"{value} + {n} = {value + n + error}.")
            value = value + n + error
    return steps, value


def wrong_value(value: int, rng: random.Random) -> int:
    return rng.choice([v for v in (value - 1, value + 1, value - 10, value + 10) if v >= 0 and v != value])


def problems(seed: int = SEED, n_train: int = TRAIN_SIZE, n_eval: int = EVAL_SIZE) -> tuple[list[WordProblem],
                                                                                            list[WordProblem]]:
    """(train, eval) problems: distinct questions, the same on every machine."""
    rng, seen, drawn = random.Random(f"{NAME}:{seed}"), set(), []
    while len(drawn) < n_train + n_eval:
        problem = make_problem(rng)
        if problem.question not in seen:
            seen.add(problem.question)
            drawn.append(problem)
    return drawn[n_eval:], drawn[:n_eval]


def load(seed: int = SEED, n_train: int = TRAIN_SIZE, n_eval: int = EVAL_SIZE) -> RawDataset:
    """The task as a RawDataset: eval first then train, the same on every machine."""
    train, held_out = problems(seed, n_train, n_eval)
    wrong = random.Random(f"{NAME}:rejected:{seed}")

    def samples(part: list[WordProblem]) -> list[RawSample]:
        return [RawSample(p.prompt, p.solution(), p.solution(wrong_value(p.value, wrong)), {"answer": str(p.value)})
                for p in part]

    key = f"{NAME}:v{VERSION}:seed{seed}:{n_train}+{n_eval}"
    return RawDataset(name=NAME, train=samples(train), eval=samples(held_out),
                      fingerprint=hashlib.sha256(key.encode()).hexdigest())


CALCULATOR_NAME = "demo/word-problems-calculator"
CALCULATOR_VERSION = 1


def calculator_conversation(problem: WordProblem) -> tuple[dict[str, str], ...]:
    """One worked tool-use episode of the calculator environment: its own first message for this problem, one
    `<calc>` call with the whole computation, the calculator's result, the final answer."""
    return (first_message(problem.prompt), {"role": "assistant", "content": f"<calc>{problem.expression}</calc>"},
            {"role": "tool", "content": show(calculate(problem.expression))},
            {"role": "assistant", "content": f"The answer is {problem.value}."})


def load_calculator(seed: int = SEED, n_train: int = TRAIN_SIZE, n_eval: int = EVAL_SIZE) -> RawDataset:
    """`demo/word-problems-calculator`: the same problems and splits as demo/word-problems, each as a conversation
    that solves it with the calculator environment (rlhf_ray.envs.calculator): SFT data that shows a model the
    tool before GRPO trains it with the environment. The held-out problems are demo/word-problems' held-out ones."""
    train, held_out = problems(seed, n_train, n_eval)

    def samples(part: list[WordProblem]) -> list[RawSample]:
        return [RawSample("", columns={"answer": str(p.value)}, messages=calculator_conversation(p)) for p in part]

    key = f"{CALCULATOR_NAME}:v{CALCULATOR_VERSION}:seed{seed}:{n_train}+{n_eval}"
    return RawDataset(name=CALCULATOR_NAME, train=samples(train), eval=samples(held_out),
                      fingerprint=hashlib.sha256(key.encode()).hexdigest())


STEPS_NAME = "demo/word-problems-steps"
STEPS_VERSION = 1


def step_slip(problem: WordProblem, rng: random.Random) -> str:
    """The worked solution with one step's arithmetic wrong (off by 1, 2 or 10, either way) and every later step and
    the final answer consistent with the wrong number: only checking the arithmetic of the steps tells it apart."""
    step = rng.randrange(len(problem.ops))
    for _ in range(20):
        slip = (step, rng.choice((-10, -2, -1, 1, 2, 10)), rng.random() < 0.5)
        steps, value = worked_steps(problem.start, problem.ops, slip)
        if min(int(n) for n in re.findall(r"-?\d+", " ".join(steps))) >= 0:
            return " " + " ".join(steps) + f" The answer is {value}."
    raise ValueError(f"no step error keeps the numbers of {problem.question!r} non-negative")


def load_steps(seed: int = SEED, n_train: int = TRAIN_SIZE, n_eval: int = EVAL_SIZE) -> RawDataset:
    """`demo/word-problems-steps`: demo/word-problems' problems and splits, with reward-model pairs whose rejected
    answer slips in one intermediate step and stays consistent after it (its final number repeats its own last
    step). A reward model trained on demo/word-problems' pairs (only the final number wrong) can tell them apart by
    consistency alone; on these it must check the steps' arithmetic. Prompts, chosen answers and `answer` columns
    are demo/word-problems' own."""
    train, held_out = problems(seed, n_train, n_eval)
    slips = random.Random(f"{STEPS_NAME}:rejected:{seed}")

    def samples(part: list[WordProblem]) -> list[RawSample]:
        return [RawSample(p.prompt, p.solution(), step_slip(p, slips), {"answer": str(p.value)}) for p in part]

    key = f"{STEPS_NAME}:v{STEPS_VERSION}:seed{seed}:{n_train}+{n_eval}"
    return RawDataset(name=STEPS_NAME, train=samples(train), eval=samples(held_out),
                      fingerprint=hashlib.sha256(key.encode()).hexdigest())


# ---- a reward with credit for right intermediate results -----------------------------------------------------------

_HAS = re.compile(r"\w+ has (\d+) \w+\.")
_THEN = re.compile(r"Then \w+ (?:finds (\d+) more \w+|gives (\d+) \w+ to a friend|buys (\d+) packs of \w+ with (\d+) "
                   r"\w+ in each pack)\.")
_RESULT = re.compile(r"=\s*(-?\d+)")
STEP_CREDIT = 0.5
"""The most a wrong final answer earns for its right intermediate results (a right one earns 1)."""


def question_ops(text: str) -> tuple[int, tuple[tuple[str, int, int], ...]] | None:
    """(start, ops) of the problem whose question `text` holds (a prompt, chat-rendered or not), read back from the
    sentences `make_problem` writes; None when the text holds no such problem."""
    start = _HAS.search(text)
    if start is None:
        return None
    ops = []
    for find, give, packs, each in _THEN.findall(text[start.end():]):
        ops.append(("buy", int(find), 0) if find else ("give", int(give), 0) if give else
                   ("packs", int(packs), int(each)))
    return int(start.group(1)), tuple(ops)


def step_results(start: int, ops: tuple[tuple[str, int, int], ...]) -> list[int]:
    """The numbers a worked solution writes after each `=`, in order (a packs step writes its product, then the sum);
    the last is the answer."""
    results = []
    for line in worked_steps(start, ops)[0]:
        results += [int(n) for n in _RESULT.findall(line)]
    return results


def step_credit_reward(prompts: list[str], answers: list[str], answer: list, **_) -> list[float]:
    """1 when the answer's last number is the ground truth (as `answers.last_number_reward`); else up to
    STEP_CREDIT for the solution's intermediate results the answer writes after an `=`, in the solution's order:
    STEP_CREDIT x (results found) / (intermediate results). A denser signal than right/wrong for problems of two or
    three steps (a one-step problem has no intermediate result: 1 or 0), read from the problem in the prompt, so
    the dataset needs no extra column. Task accuracy stays the last-number rule."""
    if not len(prompts) == len(answers) == len(answer):
        raise ValueError(f"{len(prompts)} prompts, {len(answers)} answers and {len(answer)} ground-truth values")
    scores = []
    for prompt, text, right in zip(prompts, answers, last_number_reward(prompts, answers, answer)):
        problem = question_ops(prompt)
        if right or problem is None:
            scores.append(right)
            continue
        wanted = step_results(*problem)[:-1]
        written = iter(int(n) for n in _RESULT.findall(text))
        found = sum(1 for value in wanted if any(value == w for w in written))  # in order: `written` is consumed
        scores.append(STEP_CREDIT * found / len(wanted) if wanted else 0.0)
    return scores
