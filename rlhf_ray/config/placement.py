"""Where a role's replicas run: resources per replica, placement strategy, colocation, and the cluster."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_ray.config.base import FieldProblem, StrictModel

Strategy = Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"]


class PlacementSpec(StrictModel):
    """Replicas of one role and what each needs. Each replica gets one placement-group bundle."""

    replicas: int = Field(1, ge=1)
    """Number of actors of this role (data-parallel ranks for a learner, engines for the generation pool)."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs reserved per replica."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per replica; fractions allow several roles to share a GPU when colocated."""
    threads: int | None = Field(None, ge=1)
    """torch / OpenMP threads per replica; default: num_cpus rounded down, at least 1, except for CPU roles of sync
    PPO, which take turns: phase by phase they get the node's cores divided among the replicas busy at the same
    time (see docs/architecture.md, "Threads")."""
    colocate_with: str | None = None
    """Name of another role whose bundles this role shares (e.g. `reference` on the `policy` bundles).
    The shared bundle holds the sum of both roles' per-replica resources; replicas must be equal."""
    strategy: Strategy = "PACK"
    """Ray placement strategy for this role's placement group (ignored for a colocated role)."""


class NodeShape(StrictModel):
    """One kind of node in a declared cluster shape."""

    count: int = Field(1, ge=1)
    """How many nodes of this shape."""
    cpus: float = Field(gt=0)
    """CPUs per node."""
    gpus: float = Field(0.0, ge=0)
    """GPUs per node."""
    memory_gb: float | None = Field(None, gt=0)
    """Host memory per node: CPU roles and offloaded optimizer state must fit in it."""
    gpu_memory_gb: float | None = Field(None, gt=0)
    """Memory of one GPU (e.g. 80 for an H100): `validate` checks each role's bytes against its share of it."""


class ClusterSpec(StrictModel):
    """Which Ray cluster a job runs on, and the shape `rlhf-ray validate` checks a recipe against."""

    address: str | None = None
    """Ray address to connect to. Unset: the RAY_ADDRESS environment variable, else an embedded local Ray
    bound to 127.0.0.1 that stops with the job."""
    shape: list[NodeShape] | None = None
    """Declared cluster shape (e.g. one node of 8 GPUs). `validate` checks the plan against it instead of the
    machine it runs on; a real run always checks the live cluster before starting any actor."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs the embedded local Ray offers (default: all cores)."""
    num_gpus: int | None = Field(None, ge=0)
    """GPUs the embedded local Ray offers (default: all visible)."""
    dashboard: bool = True
    """Start the Ray dashboard (on 127.0.0.1) with the embedded cluster."""
    dashboard_port: int = Field(8265, ge=1, le=65535)
    """Port of the embedded cluster's dashboard (and of `ray job submit --address http://127.0.0.1:PORT`)."""
    metrics_export_port: int | None = Field(None, ge=1, le=65535)
    """Port of the embedded cluster's Prometheus endpoint (http://127.0.0.1:PORT/metrics); default: Ray picks one
    (shown by `ray.nodes()` as MetricsExportPort and in the job's log)."""
    namespace: str = "rlhf_ray"
    """Ray namespace of the job's named actors."""
    call_timeout_s: float = Field(1800.0, gt=0)
    """Longest wait for any one remote call before the actor is reported as hung."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for placement groups and actors to start, and, when a restart places the job again after it
    lost a node, for a node to join in its place."""
    max_actor_restarts: int = Field(3, ge=0)
    """Stateless actors (generation engines, reference, reward) that die or hang are replaced on their bundle and
    their work re-issued, this many times per job; then the job fails."""
    learner_restarts: int = Field(2, ge=0)
    """When a learner rank dies or hangs (its node lost, say; PPO, SFT and RM jobs), a ZeRO group cannot continue
    without it, so the job removes all its actors and starts them again from the last checkpoint, by itself, up
    to this many times (counted in metrics as `actors/learner_restarts`); 0 stops the job instead (run it again
    to resume)."""


def colocation_root(roles: dict[str, PlacementSpec], role: str) -> str:
    """The role that owns the bundles `role` colocates with, or a FieldProblem that says what to fix."""
    path = f"{role}.placement.colocate_with"
    target = roles[role].colocate_with
    assert target is not None
    if target == role:
        raise FieldProblem(path, f"role `{role}` cannot colocate with itself; remove colocate_with")
    if target not in roles:
        known = ", ".join(sorted(r for r in roles if r != role)) or "none"
        raise FieldProblem(path, f"unknown role `{target}`; known roles: {known}")
    if roles[target].colocate_with is not None:
        chain, seen = [role, target], {role, target}
        while (nxt := roles[chain[-1]].colocate_with) is not None and nxt in roles and nxt not in seen:
            chain.append(nxt)
            seen.add(nxt)
        if nxt in seen:
            cycle = " -> ".join([*chain, nxt])
            raise FieldProblem(path, f"colocation cycle {cycle}; one of these roles must own the bundles "
                               "(no colocate_with) and the others point at it")
        root = chain[-1]
        raise FieldProblem(path, f"`{target}` is itself colocated with `{roles[target].colocate_with}`; "
                           f"colocation is one level deep: point `{role}` at the root role `{root}` instead")
    a, b = roles[role].replicas, roles[target].replicas
    if a != b:
        raise FieldProblem(path, f"`{role}` has {a} replicas but `{target}` has {b}; colocated roles share "
                           f"bundles one replica each, so set {role}.placement.replicas to {b} "
                           "or remove colocate_with")
    return target
