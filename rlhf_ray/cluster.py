"""Connect to Ray (an address, RAY_ADDRESS) or start an embedded local one, and place a ResourcePlan on it.

The embedded cluster binds every Ray listener to 127.0.0.1: Ray 2.60 otherwise binds a local cluster to the
machine's external address. Placement is checked against the nodes before anything is created, so a recipe that
cannot fit fails in a second with arithmetic instead of pending forever.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rlhf_ray import orphan_guard
from rlhf_ray.actors.group import ray_name
from rlhf_ray.config.placement import ClusterSpec
from rlhf_ray.plan import ResourcePlan

log = logging.getLogger(__name__)

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0, Ray takes 127.0.0.1 as the node's IP, so GCS, raylet, agents and workers all listen on loopback."""
DEFAULT_ENV_VARS = {"TOKENIZERS_PARALLELISM": "false"}
"""Env every actor of the job inherits (HF tokenizers' thread pool deadlocks in forked Ray workers)."""
_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


class ClusterTooSmall(RuntimeError):
    """The plan cannot fit the cluster; raised before any placement group exists."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("the cluster cannot hold this plan:\n" + "\n".join(f"  - {p}" for p in problems))


class PlacementTimeout(RuntimeError):
    """Placement groups that did not become ready in time (the cluster is busy or smaller than it says)."""


@dataclass
class ClusterHandle:
    """What a job needs to know about the Ray it runs on."""

    address: str
    started_locally: bool
    dashboard_url: str | None
    namespace: str
    env_vars: dict[str, str] = field(default_factory=dict)

    def nodes(self) -> list[dict[str, float]]:
        import ray

        return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # a container's CPU set, not the host's
    except AttributeError:
        return os.cpu_count() or 1


def _visible_gpus() -> int:
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # no torch, or a CUDA driver that cannot be queried: offer no GPU
        return 0


def local_nodes(spec: ClusterSpec) -> list[dict[str, float]]:
    """The one node an embedded local Ray would offer, computed without starting it (for `validate`)."""
    import psutil

    cpus = spec.num_cpus if spec.num_cpus is not None else _cpu_count()
    gpus = spec.num_gpus if spec.num_gpus is not None else _visible_gpus()
    node = {"CPU": float(cpus), "GPU": float(gpus), "memory": float(psutil.virtual_memory().total)}
    if gpus and _visible_gpus():
        import torch

        node["gpu_memory"] = float(torch.cuda.get_device_properties(0).total_memory)
    return [node]


def missing_local_gpus(spec: ClusterSpec) -> str | None:
    """Why an embedded local Ray could not give the GPUs `cluster.num_gpus` declares, or None when it can: Ray
    would offer them, and every process placed on one would fail at start-up."""
    visible = _visible_gpus()
    if spec.num_gpus is None or spec.num_gpus <= visible:
        return None
    return (f"{spec.num_gpus:g} GPU(s) declared, but torch sees {visible} CUDA GPU(s) on this machine, so an "
            "embedded local Ray would offer GPUs no process can use; run it on the GPU machine, connect to a "
            "cluster (cluster.address), or declare cluster.shape to plan for another one")


def _is_loopback(address: str) -> bool:
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


@contextlib.contextmanager
def _loopback_mode() -> Iterator[None]:
    """Make Ray treat 127.0.0.1 as this node's IP for the duration. Ray reads the env var at import time, so an
    already imported ray also gets its constant switched (a private attribute; checked against Ray 2.60)."""
    import ray._private.ray_constants as ray_constants

    old_env, old_const = os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_ENV] = "0"  # inherited by GCS, raylet, agents and workers
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_const
        if old_env is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = old_env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's choice)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _free_agent_port() -> Iterator[int]:
    """Give the embedded Ray's dashboard agent (the HTTP server that runs submitted jobs) a free port. Ray 2.60's
    `ray.init` always asks for 52365, so a second Ray on the machine (another job, or a killed driver's agent still
    shutting down) leaves one of them without an agent: "No available agent to submit job". `ray.init` does not
    expose the port, so its RayParams get it as a default for the duration (private API; checked against 2.60)."""
    import ray._private.parameter as parameter

    port, original = free_port(), parameter.RayParams.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        kwargs.setdefault("dashboard_agent_listen_port", port)
        original(self, *args, **kwargs)

    parameter.RayParams.__init__ = init
    try:
        yield port
    finally:
        parameter.RayParams.__init__ = original


def _job_env_vars(wanted: dict[str, str]) -> dict[str, str]:
    """Drop the keys a `ray job submit --runtime-env` already sets: Ray refuses to merge duplicate keys."""
    raw = os.environ.get(_JOB_CONFIG_ENV)
    if not raw:
        return wanted
    try:
        taken = (json.loads(raw).get("runtime_env") or {}).get("env_vars") or {}
    except (ValueError, AttributeError):
        taken = {}
    return {k: v for k, v in wanted.items() if k not in taken}


_SHARED: list[tuple[ClusterSpec, ClusterHandle]] = []
"""The embedded Ray a `shared()` block keeps open, with the spec it was started from."""
SHAPING = ("num_cpus", "num_gpus", "dashboard", "dashboard_port", "metrics_export_port", "namespace")
"""The ClusterSpec fields an embedded Ray is started with (the others are the jobs' own: timeouts, restarts)."""


@contextlib.contextmanager
def shared(spec: ClusterSpec) -> Iterator[ClusterHandle]:
    """One embedded Ray for every job run inside the block in this process (a test session, a notebook, a script
    running several stages): `connect()` with an embedded spec of the same shape reuses it instead of starting and
    stopping its own (about 5 s each on a laptop)."""
    with connect(spec) as handle:
        _SHARED.append((spec, handle))
        try:
            yield handle
        finally:
            _SHARED.pop()


@contextlib.contextmanager
def connect(spec: ClusterSpec, env_vars: dict[str, str] | None = None, quiet: bool = False
            ) -> Iterator[ClusterHandle]:
    """Ray for the duration of a job. An existing cluster (spec.address, else RAY_ADDRESS) is only disconnected
    from on exit; an embedded one is started on 127.0.0.1 and shut down on exit, unless a `shared()` block keeps
    one of the same shape open: then that one is used and left running. `quiet`: the actors' output is not
    streamed to this process, and Ray's own driver messages below ERROR are not shown."""
    import ray

    if _SHARED and spec.address is None and not os.environ.get("RAY_ADDRESS"):
        base, handle = _SHARED[-1]
        differs = [f"{name} {getattr(spec, name)} (the shared Ray: {getattr(base, name)})" for name in SHAPING
                   if getattr(spec, name) != getattr(base, name)]
        if differs or env_vars:
            raise RuntimeError(f"this job's cluster differs from the shared embedded Ray: "
                               f"{', '.join(differs) or f'env_vars {env_vars}'}; run it outside the shared() block")
        yield handle
        return
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process; connect() must own the connection "
                           "(call ray.shutdown() first)")
    address = spec.address or os.environ.get("RAY_ADDRESS") or None
    local = address is None
    env = {**DEFAULT_ENV_VARS, **(env_vars or {})}
    loopback = local or _is_loopback(address or "")
    if loopback:
        env[LOOPBACK_ENV] = "0"
    env = _job_env_vars(env)
    runtime_env = {"env_vars": env} if env else None
    t0 = time.monotonic()
    guard = None
    with _loopback_mode() if loopback else contextlib.nullcontext():
        try:
            if local:
                guard = orphan_guard.start()  # if this driver is killed, the Ray it starts here goes with it
                with _free_agent_port() as agent_port:
                    ctx = ray.init(address="local", num_cpus=spec.num_cpus, num_gpus=spec.num_gpus,
                                   include_dashboard=spec.dashboard, dashboard_host="127.0.0.1",
                                   dashboard_port=spec.dashboard_port, namespace=spec.namespace,
                                   runtime_env=runtime_env, _metrics_export_port=spec.metrics_export_port,
                                   **_quiet(quiet))
            else:
                ctx = _init_remote(ray, address, spec.namespace, runtime_env, quiet)
            gcs = ray.get_runtime_context().gcs_address
            url = ctx.dashboard_url or None
            if url and "://" not in url:
                url = f"http://{url}"
            if local:
                log.info("started embedded Ray on %s in %.1f s (dashboard: %s, job agent port %d, Prometheus "
                         "metrics: http://127.0.0.1:%s/metrics, namespace %s)", gcs, time.monotonic() - t0,
                         url or "off", agent_port, metrics_port(), spec.namespace)
            else:
                log.info("connected to Ray at %s (gcs %s) in %.1f s (dashboard: %s, namespace %s)",
                         address, gcs, time.monotonic() - t0, url or "unknown", spec.namespace)
            yield ClusterHandle(gcs, local, url, spec.namespace, env)
        finally:
            ray.shutdown()
            if guard is not None:
                orphan_guard.stop(guard)
            log.info("%s Ray at %s", "stopped embedded" if local else "disconnected from", address or "127.0.0.1")


