"""YAML -> validated job config, with errors that point at the file, line and field, and suggest a fix."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from rlhf_ray.config.base import FieldProblem
from rlhf_ray.config.jobs import JobBase
from rlhf_ray.config.kinds import JOB_KINDS
from rlhf_ray.config.paths import with_absolute_paths

Loc = tuple[str, ...]


class ConfigError(ValueError):
    """Bad configuration. `problems` holds one line per problem: `file:line: field: what is wrong`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))


def _positions(node: yaml.Node, loc: Loc, out: dict[Loc, int], duplicates: list[tuple[str, int, int]]) -> None:
    """Record the 1-based line of every mapping key and sequence item, by path; a key given twice in one mapping
    (YAML keeps the last one silently) is added to `duplicates` as (field, first line, second line)."""
    if isinstance(node, yaml.MappingNode):
        first_lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            child = loc + (str(key_node.value),)
            line = key_node.start_mark.line + 1
            if child[-1] in first_lines and key_node.tag != "tag:yaml.org,2002:merge":
                duplicates.append((".".join(child), first_lines[child[-1]], line))
            first_lines.setdefault(child[-1], line)
            out[child] = line
            _positions(value_node, child, out, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            child = loc + (str(i),)
            out[child] = item.start_mark.line + 1
            _positions(item, child, out, duplicates)


def parse_override(text: str) -> tuple[Loc, Any]:
    """`ppo.kl_coef=0.05` -> (("ppo", "kl_coef"), 0.05). Values are YAML, so `[1, 2]` and `true` work."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError([f"--set {text}: expected KEY=VALUE with a dotted key, e.g. --set ppo.kl_coef=0.05"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError([f"--set {text}: the value is not valid YAML ({exc})"]) from None
    return tuple(key.strip().split(".")), value


def apply_override(data: dict[str, Any], loc: Loc, value: Any, text: str) -> None:
    """Set data[loc] = value; a number indexes an existing list item (`data.corpora.1.weight=2`)."""
    node: Any = data
    for i, key in enumerate(loc):
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError([f"--set {text}: {'.'.join(loc[:i])} is a list of {len(node)} items; "
                                   f"{key!r} is not one of its indices (0 to {len(node) - 1})"])
            key = int(key)
        elif not isinstance(node, dict):
            raise ConfigError([f"--set {text}: {'.'.join(loc[:i])} is a {type(node).__name__}, not a section"])
        if i == len(loc) - 1:
            node[key] = value
        elif isinstance(node, dict) and node.get(key) is None:
            node[key] = {}
        node = node[key]


class ConfigSource:
    """A YAML document plus where each key came from (file line or --set), so errors can point back at it."""

    def __init__(self, data: dict[str, Any], origin: str, lines: dict[Loc, int] | None = None):
        self.data = data
        self.origin = origin
        self.lines = lines or {}
        self.overrides: dict[Loc, str] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> "ConfigSource":
        path = Path(path)
        if path.is_dir():
            found = sorted(p.name for p in path.glob("*.y*ml"))
            hint = f"; it holds {', '.join(found[:6])}" if found else ""
            raise ConfigError([f"{path}: is a directory, not a config file; pass one YAML file{hint}"])
        if not path.is_file():
            raise ConfigError([f"{path}: no such config file"])
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
            raise ConfigError([f"{path}:{line}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at column {column}; "
                               "save the file as UTF-8"]) from None
        try:
            node = yaml.compose(text)
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            raise ConfigError([f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}"]) from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError([f"{path}:1: the top level must be a mapping of sections, got {type(data).__name__}"])
        lines: dict[Loc, int] = {}
        duplicates: list[tuple[str, int, int]] = []
        if node is not None:
            _positions(node, (), lines, duplicates)
        if duplicates:
            raise ConfigError([f"{path}:{second}: {field}: given twice (lines {first} and {second}); YAML would keep "
                               f"only the second silently: merge them into one" for field, first, second in duplicates])
        return cls(data, str(path), lines)

    def override(self, texts: list[str]) -> "ConfigSource":
        for text in texts:
            loc, value = parse_override(text)
            apply_override(self.data, loc, value, text)
            self.overrides[loc] = text
        return self

    def where(self, loc: Loc) -> str:
        """The best source location for a field: the --set that replaced it or an ancestor, else its own line,
        else its nearest ancestor's, else the file."""
        for n in range(len(loc), 0, -1):
            if loc[:n] in self.overrides:
                return f"--set {self.overrides[loc[:n]]}"
        for n in range(len(loc), 0, -1):
            if loc[:n] in self.lines:
                return f"{self.origin}:{self.lines[loc[:n]]}"
        return self.origin


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation like `Foo | None` or `list[Foo]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def _model_at(root: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for key in loc:
        if model is None:
            return None
        if key.isdigit():
            continue
        field = model.model_fields.get(key)
        if field is None:
            return None
        model = _submodel(field.annotation)
    return model


def _describe(root: type[BaseModel], error: dict[str, Any], source: ConfigSource) -> str:
    loc: Loc = tuple(str(part) for part in error["loc"])
    message = error["msg"]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, FieldProblem):
        loc = loc + tuple(cause.path.split("."))
        message = cause.message
    elif error["type"] == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        valid = sorted(parent.model_fields) if parent else []
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"valid keys here: {', '.join(valid)}"
        message = f"unknown key; {hint}"
    elif error["type"] in {"missing"}:
        message = "required field is missing"
    elif "input" in error and error["type"] not in {"value_error", "assertion_error"}:
        message = f"{message} (got {error['input']!r})"
    field = ".".join(loc) or "(top level)"
    return f"{source.where(loc)}: {field}: {message}"


def load_job(path: str | Path, overrides: list[str] | None = None, expect: str | None = None) -> JobBase:
    """Read, override and validate a job YAML. Raises ConfigError naming every problem's file, line and field."""
    source = ConfigSource.from_file(path).override(overrides or [])
    return validate_job(source, expect)


def validate_job(source: ConfigSource, expect: str | None = None) -> JobBase:
    """The job `source` describes, its relative paths made absolute against the working directory."""
    kind = source.data.get("kind", expect)
    if kind is None:
        raise ConfigError([f"{source.where(())}: kind: missing; set kind to one of {', '.join(JOB_KINDS)}"])
    if kind not in JOB_KINDS:
        close = difflib.get_close_matches(str(kind), JOB_KINDS, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"use one of {', '.join(JOB_KINDS)}"
        raise ConfigError([f"{source.where(('kind',))}: kind: unknown job kind {kind!r}; {hint}"])
    if expect is not None and kind != expect:
        raise ConfigError([f"{source.where(('kind',))}: kind: this is a {kind} config, but the command runs "
                           f"{expect}; use `rlhf-ray {kind} --config {source.origin}`"])
    model = JOB_KINDS[kind]
    try:
        job = model.model_validate({**source.data, "kind": kind})
    except ValidationError as exc:
        raise ConfigError([_describe(model, err, source) for err in exc.errors()]) from None
    job = with_absolute_paths(job)  # every node reads the paths the driver checked (config/paths.py)
    for prefix, stage in job.named_stages().items():
        stage._origin = (source, (prefix,) if prefix else ())
    return job


def job_schema() -> dict[str, Any]:
    """JSON schema of any job YAML (a union over `kind`), generated from the models for editors."""
    union = Annotated[Union[tuple(JOB_KINDS.values())], Field(discriminator="kind")]  # type: ignore[valid-type]
    schema = TypeAdapter(union).json_schema()
    schema["title"] = "rlhf-ray job config"
    return schema

