"""The base every config model shares: unknown keys are errors, and cross-field problems name their field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A YAML section. `extra="forbid"` turns a typo'd key into an error instead of a silently ignored option."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class FieldProblem(ValueError):
    """A cross-field check failed. `path` is the dotted field the user should change, relative to the model that
    raised it; the loader joins it to the model's own location to point at the YAML line."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message