def metrics_port() -> int | None:
    """The Prometheus port of this driver's node (Ray's metrics agent serves every process's metrics there)."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    return next((n.get("MetricsExportPort") for n in ray.nodes() if n.get("NodeID") == me), None)


def _quiet(quiet: bool) -> dict:
    """ray.init's arguments for a quiet job (see connect)."""
    return {"log_to_driver": False, "logging_level": logging.ERROR} if quiet else {}


def _init_remote(ray, address: str, namespace: str, runtime_env: dict | None, quiet: bool = False):
    try:
        return ray.init(address=address, namespace=namespace, runtime_env=runtime_env, **_quiet(quiet))
    except ConnectionError as e:
        hint = ("" if os.environ.get("RAY_AUTH_MODE") == "token" else
                " If the cluster uses token authentication (the default of `ray start` in Ray 2.60; the log then "
                "shows 'InvalidAuthToken'), run with RAY_AUTH_MODE=token so the driver reads ~/.ray/auth_token.")
        raise ConnectionError(f"could not connect to Ray at {address}: {e}.{hint}") from e


def place(plan: ResourcePlan, nodes: list[dict[str, float]], timeout_s: float) -> dict:
    """One placement group per plan group, named `<job tag>/<group>` (actors.group.job_names), all ready; nothing
    left behind on failure."""
    problems = plan.check_fits(nodes)
    if problems:
        raise ClusterTooSmall(problems)
    from ray.util.placement_group import placement_group

    pgs: dict = {}
    try:
        for g in plan.placements:
            pgs[g.name] = placement_group([dict(b) for b in g.bundles], strategy=g.strategy,
                                          name=ray_name(g.name))
        _wait_ready(pgs, timeout_s)
    except BaseException:
        remove(pgs)
        raise
    log.info("placed %d placement group(s): %s", len(pgs), ", ".join(ray_name(n) for n in pgs))
    return pgs


