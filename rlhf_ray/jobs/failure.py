"""What a failed job prints: the error that matters first, naming the actor, and every traceback in a file.

An error raised in an actor reaches the driver wrapped several times: the user's exception (a reward function's
ValueError), the actor's own wrapping (RewardFunctionError, with the sample), Ray's (the remote traceback, printed
again for each wrapping), and the driver's call stack through the trainer. Python prints all of it, ~150 lines with
the root cause in the middle. A failed job prints instead: which actor failed in which call, the final message,
the traceback of the root cause (the first exception of the chain: where it started) without Ray's frames and
column markers, and where the rest is: every traceback goes to `<output_dir>/logs/error.log`, the actor's own output
is in `<output_dir>/logs/<actor>.log`. An actor that died without raising (killed, out of memory, a crash in C++)
shows the last lines of its log instead."""

from __future__ import annotations

import contextlib
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import ray

from rlhf_ray.actors.group import ActorCallTimeout, ActorDiedError, RemoteCallError
from rlhf_ray.config import ConfigError

CHAINED = re.compile(r"\n\s*\n(?:During handling of the above exception, another exception occurred:|"
                     r"The above exception was the direct cause of the following exception:)\s*\n\s*\n")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MARKERS = re.compile(r"^\s*[\^~]+\s*$")
LOG_TAIL_LINES = 12
FRAMES_SHOWN = 8


@dataclass(frozen=True)
class Failure:
    """A job's exception, as the terminal shows it."""

    message: str
    """The last exception: `Type: text` (the one the driver caught, unwrapped from Ray's)."""
    actor: str | None = None
    """The actor that raised or died (`reward-0`), None when the driver itself failed."""
    call: str = ""
    """The actor's method that failed (`score`, `PolicyLearner.__init__`)."""
    cause: list[str] = field(default_factory=list)
    """The root cause's traceback lines, innermost frame last; empty when there is none (an actor killed)."""

    def lines(self, logs: Path | None) -> list[str]:
        where = (f"{self.actor} failed" + (f" in `{self.call}`" if self.call else "") if self.actor
                 else "the driver failed")
        out = [f"the job failed: {where}", *_indent(self.message.splitlines())]
        log = _actor_log(logs, self.actor) if logs is not None and self.actor else None
        if self.cause:
            out += [f"Traceback of the first error ({self.actor or 'driver'}, most recent call last):",
                    *_indent(self.cause)]
        elif log is not None:
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-LOG_TAIL_LINES:]
            out += [f"the last lines of {log}:", *_indent(tail)]
        if logs is not None:
            out.append(f"every traceback: {logs / 'error.log'}" + (f"; {self.actor}'s output: {log}" if log else ""))
        return out


class JobFailed(Exception):
    """A job that started has failed; `lines` are what the terminal shows (Failure.lines)."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


@contextlib.contextmanager
def failures_reported(output_dir: str | Path):
    """Inside, a job's exception becomes JobFailed, its tracebacks written to `<output_dir>/logs/error.log`."""
    try:
        yield
    except (JobFailed, ConfigError):  # a refusal found once the job reached its nodes: the config's to fix
        raise
    except Exception as exc:  # noqa: BLE001 - every failure of the job is reported the same way
        raise JobFailed(report_failure(exc, Path(output_dir))) from exc


def explain(exc: BaseException) -> Failure:
    """The actor, call, message and root-cause traceback of `exc` and the exceptions it was raised from."""
    for err in _chain(exc):
        if isinstance(err, RemoteCallError):
            text = _remote_text(err)
            cause = err.cause
            own = cause is not None and not isinstance(cause, ray.exceptions.RayError)  # the remote code's exception
            message = f"{type(cause).__name__}: {cause}" if own else _last_line(text) or str(err)
            return Failure(_headline(exc, message), err.actor, err.call, _first_traceback(text))
        if isinstance(err, ActorDiedError):
            cause = _first_traceback(_remote_text(err) or str(err))
            return Failure(_headline(exc, _without_traceback(str(err))), err.actor, err.during, cause)
        if isinstance(err, ActorCallTimeout):
            return Failure(_headline(exc, str(err)), ", ".join(n for n, _ in err.pending), _call_of(err))
    root = list(_chain(exc))[-1]
    frames = traceback.format_exception(type(root), root, root.__traceback__, chain=False)
    return Failure(f"{type(exc).__name__}: {exc}", None, "", _first_traceback("".join(frames)))


