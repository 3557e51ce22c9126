"""The quickstart's demo task: sort four digits. " Human: Sort 6 0 4 6 Assistant:" -> " 0 4 6 6".

Why sorting: a ~0.5M-parameter model learns it as an algorithm, so it answers prompts it never saw (the held-out
split has unseen digit sequences), and a reward model learns to tell a sorted permutation of the prompt's digits
from a near miss. Arithmetic facts, by contrast, are memorised one by one at that size and do not carry over to
held-out questions (`demo/arithmetic` remains for larger models). A rule checks every answer, so PPO's gain can be
measured against ground truth, not only against the reward model.

`rlhf_ray.data.demo_sort:score` is the rule as a PPO reward function: 1.0 for the right answer, 0.0 otherwise.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence

from rlhf_ray.data.demo import strip_answer
from rlhf_ray.data.raw import RawDataset, RawSample

NAME = "demo/sort"
VERSION = 3  # 3: samples carry their ground truth as the `answer` column
LENGTH = 4
LENGTH_MISS = 0.2
"""Share of rejections with a digit dropped or repeated: without them a reward model never sees a wrong length
rejected, and PPO learns to append a fifth digit it scores highly (docs/jobs.md, "What to expect on the demo task")."""
TRAIN_SIZE = 3000
EVAL_SIZE = 300
SEED = 0

_PROMPT = re.compile(r"Sort((?: \d)+)(?!\d)")
"""The digits of a prompt, in DeepSpeed-Chat's strings or rendered by a chat template (" Sort 3 1 2<|im_end|>")."""


def prompt_of(digits: Sequence[int]) -> str:
    return " Human: Sort " + " ".join(map(str, digits)) + " Assistant:"


def answer_of(digits: Sequence[int]) -> str:
    return " " + " ".join(map(str, sorted(digits)))


def near_miss(digits: Sequence[int], rng: random.Random) -> str:
    """A wrong answer close to the right one: sorted with one digit dropped or repeated (LENGTH_MISS of them), else
    the right digits in a wrong order, or sorted with one digit changed (so a reward model must check length, order
    and content)."""
    good = sorted(digits)
    if rng.random() < LENGTH_MISS:
        bad = good[:]
        i = rng.randrange(len(bad))
        if rng.random() < 0.5:
            del bad[i]
        else:
            bad.insert(i, bad[i])
    elif len(set(good)) > 1 and rng.random() < 0.5:
        bad = good[:]
        while bad == good:
            rng.shuffle(bad)
    else:
        bad = good[:]
        i = rng.randrange(len(bad))
        bad[i] = (bad[i] + rng.choice([1, 2, 8, 9])) % 10
        bad.sort()
    return " " + " ".join(map(str, bad))


def split_sequences(seed: int = SEED, n_train: int = TRAIN_SIZE, n_eval: int = EVAL_SIZE):
    """Distinct digit sequences; eval first, then train, so no prompt is in both."""
    rng = random.Random(f"{NAME}:{seed}")
    codes = rng.sample(range(10**LENGTH), n_train + n_eval)
    seqs = [[int(c) for c in f"{code:0{LENGTH}d}"] for code in codes]
    return seqs[n_eval:], seqs[:n_eval]


def load(seed: int = SEED, n_train: int = TRAIN_SIZE, n_eval: int = EVAL_SIZE) -> RawDataset:
    train, held_out = split_sequences(seed, n_train, n_eval)
    rng = random.Random(f"{NAME}:rejected:{seed}")
    rows = lambda seqs: [RawSample(prompt_of(s), answer_of(s), near_miss(s, rng),  # noqa: E731
                                   {"answer": answer_of(s).strip()}) for s in seqs]
    key = f"{NAME}:v{VERSION}:len{LENGTH}:seed{seed}:{n_train}+{n_eval}"
    return RawDataset(name=NAME, train=rows(train), eval=rows(held_out),
                      fingerprint=hashlib.sha256(key.encode()).hexdigest())


def parse_prompt(prompt: str) -> list[int]:
    found = _PROMPT.search(prompt)
    if found is None:
        raise ValueError(f"not a demo/sort prompt: {prompt!r}")
    return [int(d) for d in found[1].split()]


def check_answer(prompt: str, answer: str) -> bool:
    """True when the answer is exactly the prompt's digits in ascending order, space separated."""
    return strip_answer(answer) == answer_of(parse_prompt(prompt)).strip()


def score(prompts: Sequence[str], answers: Sequence[str]) -> list[float]:
    """PPO reward function (`reward.function: rlhf_ray.data.demo_sort:score`)."""
    if len(prompts) != len(answers):
        raise ValueError(f"score() got {len(prompts)} prompts but {len(answers)} answers")
    return [1.0 if check_answer(p, a) else 0.0 for p, a in zip(prompts, answers)]
