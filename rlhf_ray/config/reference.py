"""Markdown reference of every YAML field, generated from the models so the docs cannot drift from the code."""

from __future__ import annotations

import inspect
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rlhf_ray.config.kinds import JOB_KINDS
from rlhf_ray.config.loader import _submodel


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`" if value not in (None, [], {}) else f"`{value}`"


def _table(model: type[BaseModel], seen: set[type[BaseModel]], sections: list[str]) -> None:
    if model in seen:
        return
    seen.add(model)
    doc = " ".join(inspect.cleandoc(model.__doc__ or "").split())
    rows = [f"### `{model.__name__}`", "", doc, "", "| key | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        kind = _type_name(field.annotation)
        if sub:
            link = f"[{sub.__name__}](#{sub.__name__.lower()})"
            kind = f"list of {link}" if "list[" in kind else link
        text = field.description or (inspect.cleandoc(sub.__doc__ or "").split("\n")[0] if sub else "")
        text = " ".join(text.split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {kind} | {_default(field)} | {text} |")
        if sub:
            nested.append(sub)
    sections.append("\n".join(rows))
    for sub in nested:
        _table(sub, seen, sections)


def render_reference() -> str:
    sections: list[str] = []
    seen: set[type[BaseModel]] = set()
    for model in JOB_KINDS.values():
        _table(model, seen, sections)
    return "\n\n".join(sections) + "\n"