def report_failure(exc: BaseException, output_dir: Path) -> list[str]:
    """Append every traceback of `exc` to `<output_dir>/logs/error.log` and return the lines to print."""
    logs = Path(output_dir) / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / "error.log", "a") as f:
            f.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} the job failed\n")
            f.write(_ANSI.sub("", "".join(traceback.format_exception(exc))) + "\n")
    except OSError:
        logs = None
    try:
        return explain(exc).lines(logs)
    except Exception as bug:  # noqa: BLE001 - the job's own error must reach the user whatever happens here
        return [f"the job failed: {type(exc).__name__}: {exc}", f"(could not shorten it: {type(bug).__name__}: {bug})"]


def _chain(exc: BaseException):
    """`exc`, then what it was raised from (or during), outermost first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _remote_text(err: BaseException) -> str:
    """Ray's text of the remote traceback behind `err` (the exception it was raised from)."""
    for inner in _chain(err):
        if isinstance(inner, (ray.exceptions.RayTaskError, ray.exceptions.RayActorError)):
            return _ANSI.sub("", str(inner))
    return ""


def _first_traceback(text: str) -> list[str]:
    """The first exception of a printed chain (the root cause), without Ray's header, Ray's own frames and the
    column markers under the code; its last FRAMES_SHOWN frames."""
    blocks = [b for b in CHAINED.split(text) if '  File "' in b]
    if not blocks:
        return []
    lines = blocks[0].strip("\n").splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith('File "')), len(lines))
    frames: list[list[str]] = []
    tail: list[str] = []
    for line in lines[start:]:
        if _MARKERS.match(line):
            continue
        if line.lstrip().startswith('File "'):
            frames.append([line.strip()])
        elif line.startswith(" ") and frames and not tail:
            frames[-1].append("  " + line.strip())
        else:
            tail.append(line)
    frames = [f for f in frames if "/site-packages/ray/" not in f[0] and 'File "<frozen ' not in f[0]]
    frames = frames[-FRAMES_SHOWN:]
    return [line for frame in frames for line in frame] + tail


def _without_traceback(message: str) -> str:
    """Ray's message for an actor whose __init__ raised, with the traceback it holds cut down to the error's line
    (the traceback is shown on its own)."""
    lines = message.splitlines()
    at = next((i for i, line in enumerate(lines) if line.lstrip().startswith('File "')), None)
    if at is None:
        return message
    head = "\n".join(lines[:at]).split(", ray::")[0].split("\nray::")[0]
    return f"{head}\n{_last_line(message)}"


def _headline(exc: BaseException, message: str) -> str:
    """The driver's own explanation first where it added one (a learner rank that died: where a rerun resumes)."""
    own = str(exc).split("\nCause:")[0]
    if isinstance(exc, (RemoteCallError, ActorDiedError, ActorCallTimeout)) or not own or own in message:
        return message
    return f"{own}\n{message}"


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _call_of(err: ActorCallTimeout) -> str:
    found = re.search(r"answer `([^`]+)`", str(err))
    return found.group(1) if found else ""


def _indent(lines: list[str]) -> list[str]:
    return ["  " + line for line in lines]


def _actor_log(logs: Path, actor: str) -> Path | None:
    """The newest `<actor>.log` under the job's logs (a pipeline's stages each have their own folder)."""
    first = actor.split(", ")[0]
    found = sorted(logs.parent.rglob(f"logs/{first}.log"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None
