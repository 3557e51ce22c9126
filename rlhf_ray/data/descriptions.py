"""`demo/descriptions`: a preference task a small reward model can learn, with a hidden truth to check it by.

The prompts ask for a description of a thing (" Human: Describe a fox. Assistant:"). The SFT demonstrations are
one short sentence each (6 to 11 words). The preferences behind the pairs are those of an annotator who wants more:
`gold(prompts, answers, topic)` is a documented, deterministic score in [0, 1], the product of four attributes:

| attribute | value |
|---|---|
| length | 1 for GOOD_WORDS[0]..GOOD_WORDS[1] words; fewer: words / GOOD_WORDS[0]; more: falls linearly to 0 at twice GOOD_WORDS[1] |
| on topic | 1 when a word of the answer starts with the topic's stem ("fox" -> "foxes"), else 0 |
| no repetition | distinct word trigrams / all word trigrams (1 below three words) |
| finished | 1 when the answer ends a sentence (. ! ?), else 0 (an answer cut at max_new_tokens does not) |

A product, not a mean: an answer off the topic, or stopped mid-sentence, is worth nothing however long it is. The
SFT model, trained on the short demonstrations, scores about 0.3: its answers are on topic, finished and too short.
The reward model never sees this function: it learns from pairs of the SFT model's answers labelled through
`label_pairs`, a Bradley-Terry draw on the gold scores (annotator noise). PPO against that reward model should
lengthen the answers into the range, and a policy pushed further pads, repeats itself or runs into max_new_tokens,
where the gold score falls while the reward model's may keep rising (reward over-optimisation, docs/jobs.md).

Held-out prompts are about topics no training prompt names, so a gain on them is not memorised. Fixed seed: the
same prompts, splits and demonstrations on every machine."""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from rlhf_ray.data.raw import RawDataset, RawSample

NAME = "demo/descriptions"
VERSION = 1
SEED = 0
GOOD_WORDS = (24, 40)
"""The answer length the gold score wants, in words, both ends included."""
EVAL_TOPICS = 40
"""Topics held out: no training prompt names them."""

CATEGORIES: dict[str, tuple[str, ...]] = {
    "animal": ("fox", "otter", "beaver", "camel", "eagle", "falcon", "goat", "hamster", "heron", "lizard", "lobster",
               "moose", "octopus", "owl", "panda", "parrot", "penguin", "rabbit", "salmon", "shark", "snail", "spider",
               "tiger", "turtle", "walrus", "whale", "wolf", "zebra", "badger", "crab"),
    "food": ("apple", "bagel", "banana", "carrot", "cheese", "cookie", "lemon", "mango", "noodle", "onion", "pancake",
             "peach", "pickle", "potato", "pretzel", "radish", "sandwich", "tomato", "waffle", "walnut"),
    "tool": ("hammer", "ladder", "shovel", "wrench", "drill", "rake", "saw", "chisel", "stapler", "compass",
             "magnet", "funnel", "kettle", "lantern", "needle", "pencil", "scissors", "broom", "bucket", "rope"),
    "place": ("harbor", "desert", "village", "island", "canyon", "library", "museum", "market", "garden", "castle",
              "bridge", "forest", "glacier", "lighthouse", "meadow", "stadium", "tunnel", "volcano", "bakery",
              "airport"),
    "instrument": ("piano", "violin", "trumpet", "drum", "flute", "guitar", "harp", "cello", "banjo", "clarinet"),
    "vehicle": ("bicycle", "canoe", "tractor", "sailboat", "helicopter", "scooter", "truck", "train", "rocket",
                "submarine"),
}
QUESTIONS = ("Describe {a} {topic}.", "Tell me about {a} {topic}.", "What is {a} {topic}?",
             "Write about {a} {topic}.", "Say something about {a} {topic}.", "Explain what {a} {topic} is.",
             "Give me a description of {a} {topic}.", "What can you tell me about {a} {topic}?",
             "I would like to know about {a} {topic}.", "Talk about {a} {topic}.")
