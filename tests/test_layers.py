"""The package imports downwards only: config at the bottom, the commands at the top. Every `import` counts, the
ones inside functions too (they hide a cycle, they do not remove it). A new import that climbs a layer fails here,
naming the file and line."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "rlhf_ray"

LAYERS: list[set[str]] = [
    {"config"},                                               # pydantic models of every YAML
    {"functions", "distributed", "exit_codes", "orphan_guard"},  # generic helpers
    {"data"},                                                 # datasets, tokens, the tasks' rules
    {"plan", "algorithms", "buffer"},                         # resource plan; pure RL math; the replay buffer
    {"models"},                                               # model sources, loading, weight buckets
    {"memory", "envs"},                                       # memory model; multi-turn environments
    {"actors"},                                               # inference-side Ray actors
    {"learners"},                                             # DeepSpeed learner ranks
    {"cluster"},                                              # connecting to Ray, placement groups
    {"jobs"},                                                 # the drivers, preflight, checkpoints
    {"compare", "reward_server", "quickstart"},               # commands
    {"cli"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """rlhf_ray.jobs.ppo -> jobs; rlhf_ray.cli -> cli."""
    return module.split(".")[1]


def imports() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, file:line) for every import of another rlhf_ray unit."""
    found = []
    for file in sorted(ROOT.rglob("*.py")):
        parts = file.relative_to(ROOT.parent).with_suffix("").parts
        if parts == ("rlhf_ray", "__init__"):
            continue
        source = parts[1]
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "rlhf_ray":  # from rlhf_ray import cluster
                targets = [f"rlhf_ray.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlhf_ray."):
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("rlhf_ray.")]
            else:
                continue
            for target in targets:
                if unit_of(target) != source:
                    found.append((source, unit_of(target), f"{file.relative_to(ROOT.parent)}:{node.lineno}"))
    return found


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert units - LAYER.keys() == set(), "give the new module or package a layer in LAYERS"


def test_imports_go_downwards_only():
    climbing = [f"{where}: {src} (layer {LAYER[src]}) imports {dst} (layer {LAYER[dst]})"
                for src, dst, where in imports() if LAYER[dst] > LAYER[src]]
    assert climbing == []


def test_no_cycles_between_units_of_one_layer():
    edges = defaultdict(set)
    for src, dst, _ in imports():
        edges[src].add(dst)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in edges[start])

    assert [u for u in LAYER if reaches(u, u, {u})] == []


def module_imports() -> dict[str, set[str]]:
    """{module: the rlhf_ray modules it imports}, file by file (`from rlhf_ray.actors import engine` counts as
    rlhf_ray.actors.engine); every import counts, the ones inside functions too."""
    modules = {}
    for file in ROOT.rglob("*.py"):
        parts = file.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    edges: dict[str, set[str]] = {}
    for name, file in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlhf_ray"):
                targets |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
        edges[name] = {t for t in targets if t in modules and t != name and modules[t].stem != "__init__"}
    return edges


def test_no_cycles_between_files():
    """A file that imports another which imports it back (even lazily, inside a function) is one unit split in two:
    the shared part belongs in a third file both import."""
    edges = module_imports()

    def path_back(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges[node]):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    circles = {m: path for m in sorted(edges) if (path := path_back(m))}
    assert circles == {}, "\n".join(" -> ".join(p) for p in circles.values())


def test_imports_of_a_unit_from_the_package_count_too():
    """`from rlhf_ray import cluster` is an import of the cluster unit (it was not seen before)."""
    found = {(src, dst, where.split(":")[0]) for src, dst, where in imports()}
    assert ("cluster", "orphan_guard", "rlhf_ray/cluster.py") in found
