"""User functions named in configs (`package.module:function`): loading one, and handing it dataset columns as
keyword arguments. Used by reward functions, accuracy rules, environments and the reward server alike."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable


class RewardFunctionError(RuntimeError):
    """A user function raised, returned something unusable, or needs a column the samples lack; the message shows
    the sample or the columns."""


def load_function(path: str) -> Callable:
    """`package.module:function` -> the function, with an error that says which part was not found."""
    module_name, _, name = path.partition(":")
    if not name:
        raise ValueError(f"expected 'package.module:function', got {path!r}")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {path!r}: {exc}") from None


def column_arguments(function, columns: list[dict]) -> dict[str, list]:
    """The columns `function` takes as keyword arguments (all of them when it has **kwargs), one value per answer.
    A required parameter no sample carries is a RewardFunctionError naming the function and the columns there are."""
    params = list(inspect.signature(function).parameters.values())[2:]  # after (prompts, answers)
    names = set().union(*(c.keys() for c in columns)) if columns else set()
    wants_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    missing = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
               and p.default is inspect.Parameter.empty and p.name not in names]
    if missing:
        raise RewardFunctionError(f"reward function {getattr(function, '__qualname__', function)} needs the dataset "
                                  f"column(s) {missing}, but the samples carry {sorted(names) or 'none'}; give the "
                                  f"dataset those columns (format.columns) or use another function")
    chosen = names if wants_all else names & named
    return {name: [c.get(name) for c in columns] for name in sorted(chosen)}
