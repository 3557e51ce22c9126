"""A role's replicas as one object: N named Ray actors on their placement-group bundles, called together.

Every wait has a deadline, and every failure names the actor (`policy-1`), because "a ZeRO collective hung" is
only debuggable when the error says which rank never answered.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_ray.actors.actor_logs import log_file, logging_to_file
from rlhf_ray.actors.payload import answer_of, with_value

log = logging.getLogger(__name__)


_JOB: contextvars.ContextVar[str] = contextvars.ContextVar("job_tag", default="")


def job_tag(kind: str, output_dir: str) -> str:
    """A name for one run of a job, unique on the cluster and readable on the dashboard: its kind, its output
    folder's name and a random suffix (`sft-quickstart-sft-3f9a2c`)."""
    folder = re.sub(r"[^A-Za-z0-9_.-]+", "-", os.path.basename(os.path.normpath(output_dir))).strip("-.")
    return f"{kind}-{folder or 'run'}-{uuid.uuid4().hex[:6]}"


@contextlib.contextmanager
def job_names(tag: str) -> Iterator[str]:
    """Within the block, the Ray names of the actors and placement groups a job creates start with `tag/`
    (`sft-quickstart-sft-3f9a2c/learner-0`), so two jobs on one cluster never meet: none waits on, adopts or kills
    the other's actors. Inside the job, messages keep the short names (`learner-0`)."""
    token = _JOB.set(tag)
    try:
        yield tag
    finally:
        _JOB.reset(token)


def ray_name(name: str) -> str:
    """The cluster-wide name of the running job's actor or placement group `name`."""
    tag = _JOB.get()
    return f"{tag}/{name}" if tag else name


class ActorCallTimeout(RuntimeError):
    """Some actors did not answer in time. Their calls are NOT cancelled: `pending` holds (name, ref) pairs."""

    def __init__(self, message: str, pending: list[tuple[str, Any]]):
        super().__init__(message)
        self.pending = pending


class ActorDiedError(RuntimeError):
    """An actor process is gone (killed, OOM, crashed, failed in __init__); the message carries Ray's cause.
    `during` is the call it died in (`PolicyLearner.__init__` for an actor that never started)."""

    def __init__(self, message: str, actor: str, during: str = ""):
        super().__init__(message)
        self.actor = actor
        self.during = during


class RemoteCallError(RuntimeError):
    """The remote method `call` raised. `cause` is the original exception (its type survives for `isinstance`)."""

    def __init__(self, message: str, actor: str, cause: BaseException | None, call: str = ""):
        super().__init__(message)
        self.actor = actor
        self.cause = cause
        self.call = call


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TASK_IP = re.compile(r"\bip=([0-9A-Fa-f.:]+)")


def _raise_for(name: str, what: str, err: Exception) -> None:
    if isinstance(err, ray.exceptions.RayActorError):
        raise ActorDiedError(f"{name} died during `{what}`: {_ANSI.sub('', str(err))}", name, what) from err
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None)
        ip = _TASK_IP.search(str(err))  # Ray's header `ray::Cls.method() (pid=.., ip=..)`; the dual class drops .ip
        node = f" on node {ip.group(1)}" if ip else ""  # which host's files, memory, devices
        raise RemoteCallError(f"{name} raised in `{what}`{node}:\n{_ANSI.sub('', str(err))}", name, cause,
                              what) from err
    raise RemoteCallError(f"{name} failed in `{what}`: {type(err).__name__}: {err}", name, err, what) from err


def gather(refs: Sequence[Any], names: Sequence[str], timeout_s: float, what: str) -> list:
    """Results of `refs` in order. Fails fast on the first actor that died or raised, and after `timeout_s`
    names every actor still silent; nothing is cancelled behind the caller's back."""
    if len(refs) != len(names):
        raise ValueError(f"gather got {len(refs)} refs but {len(names)} names")
    calls, refs = refs, [answer_of(call) for call in refs]  # a call with a value: its record answers (payload.py)
    who = {ref: name for ref, name in zip(refs, names)}
    results: dict[Any, Any] = {}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in done:
            try:
                results[ref] = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - every Ray failure becomes one naming the actor
                _raise_for(who[ref], what, err)
    if pending:
        late = [who[r] for r in pending]
        answered = len(refs) - len(late)
        raise ActorCallTimeout(
            f"{', '.join(late)} did not answer `{what}` within {timeout_s:g} s ({answered} of {len(refs)} "
            "answered). The call was not cancelled: it keeps running, and later calls to the same actor queue "
            "behind it; kill the group (or ray.cancel the refs in .pending) to recover.",
            [(who[r], r) for r in pending],
        )
    return [with_value(results[r], call) for r, call in zip(refs, calls)]


