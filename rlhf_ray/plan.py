"""The resource plan: roles' placement specs turned into placement groups, checked against a cluster's nodes.

Pure Python (no Ray import) so `rlhf-ray validate` can show and check a recipe for an 8-GPU node on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich import box
from rich.table import Table

from rlhf_ray.config.placement import NodeShape, PlacementSpec, colocation_root

Resources = dict[str, float]
KINDS = ("CPU", "GPU")
_EPS = 1e-6  # resource sums are floats (0.1 + 0.2); Ray itself rounds to 1e-4


@dataclass(frozen=True)
class RoleSlot:
    """One role's share of the plan: which placement group it lives in and what each replica reserves."""

    role: str
    placement: str
    replicas: int
    per_replica: Resources


@dataclass(frozen=True)
class PlacementPlan:
    """One Ray placement group: bundle i holds replica i of every role in `roles`."""

    name: str
    roles: tuple[str, ...]
    bundles: tuple[Resources, ...]
    strategy: str

    def total(self) -> Resources:
        return _sum(self.bundles)


def _res(cpus: float, gpus: float) -> Resources:
    """A bundle; Ray rejects zero-valued entries, so GPU is left out when none is asked for."""
    out = {"CPU": round(float(cpus), 4)}
    if gpus:
        out["GPU"] = round(float(gpus), 4)
    return out


def _sum(items) -> Resources:
    out: Resources = {}
    for r in items:
        for k, v in r.items():
            out[k] = round(out.get(k, 0.0) + v, 4)
    return out


def _fmt(x: float) -> str:
    return f"{x:g}"


def format_resources(r: Resources) -> str:
    return ", ".join(f"{k} {_fmt(v)}" for k, v in r.items() if v) or "nothing"


def _fits(need: Resources, free: Resources) -> bool:
    return all(free.get(k, 0.0) + _EPS >= v for k, v in need.items())


def _take(free: Resources, need: Resources) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - v


