"""An elastic generation pool's engines beyond its minimum (`generation.placement.max_replicas`): each asks for a
placement group of its own, one bundle of an engine's resources, which Ray grants when a node has room (one joins,
another job ends; a pending group is also what makes a KubeRay autoscaler add a node). The pool starts an engine
on each group granted (GenerationPool.grow) and gives its group back when the engine's node leaves, asking for a
new one at once. The engines
of the minimum run on the job's own placement group: one whose node leaves while the pool is above its minimum
leaves its bundle vacant (no restart spent) until Ray places the bundle again (`vacant`, `placed_again`)."""

from __future__ import annotations

import logging
import time

from rlhf_ray.actors.group import ray_name

log = logging.getLogger(__name__)


NODE_VERDICT_S = 60.0
"""How long an extra engine's death waits for Ray to say whether its node is gone (it marks a node dead after
missed health checks: about 15 s with Ray's defaults), before the death is taken for the engine's own."""
FAILED_STARTS = 3
"""Extra engines that may fail to start (or to load the weights) before the pool asks for no more: one that fails
on every node (out of memory, say) must not be started again each iteration."""


class ExtraEngines:
    def __init__(self, wanted: int, bundle: dict[str, float], slices: int, role: str = "generation",
                 minimum: int = 1):
        """`wanted`: engines beyond the minimum (max_replicas - replicas); `bundle`: one engine's resources;
        `slices`: max_replicas, the parts every batch of prompts is cut into (each with its seed) whatever the
        engines present, so the samples do not depend on them; `minimum`: replicas, the engines the job needs."""
        self.wanted, self.bundle, self.slices, self.role, self.minimum = wanted, bundle, slices, role, minimum
        self.vacant: list[tuple[object, int]] = []
        """(placement group, bundle) of the minimum's engines that left with their node while the pool was above
        its minimum; an engine starts there again once Ray has placed the bundle on a live node."""
        self.asked: list = []
        """Placement groups asked for and not granted yet, oldest first."""
        self.ready: dict = {}
        """Placement group id -> the ObjectRef that resolves once Ray grants it (asked once: a fresh `pg.wait(0)`
        is a request that times out before the answer arrives, so it says False even for a granted group)."""
        self.held: dict[str, object] = {}
        """Engine name -> the granted placement group it runs on."""
        self.nodes: dict[str, str] = {}
        """Engine name -> the id of the node it runs on."""
        self.made = 0
        self.failed_starts = 0
        """Engines that did not start on a granted group; at FAILED_STARTS the pool stops asking for more."""

    def ask(self) -> None:
        """Ask for groups until every wanted engine has one, asked or held (asking returns at once: Ray grants the
        group when it can)."""
        from ray.util.placement_group import placement_group

        while len(self.asked) + len(self.held) < self.wanted:
            name = ray_name(f"{self.role}-extra-{self.made}")
            self.made += 1
            pg = placement_group([dict(self.bundle)], strategy="STRICT_PACK", name=name)
            self.asked.append(pg)
            self.ready[pg.id] = pg.ready()

    def granted(self) -> list:
        """The groups Ray has granted since the last call (no longer in `asked`); does not wait."""
        import ray

        if not self.asked:
            return []
        done, _ = ray.wait([self.ready[pg.id] for pg in self.asked], num_returns=len(self.asked), timeout=0)
        done = set(done)
        granted = [pg for pg in self.asked if self.ready[pg.id] in done]
        self.asked = [pg for pg in self.asked if pg not in granted]
        for pg in granted:
            del self.ready[pg.id]
        return granted

    def hold(self, engine: str, pg, node_id: str) -> None:
        self.held[engine], self.nodes[engine] = pg, node_id

    def node_left(self, engine: str, wait_s: float = NODE_VERDICT_S) -> bool:
        """Whether the engine's node is gone, once Ray says so: right after a node dies its actors' calls fail as
        "temporarily unavailable" while Ray still lists it alive. False: the node lives (the engine itself died)."""
        return node_gone(self.nodes[engine], wait_s)

    def placed_again(self) -> list[tuple[object, int]]:
        """The vacant bundles Ray has placed on a live node again (taken out of `vacant`); does not wait."""
        import ray
        from ray.util.placement_group import placement_group_table

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        ready = []
        for pg, bundle in self.vacant:
            table = placement_group_table(pg)
            if table.get("state") == "CREATED" and table.get("bundles_to_node_id", {}).get(bundle) in alive:
                ready.append((pg, bundle))
        self.vacant = [place for place in self.vacant if place not in ready]
        return ready

    def holds(self, engine: str) -> bool:
        return engine in self.held


    def give_back(self, pg, failed_start: bool = False) -> None:
        """Remove a group (its engine left or failed to start) and ask for another in its place, unless
        FAILED_STARTS engines failed to start: then the pool stays as it is."""
        self.held = {name: held for name, held in self.held.items() if held is not pg}
        self.nodes = {name: node for name, node in self.nodes.items() if name in self.held}
        _remove(pg)
        self.failed_starts += int(failed_start)
        if self.failed_starts >= FAILED_STARTS:
            if self.wanted > len(self.held):
                log.warning("%d extra engines failed to start; the pool asks for no more (it keeps %d)",
                            self.failed_starts, len(self.held))
            self.wanted = len(self.held)
            for asked in self.asked:
                _remove(asked)
            self.asked, self.ready = [], {}
            return
        self.ask()

    def release(self, engine: str) -> None:
        """The engine's node left: its group goes, another is asked for."""
        self.give_back(self.held[engine])

    def close(self) -> None:
        """Remove every group, asked or held."""
        for pg in [*self.asked, *self.held.values()]:
            _remove(pg)
        self.asked, self.held, self.ready = [], {}, {}


def node_gone(node: str, wait_s: float = NODE_VERDICT_S) -> bool:
    """Whether Ray says the node is dead, asked until `wait_s` has passed (see ExtraEngines.node_left)."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if node not in alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def _remove(pg) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception as err:  # noqa: BLE001 - already removed, or Ray is shutting down
        log.warning("could not remove an engine's placement group: %s", err)