DEMONSTRATIONS = {
    "animal": ("{A} {topic} is an animal.", "{A} {topic} is a kind of wild animal.",
               "{A} {topic} is an animal that many people like."),
    "food": ("{A} {topic} is a food.", "{A} {topic} is something people eat.",
             "{A} {topic} is a food you can find in many kitchens."),
    "tool": ("{A} {topic} is a tool.", "{A} {topic} is a tool people use at home.",
             "{A} {topic} is a useful tool for many jobs."),
    "place": ("{A} {topic} is a place.", "{A} {topic} is a place people visit.",
              "{A} {topic} is a place you can find in many countries."),
    "instrument": ("{A} {topic} is an instrument.", "{A} {topic} is a musical instrument.",
                   "{A} {topic} is an instrument that people play for music."),
    "vehicle": ("{A} {topic} is a vehicle.", "{A} {topic} is a vehicle people travel in.",
                "{A} {topic} is a vehicle that carries people from place to place."),
}
"""One short sentence per answer: on topic and finished, but under GOOD_WORDS[0] words (so SFT learns the form of
an answer, not the length the gold score wants)."""

_WORD = re.compile(r"[a-z0-9']+")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


@dataclass(frozen=True)
class Topic:
    word: str
    category: str

    def prompt(self, question: str) -> str:
        return f" Human: {question.format(a=article(self.word), topic=self.word)} Assistant:"

    def demonstration(self, template: str) -> str:
        a = article(self.word)
        return " " + template.format(A=a.capitalize(), topic=self.word)


def topics() -> list[Topic]:
    return [Topic(word, category) for category, words in CATEGORIES.items() for word in words]


def split_topics(seed: int = SEED) -> tuple[list[Topic], list[Topic]]:
    """(training topics, held-out topics): EVAL_TOPICS drawn across every category by a seeded shuffle."""
    every = topics()
    random.Random(f"{NAME}:{seed}").shuffle(every)
    return every[EVAL_TOPICS:], every[:EVAL_TOPICS]


def rows_of(topic_list: Sequence[Topic], rng: random.Random) -> list[RawSample]:
    """Every question about every topic, with a demonstration drawn for each; the topic rides along as a column
    (the gold score's argument)."""
    return [RawSample(t.prompt(q), t.demonstration(rng.choice(DEMONSTRATIONS[t.category])), None, {"topic": t.word})
            for t in topic_list for q in QUESTIONS]


def load(seed: int = SEED) -> RawDataset:
    train, held_out = split_topics(seed)
    rng = random.Random(f"{NAME}:demonstrations:{seed}")
    key = f"{NAME}:v{VERSION}:seed{seed}:{len(train)}+{len(held_out)}"
    return RawDataset(name=NAME, train=rows_of(train, rng), eval=rows_of(held_out, rng),
                      fingerprint=hashlib.sha256(key.encode()).hexdigest())


# --- the gold score --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attributes:
    """What `gold` multiplies, each in [0, 1]."""

    length: float
    on_topic: float
    distinct: float
    finished: float

    @property
    def gold(self) -> float:
        return self.length * self.on_topic * self.distinct * self.finished


def words_of(answer: str) -> list[str]:
    return _WORD.findall(answer.lower())


def length_score(n_words: int) -> float:
    low, high = GOOD_WORDS
    if n_words < low:
        return n_words / low
    if n_words <= high:
        return 1.0
    return max(0.0, 1.0 - (n_words - high) / high)


def stem(topic: str) -> str:
    """What a word must start with to name the topic: the topic less a final y or e ("pony" -> "pon", so "ponies"
    counts), else the topic."""
    return topic[:-1] if len(topic) > 3 and topic[-1] in "ye" else topic


def attributes(answer: str, topic: str) -> Attributes:
    """The gold score's parts for one answer (special tokens already removed)."""
    words = words_of(answer)
    trigrams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    root = stem(topic.lower())
    return Attributes(length=length_score(len(words)),
                      on_topic=float(any(w.startswith(root) for w in words)),
                      distinct=len(set(trigrams)) / len(trigrams) if trigrams else 1.0,
                      finished=float(bool(_SENTENCE_END.search(answer.strip()))))


def gold(prompts: Sequence[str], answers: Sequence[str], topic: Sequence[str]) -> list[float]:
    """The hidden truth, as a reward-function-shaped check (`ppo.accuracy_function:
    rlhf_ray.data.descriptions:gold`): each answer's gold score in [0, 1], from the `topic` column."""
    if not len(prompts) == len(answers) == len(topic):
        raise ValueError(f"gold() got {len(prompts)} prompts, {len(answers)} answers and {len(topic)} topics")
    return [attributes(a, t).gold for a, t in zip(answers, topic)]