class ResourcePlan:
    """All placement groups of a job, in role order, plus where each role's replicas sit."""

    def __init__(self, placements: list[PlacementPlan], slots: dict[str, RoleSlot]):
        self.placements = placements
        self.slots = slots

    @classmethod
    def from_roles(cls, roles: dict[str, PlacementSpec]) -> ResourcePlan:
        owners = {r: (colocation_root(roles, r) if s.colocate_with else r) for r, s in roles.items()}
        placements: list[PlacementPlan] = []
        slots: dict[str, RoleSlot] = {}
        for owner, spec in roles.items():
            if owners[owner] != owner:
                continue
            members = [r for r in roles if owners[r] == owner]
            per = {r: _res(roles[r].num_cpus, roles[r].num_gpus) for r in members}
            bundle = _sum(per.values())
            placements.append(PlacementPlan(owner, tuple(members), tuple(dict(bundle) for _ in range(spec.replicas)),
                                    spec.strategy))
            for r in members:
                slots[r] = RoleSlot(r, owner, roles[r].replicas, per[r])
        return cls(placements, {r: slots[r] for r in roles})

    def placement(self, name: str) -> PlacementPlan:
        for g in self.placements:
            if g.name == name:
                return g
        names = ", ".join(g.name for g in self.placements)
        raise KeyError(f"no placement group `{name}`; placement groups: {names}")

    def role_slots(self, role: str) -> tuple[str, list[int]]:
        """(placement group name, bundle indices): replica i of a role always sits on bundle i of its placement
        group."""
        if role not in self.slots:
            raise KeyError(f"no role `{role}` in the plan; roles: {', '.join(self.slots)}")
        s = self.slots[role]
        return s.placement, list(range(s.replicas))

    def totals(self) -> Resources:
        t = _sum(g.total() for g in self.placements)
        return {k: t.get(k, 0.0) for k in KINDS}

    def _breakdown(self, kind: str) -> str:
        parts = [f"{s.role} {s.replicas} x {_fmt(s.per_replica[kind])}"
                 for s in self.slots.values() if s.per_replica.get(kind)]
        return " + ".join(parts)

    def _fields(self, kind: str) -> str:
        """The YAML fields that set each role's share of `kind` (`learner` is a supervised job's top-level
        placement)."""
        name = "num_gpus" if kind == "GPU" else "num_cpus" if kind == "CPU" else f"resources.{kind}"
        return " / ".join(f"{'' if s.role == 'learner' else s.role + '.'}placement.{name}"
                          for s in self.slots.values() if s.per_replica.get(kind))

    def check_fits(self, nodes: list[Resources]) -> list[str]:
        """Problems that would leave placement groups pending forever; empty when the plan fits."""
        if not nodes:
            return ["the cluster has no nodes"]
        problems: list[str] = []
        have = _sum({k: n.get(k, 0.0) for k in KINDS} for n in nodes)
        for kind, need in self.totals().items():
            if need > have.get(kind, 0.0) + _EPS:
                unit = kind + ("s" if need != 1 else "")
                problems.append(f"needs {_fmt(need)} {unit} ({self._breakdown(kind)}) but the cluster has "
                                f"{_fmt(have.get(kind, 0.0))} ({describe_nodes(nodes)}); to fit, lower "
                                f"{self._fields(kind)} (or replicas), or give the job a bigger cluster "
                                "(cluster.num_cpus / num_gpus on one machine, cluster.shape or cluster.address)")
        for g in self.placements:
            for shape in {tuple(sorted(b.items())) for b in g.bundles}:
                b = dict(shape)
                if not any(_fits(b, n) for n in nodes):
                    who = " + ".join(f"{r} {format_resources(self.slots[r].per_replica)}" for r in g.roles)
                    fields = " / ".join(f"{'' if r == 'learner' else r + '.'}placement" for r in g.roles)
                    problems.append(f"placement group `{g.name}`: a bundle of {format_resources(b)} ({who}) fits on no "
                                    f"node ({describe_nodes(nodes)}); lower num_cpus / num_gpus in {fields}, or "
                                    "use bigger nodes")
            if g.strategy == "STRICT_PACK" and len(g.bundles) > 1 and not any(_fits(g.total(), n) for n in nodes):
                problems.append(f"placement group `{g.name}` is STRICT_PACK: all {len(g.bundles)} bundles "
                                f"({format_resources(g.total())}) must share one node, and no node is that big "
                                f"({describe_nodes(nodes)}); use PACK or fewer/smaller replicas")
            if g.strategy == "STRICT_SPREAD" and len(g.bundles) > len(nodes):
                problems.append(f"placement group `{g.name}` is STRICT_SPREAD: {len(g.bundles)} bundles need "
                                f"{len(g.bundles)} nodes but the cluster has {len(nodes)}; use SPREAD or PACK")
        if problems:
            return problems
        stuck = self._pack(nodes)
        return [stuck] if stuck else []

    def _pack(self, nodes: list[Resources]) -> str | None:
        """First-fit decreasing over all groups at once: strict groups first, then larger items first.
        A heuristic: a refusal means this greedy order found no room, which is what to look at."""
        free = [dict(n) for n in nodes]
        order = {"STRICT_PACK": 0, "STRICT_SPREAD": 1}

        def size(r: Resources) -> tuple[float, float]:
            return r.get("GPU", 0.0), r.get("CPU", 0.0)

        units: list[tuple[int, tuple[float, float], PlacementPlan, list[Resources]]] = []
        for g in self.placements:
            if g.strategy in order:
                items = [g.total()] if g.strategy == "STRICT_PACK" else list(g.bundles)
                units.append((order[g.strategy], size(max(items, key=size)), g, items))
            else:
                units += [(2, size(b), g, [b]) for b in g.bundles]
        units.sort(key=lambda u: (u[0], tuple(-x for x in u[1])))
        for _, _, g, items in units:
            used: set[int] = set()
            for item in sorted(items, key=size, reverse=True):
                i = next((i for i, f in enumerate(free) if i not in used and _fits(item, f)), None)
                if i is None:
                    left = "; ".join(f"node {j}: {format_resources(f)}" for j, f in enumerate(free))
                    return (f"placement group `{g.name}` ({len(g.bundles)} x {format_resources(g.bundles[0])}, "
                            f"{g.strategy}) does not fit in what the other placement groups leave free ({left}); the "
                            "totals fit but the bundles do not pack onto the nodes: use smaller bundles or bigger nodes")
                _take(free[i], item)
                if g.strategy == "STRICT_SPREAD":
                    used.add(i)
        return None

    def render(self, title: str = "Resource plan") -> Table:
        """The plan as a table that reads at 80 columns, in a terminal or a log (no wrapped cells)."""
        table = Table(title=title, title_justify="left", show_footer=True, box=box.SIMPLE_HEAD, pad_edge=False,
                      show_edge=False)
        table.add_column("placement group", footer="total", no_wrap=True)
        table.add_column("roles (per replica)", no_wrap=True)
        table.add_column("bundles", footer=format_resources(self.totals()), no_wrap=True)
        table.add_column("strategy", no_wrap=True)
        for g in self.placements:
            roles = "\n".join(f"{r}: {format_resources(self.slots[r].per_replica)}" for r in g.roles)
            table.add_row(g.name, roles, f"{len(g.bundles)} x {format_resources(g.bundles[0])}",
                          g.strategy)
        return table


def describe_nodes(nodes: list[Resources]) -> str:
    counts: dict[str, int] = {}
    for n in nodes:
        key = format_resources({k: n.get(k, 0.0) for k in KINDS})
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{c} node{'s' if c > 1 else ''} of {k}" for k, c in counts.items())


def nodes_from_shape(shape: list[NodeShape]) -> list[Resources]:
    """Node dicts as Ray reports them (CPU, GPU, memory in bytes), plus the bytes of one GPU where declared."""
    nodes = []
    for s in shape:
        node = {"CPU": float(s.cpus), "GPU": float(s.gpus)}
        if s.memory_gb:
            node["memory"] = s.memory_gb * 2**30
        if s.gpu_memory_gb:
            node["gpu_memory"] = s.gpu_memory_gb * 2**30
        nodes += [dict(node) for _ in range(s.count)]
    return nodes
