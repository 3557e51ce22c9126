"""The data of a continued-pretraining job: mmap corpora (written by `rlhf-ray preprocess`) mixed by weight."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Annotated

from pydantic import Field, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel
from rlhf_ray.config.paths import PathField


class CorpusSpec(StrictModel):
    """One mmap corpus: PREFIX.bin + PREFIX.idx, as `rlhf-ray preprocess --out PREFIX` writes them."""

    path: Annotated[str, PathField()]
    """The corpus prefix (without .bin / .idx)."""
    weight: float = Field(1.0, gt=0)
    """Share of every global batch, relative to the other corpora's weights: the counts per batch are
    weight / sum(weights) x global batch, rounded so they sum to the batch (each corpus needs at least one)."""
    name: str | None = None
    """Label of its metrics (eval/perplexity/NAME); default: the prefix's last component."""

    @property
    def label(self) -> str:
        return self.name or self.path.rstrip("/").rsplit("/", 1)[-1]


class PretrainDataSpec(StrictModel):
    """Corpora of a pretrain job. Each corpus is an endless sequence of epochs, each a fresh seeded permutation of its
    training samples; global batch k is computed from k alone, so a resumed run (on any number of ranks, at the same
    global batch) continues with exactly the samples an uninterrupted run would have trained on next."""

    corpora: list[CorpusSpec] = Field(min_length=1)
    """The corpora to train on, with their mixing weights."""
    heldout_fraction: float = Field(0.01, gt=0, lt=1)
    """Share of each corpus reserved for held-out perplexity, never trained on: every k-th sample, spread over the
    whole corpus (capped by heldout_max_samples)."""
    heldout_max_samples: int = Field(256, ge=1)
    """At most this many held-out samples per corpus (evaluation cost stays bounded for a large corpus)."""
    max_seq_len: int | None = Field(None, ge=8)
    """Cut longer samples to this many tokens (the cut part is not trained on). Unset: samples are used as
    preprocess wrote them (at most its --max-len)."""

    @model_validator(mode="after")
    def _distinct_labels(self) -> "PretrainDataSpec":
        seen: dict[str, int] = {}
        for i, corpus in enumerate(self.corpora):
            if corpus.label in seen:
                raise FieldProblem(f"corpora.{i}.name", f"corpus {i} and corpus {seen[corpus.label]} are both called "
                                   f"{corpus.label!r}: give one of them a name")
            seen[corpus.label] = i
        return self


def batch_counts(weights: Sequence[float], global_batch_size: int) -> list[int]:
    """Largest-remainder rounding: each corpus first gets ``floor(w_j / sum(w) * B)``; the seats still missing
    go one each to the corpora with the largest fractional parts (ties: the lower corpus index). Computed on
    the decimal values of the weights (``Fraction(str(w))``) so 0.1/0.2/0.7 round as written, not as binary
    floats."""
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    try:
        fracs = [Fraction(str(w)) for w in weights]
    except (ValueError, TypeError):
        raise ValueError(f"weights must be finite numbers, got {list(weights)}") from None
    if not fracs or any(f < 0 for f in fracs) or sum(fracs) == 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    quotas = [f / sum(fracs) * global_batch_size for f in fracs]
    counts = [int(q) for q in quotas]  # floor: quotas are non-negative
    order = sorted(range(len(quotas)), key=lambda j: (-(quotas[j] - counts[j]), j))
    for j in order[:global_batch_size - sum(counts)]:
        counts[j] += 1
    return counts
