"""Results that stay in the object store, owned by the caller. A method that answers with a large value and a small
record of it returns both as two results of one Ray call (`ray.method(num_returns=2)`): the value stays in the
object store of the node that made it (Ray inlines one under its 100 KB limit into the reply), the record comes to
the caller, and `gather` (actors/group.py) gives the caller the record with its `ref` set to the value's ObjectRef.
The driver passes that ref on without ever holding the value.

Why not `ray.put` inside the method and return the ref: then the callee's process owns the value, and when its
node dies a reader of the ref learns it only when a connection to that node times out (up to ~2 minutes with the
link down; measured across hosts, tests/test_hosts.py). A call's own results are owned by the caller: a lost node
shows as a lost object within Ray's health check, and a small value outlives the node that made it (Ray's guide:
"Anti-pattern: Returning ray.put() ObjectRefs from a task")."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray


@dataclass
class Stored:
    """A role's answer to a scoring or training call whose result stays in the object store."""

    ref: Any
    """ObjectRef of the result (a tensor: log-probs, scores, values); set by `gather`."""
    seconds: float
    """Seconds the call computed (not its write to the object store, nor the time its caller waited)."""


def by_reference(method: Callable[..., Any]) -> Callable[..., Any]:
    """An actor method whose result stays in the object store: its caller's `gather` gets a `Stored`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs) -> tuple[Any, Stored]:
        start = time.perf_counter()
        value = method(self, *args, **kwargs)
        return value, Stored(None, time.perf_counter() - start)

    del wrapper.__wrapped__  # Ray reads num_returns from the unwrapped function
    wrapper.computes = method
    """The method itself (its value, without the record)."""
    return ray.method(num_returns=2)(wrapper)


def answer_of(call: Any) -> Any:
    """The ObjectRef that answers a call: its own, or the record's of a call with a value and a record."""
    return call[1] if isinstance(call, list) else call


def with_value(record: Any, call: Any) -> Any:
    """The record a call answered, with its `ref` set to the call's value where it has one."""
    return dataclasses.replace(record, ref=call[0]) if isinstance(call, list) else record
