"""Where an actor's own output goes: the library logs of every role (vLLM's, DeepSpeed's, torch's, transformers',
progress bars of weight loading) land in `<output_dir>/logs/<actor>.log`, one file per actor, instead of on the
job's terminal. A job opens `actor_logs(folder)` around its actors; every ActorGroup started inside it gives its
actors a file there, and each actor points its stdout and stderr (the file descriptors, so C and C++ output too)
at it before its __init__ runs. Output an actor's process writes before that (imports while Ray unpickles the
class) stays in Ray's worker logs (`/tmp/ray/session_latest/logs`)."""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Iterator
from pathlib import Path

_FOLDER: contextvars.ContextVar[Path | None] = contextvars.ContextVar("actor_logs", default=None)


@contextlib.contextmanager
def actor_logs(folder: Path | None) -> Iterator[None]:
    """Actors started within get a log file in `folder` (None: they keep Ray's own logs)."""
    token = _FOLDER.set(Path(folder) if folder is not None else None)
    try:
        yield
    finally:
        _FOLDER.reset(token)


def log_file(name: str) -> str | None:
    """The file actor `name` writes to, or None outside actor_logs."""
    folder = _FOLDER.get()
    return None if folder is None else str(folder / f"{name}.log")


def redirect_output(path: str) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2) appended to `path`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def logging_to_file(actor_cls: type) -> type:
    """`actor_cls` whose __init__ takes `log_file` and sends the process's output there first."""

    def __init__(self, *args, log_file: str | None = None, **kwargs):
        if log_file is not None:
            redirect_output(log_file)
        actor_cls.__init__(self, *args, **kwargs)

    return type(actor_cls.__name__, (actor_cls,), {"__init__": __init__, "__module__": actor_cls.__module__,
                                                   "__qualname__": actor_cls.__qualname__})


@contextlib.contextmanager
def ray_messages(folder: Path | None) -> Iterator[None]:
    """Ray's own messages to the driver, such as "(raylet) A worker died or was killed ...", appended to
    `<folder>/ray.log` instead of the job's terminal (None: left on the terminal). Ray prints them from a thread of
    the driver whatever `log_to_driver` says; the job tells what such a death means in its own words
    (jobs/restarts.py). The thread looks its printer up in `ray._private.worker` at every message, so replacing
    that function for the duration is enough."""
    if folder is None:
        yield
        return
    from ray._private import worker

    path, original = Path(folder) / "ray.log", worker.print_to_stdstream

    def to_file(data: dict, ignore_prefix: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.writelines(f"({data.get('pid', 'ray')}) {line}\n" for line in data.get("lines", []))

    worker.print_to_stdstream = to_file
    try:
        yield
    finally:
        worker.print_to_stdstream = original