@dataclass(frozen=True)
class Slots:
    """Where each actor of a group goes and what it is given: Ray's resources, the placement group and each rank's
    bundle in it (none: anywhere Ray finds room), environment variables and any other Ray options (e.g. a node
    affinity)."""

    num_cpus: float = 1
    num_gpus: float = 0
    placement_group: Any = None
    bundle_indices: Sequence[int] | None = None
    """Rank i's bundle; with a placement group and none given, rank i takes bundle i."""
    env_vars: dict[str, str] | None = None
    ray_options: dict | None = None

    @classmethod
    def of(cls, placement, placement_group: Any = None, bundle_indices: Sequence[int] | None = None,
           env_vars: dict[str, str] | None = None) -> "Slots":
        """A role's slots from its PlacementSpec (CPUs and GPUs per replica)."""
        return cls(placement.num_cpus, placement.num_gpus, placement_group, bundle_indices, env_vars)

    def for_replicas(self, role: str, replicas: int) -> "Slots":
        """These slots, checked against `replicas` and with every rank's bundle named."""
        if self.placement_group is None:
            if self.bundle_indices is not None:
                raise ValueError(f"{role}: bundle_indices given without a placement_group")
            return self
        bundles = list(range(replicas)) if self.bundle_indices is None else list(self.bundle_indices)
        if len(bundles) != replicas:
            raise ValueError(f"{role}: {replicas} replicas but {len(bundles)} bundle indices")
        return dataclasses.replace(self, bundle_indices=bundles)


@dataclass(frozen=True)
class Timeouts:
    """How long a group's actors may take to start and to answer a call (cluster.startup_timeout_s and
    cluster.call_timeout_s in a job) before they are reported by name."""

    call_s: float = 1800
    start_s: float = 300

    @classmethod
    def of(cls, cluster) -> "Timeouts":
        """A job's: its ClusterSpec's call_timeout_s and startup_timeout_s."""
        return cls(cluster.call_timeout_s, cluster.startup_timeout_s)


@dataclass(frozen=True)
class Thread:
    """Methods that run in a thread of their own (a Ray concurrency group), `at_once` calls at a time, beside the
    actor's other calls."""

    methods: tuple[str, ...]
    at_once: int = 1


