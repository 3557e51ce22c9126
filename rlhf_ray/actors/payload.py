"""Results that stay in the object store: a method decorated with `by_reference` answers its caller with a
`Stored` (a reference to its result and the seconds it computed), so the driver passes tensors on without holding
them and can still tell compute time from waiting time."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Stored:
    """A role's answer to a scoring or training call whose result stays in the object store."""

    ref: Any
    """ObjectRef of the result (a tensor: log-probs, scores, values)."""
    seconds: float
    """Seconds the call computed, its write to the object store included (not the time its caller waited)."""


def by_reference(method: Callable[..., Any]) -> Callable[..., Stored]:
    @functools.wraps(method)
    def wrapper(*args, **kwargs) -> Stored:
        import ray

        start = time.perf_counter()
        value = method(*args, **kwargs)
        return Stored(ray.put(value), time.perf_counter() - start)

    return wrapper
