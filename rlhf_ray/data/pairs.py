"""Preference pairs from a model's own answers, labelled by a gold score through a Bradley-Terry draw: what a
human annotator does in InstructGPT's step 2, with a known truth behind the labels (`rlhf_ray.data.descriptions`
documents one). Two answers to one prompt make one pair; the annotator prefers answer a with probability
sigmoid((gold(a) - gold(b)) / temperature), so close answers are labelled almost at random and far apart ones
almost always right, as real labels are. Pure functions: the pipeline samples the answers (jobs/pipeline.py)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlhf_ray.functions import column_arguments


def preference(gold_a: float, gold_b: float, temperature: float) -> float:
    """P(an annotator prefers a to b); temperature 0: always the higher (a tie: a coin)."""
    if temperature <= 0:
        return 1.0 if gold_a > gold_b else 0.0 if gold_a < gold_b else 0.5
    return 1.0 / (1.0 + math.exp(-(gold_a - gold_b) / temperature))


@dataclass(frozen=True)
class LabelledPairs:
    """`rows`: one per pair, {prompt, chosen, rejected, columns, gold_chosen, gold_rejected}. `ties`: pairs left out
    because both answers have the same gold score (an annotator marks a tie; it is no preference). `ceiling`: the
    share of `rows` whose chosen answer has the higher gold score: the accuracy of the gold score itself on these
    noisy labels, the best a reward model can reach on them."""

    rows: list[dict]
    ties: int

    @property
    def ceiling(self) -> float:
        if not self.rows:
            return float("nan")
        return sum(r["gold_chosen"] > r["gold_rejected"] for r in self.rows) / len(self.rows)


def pair_up(answers: Sequence[dict]) -> list[tuple[dict, dict]]:
    """Answer rows ({prompt, answer, columns, ...}) grouped by prompt, the first two answers of each prompt as a
    pair (a prompt with one answer makes none), in the order the prompts first appear."""
    by_prompt: dict[str, list[dict]] = {}
    for row in answers:
        by_prompt.setdefault(row["prompt"], []).append(row)
    return [(rows[0], rows[1]) for rows in by_prompt.values() if len(rows) >= 2]


def label_pairs(answers: Sequence[dict], score: Callable[..., list[float]], temperature: float,
                seed: int, text: Callable[[str], str] = lambda answer: answer) -> LabelledPairs:
    """Label the pairs of `answers` (see `pair_up`): `score(prompts, answers, **columns)` is the gold score, called
    on `text(answer)` (e.g. the answer without its stop token); the label is drawn from `preference` with a
    generator seeded by `seed`, so the same answers get the same labels."""
    pairs = pair_up(answers)
    flat = [row for pair in pairs for row in pair]
    texts = [text(r["answer"]) for r in flat]
    columns = column_arguments(score, [r.get("columns", {}) for r in flat])
    golds = [float(g) for g in score([r["prompt"] for r in flat], texts, **columns)]
    rng = random.Random(seed)
    rows, ties = [], 0
    for i, (a, b) in enumerate(pairs):
        gold_a, gold_b = golds[2 * i], golds[2 * i + 1]
        if gold_a == gold_b:
            ties += 1
            continue
        a_wins = rng.random() < preference(gold_a, gold_b, temperature)
        (chosen, gold_c), (rejected, gold_r) = ((a, gold_a), (b, gold_b)) if a_wins else ((b, gold_b), (a, gold_a))
        rows.append({"prompt": a["prompt"], "chosen": chosen["answer"], "rejected": rejected["answer"],
                     "columns": a.get("columns", {}), "gold_chosen": gold_c, "gold_rejected": gold_r})
    return LabelledPairs(rows, ties)