class ActorGroup:
    """`replicas` actors of one class, named `{role}-{rank}`, replica i on bundle `bundle_indices[i]`.

    Contract for `actor_cls`: a plain class whose `__init__` accepts the keyword arguments `rank` and
    `world_size` (besides `args`/`kwargs`), so every role knows its place in the group without a setup call.
    """

    def __init__(self, actor_cls: type, role: str, replicas: int, slots: Slots = Slots(), *, args: tuple = (),
                 kwargs: dict | None = None, timeouts: Timeouts = Timeouts(), threads: dict[str, Thread] | None = None):
        if replicas < 1:
            raise ValueError(f"{role}: replicas must be >= 1, got {replicas}")
        slots = slots.for_replicas(role, replicas)
        self.actor_cls, self.role = actor_cls, role
        self.call_timeout_s, self.start_timeout_s = timeouts.call_s, timeouts.start_s
        self.names = [f"{role}-{rank}" for rank in range(replicas)]
        self.ray_names = [ray_name(name) for name in self.names]
        """The names on the cluster (and the dashboard): the job's tag first, when it runs within job_names."""
        self.thread_of = {method: name for name, thread in (threads or {}).items() for method in thread.methods}
        """Methods that run in a thread of their own (a Ray concurrency group), beside the actor's other calls."""
        logged = logging_to_file(actor_cls)
        self._remote_cls = (ray.remote(concurrency_groups={name: t.at_once for name, t in threads.items()})(logged)
                            if threads else ray.remote(logged))
        self.log_files = [log_file(name) for name in self.names]
        """Where each actor's output goes (actors/actor_logs.py); None: Ray's worker logs."""
        self.slots, self._args, self._kwargs = slots, args, kwargs or {}
        self.places: list[tuple[Any, int | None]] = [
            (slots.placement_group, None if slots.bundle_indices is None else slots.bundle_indices[rank])
            for rank in range(replicas)]
        """Each rank's placement group and bundle (None, None: anywhere Ray finds room); ranks `add`ed later have
        groups of their own."""
        self.spawned = replicas
        """Actors ever named in this group: the next `add` is `{role}-{spawned}` (a dropped rank's name is not
        given again)."""
        self.actors: list = []
        try:
            for rank in range(replicas):
                self.actors.append(self._spawn_named(rank, self.start_timeout_s))
        except Exception:
            self.kill()
            raise

    def _spawn_named(self, rank: int, timeout: float):
        """_spawn, waiting while the name is still held by a killed predecessor (a replaced replica, or the
        actors of this job's previous attempt): Ray releases a name once it has marked the old actor dead. Other
        jobs' actors have other names (job_names)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._spawn(rank)
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _spawn(self, rank: int):
        slots = self.slots
        opts: dict[str, Any] = {"name": self.ray_names[rank], "num_cpus": slots.num_cpus, "num_gpus": slots.num_gpus,
                                **(slots.ray_options or {})}
        placement_group, bundle = self.places[rank]
        if placement_group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=True)
        if slots.env_vars:
            opts["runtime_env"] = {"env_vars": dict(slots.env_vars)}
        index = int(self.names[rank].rsplit("-", 1)[1])  # the actor's own number: its name's
        return self._remote_cls.options(**opts).remote(*self._args, rank=index, world_size=len(self.names),
                                                       log_file=self.log_files[rank], **self._kwargs)

    def add(self, placement_group: Any, bundle: int = 0, timeout: float | None = None) -> int:
        """One more actor, `{role}-{n}`, on `bundle` of a placement group of its own (an elastic pool's engine);
        returns its rank once its __init__ has finished. One that fails to start is killed and not kept."""
        name = f"{self.role}-{self.spawned}"
        self.spawned += 1
        self.names.append(name)
        self.ray_names.append(ray_name(name))
        self.log_files.append(log_file(name))
        self.places.append((placement_group, bundle))
        rank = len(self.names) - 1
        try:
            self.actors.append(self._spawn_named(rank, self.start_timeout_s if timeout is None else timeout))
            gather([self.actors[rank].__ray_ready__.remote()], [name],
                   self.start_timeout_s if timeout is None else timeout, f"{self.actor_cls.__name__}.__init__")
        except Exception:
            self.drop(rank)
            raise
        return rank

    def drop(self, rank: int) -> None:
        """Kill rank `rank` and remove it: the ranks after it move down one (an elastic pool's engine that left)."""
        if rank < len(self.actors):
            self._kill(rank)
            del self.actors[rank]
        for kept in (self.names, self.ray_names, self.log_files, self.places):
            del kept[rank]

    def replace(self, rank: int, timeout: float | None = None) -> None:
        """Start a fresh replica `rank` on the same bundle, under the same name (the old one is killed first if it
        still runs). For stateless roles: a learner rank cannot rejoin its ZeRO group this way."""
        self._kill(rank)
        timeout = self.start_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            self.actors[rank] = self._spawn_named(rank, max(deadline - time.monotonic(), 1.0))
            try:
                gather([self.actors[rank].__ray_ready__.remote()], [self.names[rank]],
                       max(deadline - time.monotonic(), 1.0), f"{self.actor_cls.__name__}.__init__")
                return
            except ActorDiedError as e:
                # Until Ray has marked a lost node dead (missed heartbeats: seconds), the bundle stays on it and a
                # replacement lands there and dies with it; once marked, the bundle moves to a live node.
                if not node_lost(e) or time.monotonic() > deadline:
                    raise
                log.warning("%s: the replacement started on the lost node too; starting it again", self.names[rank])
                self._kill(rank)  # releases its name (Ray keeps the name of an actor lost with its node)
                time.sleep(1.0)

    def _kill(self, rank: int) -> None:
        try:
            ray.kill(self.actors[rank], no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass

    def __len__(self) -> int:
        return len(self.actors)

    def __repr__(self) -> str:
        return f"ActorGroup({self.actor_cls.__name__}, {', '.join(self.names)})"

    def wait_ready(self, timeout: float | None = None) -> ActorGroup:
        """Block until every actor's __init__ finished; a failed __init__ surfaces as ActorDiedError."""
        refs = [a.__ray_ready__.remote() for a in self.actors]
        gather(refs, self.names, self.start_timeout_s if timeout is None else timeout, f"{self.actor_cls.__name__}.__init__")
        return self

    def _method(self, method: str) -> None:
        if not callable(getattr(self.actor_cls, method, None)):
            raise AttributeError(f"{self.actor_cls.__name__} (role {self.role}) has no method `{method}`")

    def bound(self, actor, method: str):
        """`actor.method`, in its own thread where the group puts it there."""
        bound = getattr(actor, method)
        return bound.options(concurrency_group=self.thread_of[method]) if method in self.thread_of else bound

    def submit(self, method: str, *args, **kwargs) -> list:
        """Start `method` on every rank and return the refs without waiting (fan-out, overlap)."""
        self._method(method)
        return [self.bound(a, method).remote(*args, **kwargs) for a in self.actors]

    def gather(self, refs: Sequence[Any], what: str, timeout: float | None = None) -> list:
        """Wait for refs from `submit` under this group's names and call timeout."""
        return gather(refs, self.names, self.call_timeout_s if timeout is None else timeout, what)

    def call(self, method: str, *args, timeout: float | None = None, **kwargs) -> list:
        """The same call on every rank (a collective); results in rank order."""
        return self.gather(self.submit(method, *args, **kwargs), method, timeout)

    def call_each(self, method: str, per_rank_args: Sequence[tuple], timeout: float | None = None) -> list:
        """Rank i gets `per_rank_args[i]` (its data shard); results in rank order."""
        self._method(method)
        if len(per_rank_args) != len(self.actors):
            raise ValueError(f"{self.role}: call_each(`{method}`) got {len(per_rank_args)} argument tuples "
                             f"for {len(self.actors)} ranks")
        refs = [self.bound(a, method).remote(*args) for a, args in zip(self.actors, per_rank_args)]
        return self.gather(refs, method, timeout)

    def kill(self) -> None:
        """Kill every actor now (no restart); pending calls on them fail with ActorDiedError."""
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead or Ray shut down: nothing left to kill
                pass


def results_lost(error: BaseException) -> bool:
    """A call failed because an input it read is gone: the object lived on a node that died, or its owner (the
    actor that `ray.put` it: an engine's rollout, a reference replica's log-probs) died with its node. Replacing the
    dead actor is not enough: the lost results must be computed again."""
    return isinstance(error, RemoteCallError) and isinstance(error.cause, ray.exceptions.ObjectLostError)


def node_lost(error: Exception) -> bool:
    """An actor death caused by its node's death (Ray's message; checked against 2.60 with Ray's multi-node
    harness, tests/test_multinode.py)."""
    text = str(error)
    return "node has died" in text or "node was terminated" in text


class RestartBudget:
    """How many stateless actors (engines, reference, reward) a job may replace before it gives up: a replica
    that keeps dying (out of memory on every start, say) must end the job, not loop."""

    def __init__(self, limit: int):
        self.limit = limit
        self.replaced: list[str] = []

    def spend(self, err: ActorDiedError | ActorCallTimeout) -> None:
        actor = err.actor if isinstance(err, ActorDiedError) else err.pending[0][0]
        if len(self.replaced) >= self.limit:
            spent = (f"already used by {', '.join(self.replaced)}" if self.replaced else "allows no replacement")
            raise ActorDiedError(f"{err} (no restarts left: cluster.max_actor_restarts={self.limit} {spent})", actor,
                                 err.during if isinstance(err, ActorDiedError) else "") from err
        self.replaced.append(actor)
        how = "died" if isinstance(err, ActorDiedError) else "hangs (no answer within cluster.call_timeout_s)"
        log.warning("%s %s; replacing it (restart %d of %d): %s", actor, how, len(self.replaced), self.limit,
                    str(err).splitlines()[0])


def resilient_gather(group: ActorGroup, method: str, per_rank_args: Sequence[tuple], refs: Sequence[Any],
                     budget: RestartBudget, after_replace=None) -> list:
    """Results of `refs` (one call of `method` per replica, started with `per_rank_args`). A replica that died, or
    that did not answer within the group's call timeout (hung: stopped, deadlocked), is replaced on its bundle (a
    hung one is killed first), `after_replace(rank)` brings it up to date (e.g. loads the current weights), and its
    call is issued again with the same arguments. The timeout counts from when the replica's turn comes."""
    results = []
    for rank, ref in enumerate(refs):
        while True:
            try:
                results.append(gather([ref], [group.names[rank]], group.call_timeout_s, method)[0])
                break
            except (ActorDiedError, ActorCallTimeout) as err:
                budget.spend(err)
                group.replace(rank)
                if after_replace is not None:
                    after_replace(rank)
                ref = group.bound(group.actors[rank], method).remote(*per_rank_args[rank])
    return results
