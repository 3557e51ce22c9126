"""Paths in a config mean the same on every node. A relative path is resolved once, when the config is validated,
against the working directory of the command that reads it (the driver's; under `ray job submit --working-dir`
that is the uploaded folder, which Ray unpacks at the same place on every node), and every actor gets the absolute
path. A field holds a path when its annotation carries a `PathField` marker."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
"""What a Hugging Face hub id looks like: `name` or `org/name`."""
PACKAGE_PREFIX = "package:"
"""`gguf_file: "package:NAME"` in a config names a model a Python package ships (models/packaged.py): not a path."""


@dataclass(frozen=True)
class PathField:
    """Marks a config field (`Annotated[str | None, PathField("local")]`) as a path. `local`: a file or folder;
    `hub_or_local`: a hub id unless it names something here or cannot be one; `gguf`: a GGUF file, relative to the
    model's `path` when that is set, or a packaged one. On a list field every item is a path."""

    kind: Literal["local", "hub_or_local", "gguf"] = "local"


def looks_local(path: str, base: Path) -> bool:
    """A model or tokenizer reference that is a path, not a hub id: it exists here, starts like a path, has more
    parts than `org/name`, or its first part is a folder here."""
    return (path.startswith((".", "/", "~")) or path.count("/") > 1 or not HUB_ID.match(path)
            or (base / path).exists() or ("/" in path and (base / path.split("/")[0]).is_dir()))


def absolute(path: str, base: Path) -> str:
    return os.path.normpath(base / os.path.expanduser(path))


def _resolved(kind: str, value: str, base: Path, model: BaseModel) -> str:
    if kind == "gguf" and (value.startswith(PACKAGE_PREFIX) or getattr(model, "path", None)):
        return value  # packaged, or relative to the (resolved) model path
    if kind == "hub_or_local" and not looks_local(value, base):
        return value
    return absolute(value, base)


def with_absolute_paths(model: BaseModel, base: Path | None = None) -> BaseModel:
    """`model` with every relative path field (and those of its sections) made absolute against `base` (the
    working directory); unchanged sections are shared, not copied."""
    base = Path.cwd() if base is None else base
    updates = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        marker = next((m for m in field.metadata if isinstance(m, PathField)), None)
        if marker is not None and value is not None:
            new = ([_resolved(marker.kind, v, base, model) for v in value] if isinstance(value, list)
                   else _resolved(marker.kind, value, base, model))
        elif isinstance(value, BaseModel):
            new = with_absolute_paths(value, base)
        elif isinstance(value, list) and any(isinstance(v, BaseModel) for v in value):
            new = [with_absolute_paths(v, base) if isinstance(v, BaseModel) else v for v in value]
        else:
            continue
        if new != value:
            updates[name] = new
    return model.model_copy(update=updates) if updates else model