def nodes_with_room(plan: ResourcePlan, nodes: Callable[[], list[dict[str, float]]], timeout_s: float,
                    poll_s: float = 1.0) -> list[dict[str, float]]:
    """The cluster's nodes (`nodes()`, asked again each `poll_s`) once `plan` fits them, for placing a job again
    after it lost a node: the node that replaces it (an autoscaler's, KubeRay's) joins seconds to minutes later, so
    the restart waits for it up to `timeout_s` before it gives up with ClusterTooSmall. A first placement does not
    wait: a plan that cannot fit fails at once (place)."""
    deadline = time.monotonic() + timeout_s
    problems = plan.check_fits(current := nodes())
    if problems:
        log.warning("the cluster cannot hold the plan now (a lost node not replaced yet?); waiting up to %g s "
                    "(cluster.startup_timeout_s) for nodes to join: %s", timeout_s, "; ".join(problems))
    while problems and time.monotonic() < deadline:
        time.sleep(poll_s)
        problems = plan.check_fits(current := nodes())
    if problems:
        raise ClusterTooSmall(problems + [f"no node that would make room joined within {timeout_s:g} s "
                                          "(cluster.startup_timeout_s) after the job lost one"])
    return current


def _wait_ready(pgs: dict, timeout_s: float) -> None:
    import ray

    refs = {pg.ready(): name for name, pg in pgs.items()}
    _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        names = ", ".join(ray_name(refs[r]) for r in pending)
        raise PlacementTimeout(f"placement group(s) {names} not ready within {timeout_s:g} s: the cluster has "
                               "the resources on paper but not free now (other jobs?), or nodes are still joining; "
                               "see `ray status`. They have been removed.")


def remove(pgs: dict) -> None:
    """Remove placement groups (killing actors still on them); errors are logged, not raised."""
    from ray.util.placement_group import remove_placement_group

    for name, pg in pgs.items():
        try:
            remove_placement_group(pg)
        except Exception as e:  # already removed, or Ray already shut down
            log.warning("could not remove placement group %s: %s", ray_name(name), e)


@dataclass(frozen=True)
class PathsSeen:
    """What one node sees of a job's paths (check_paths_on_nodes)."""

    unreadable: list[str]
    """The paths asked about that are missing or unreadable there."""
    same_folder: bool
    """The output folder there is the driver's (the marker the driver wrote is in it)."""
    writable: bool


def _paths_here(paths: list[str], folder: str, marker: str, token: str) -> PathsSeen:
    """On one node: which of `paths` are missing or unreadable, and whether `folder` is the driver's (its marker
    file holds `token`) and writable."""
    try:
        with open(os.path.join(folder, marker), encoding="utf-8") as handle:
            same = handle.read() == token
    except OSError:
        same = False
    return PathsSeen([p for p in paths if not os.access(p, os.R_OK)], same, os.access(folder, os.W_OK | os.X_OK))


def check_paths_on_nodes(asks: dict[str, list[str]], folder: str, timeout_s: float) -> dict[str, PathsSeen]:
    """Node id -> what `_paths_here` found there, for each node in `asks` (node id -> paths to check). A small task
    runs on each node (no CPU reserved, so it runs beside full placement groups); `folder` is the job's output
    folder, given a marker file here first so each node can tell whether it sees the same folder."""
    import uuid

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = uuid.uuid4().hex
    marker = f".rlhf_ray-node-check-{token[:8]}"
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, marker)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(token)
    task = ray.remote(num_cpus=0, max_retries=0)(_paths_here)
    try:
        refs = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                .remote(paths, folder, marker, token) for node, paths in asks.items()}
        done, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        if pending:
            late = [node_address(n) for n, r in refs.items() if r in pending]
            raise TimeoutError(f"the pre-flight check of the job's inputs did not answer within {timeout_s:g} s "
                               f"(cluster.startup_timeout_s) on node(s) {', '.join(late)}")
        return {node: ray.get(ref) for node, ref in refs.items()}
    finally:
        os.remove(path)


def node_address(node_id: str) -> str:
    """The address of a node (its id's first 8 characters when it is not alive)."""
    import ray

    return next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), node_id[:8])


def nodes_of(placement_group, bundles: list[int]) -> set[str]:
    """The ids of the nodes that `bundles` of a ready placement group were placed on."""
    from ray.util.placement_group import placement_group_table

    where = placement_group_table(placement_group)["bundles_to_node_id"]
    return {where[b] for b in bundles}
