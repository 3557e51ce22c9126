"""Start a learner group: N ranks on their bundles, one process group among them, engines built together."""

from __future__ import annotations

from rlhf_ray.actors.group import ActorGroup, Slots, Timeouts, gather
from rlhf_ray.config.placement import ClusterSpec, PlacementSpec
from rlhf_ray.distributed import actor_env


def start_learner_group(cls: type, role: str, placement: PlacementSpec, placement_group, bundle_indices: list[int],
                        cluster: ClusterSpec, total_steps: int, **kwargs) -> ActorGroup:
    """Create the ranks, rendezvous at rank 0, and build every DeepSpeed engine in one collective call."""
    group = spawn_learner_group(cls, role, placement, placement_group, bundle_indices, cluster, **kwargs)
    return setup_learner_group(group, cluster, total_steps)


def spawn_learner_group(cls: type, role: str, placement: PlacementSpec, placement_group, bundle_indices: list[int],
                        cluster: ClusterSpec, **kwargs) -> ActorGroup:
    """The ranks' processes, started without waiting for them (so several roles start at once)."""
    return ActorGroup(cls, role, placement.replicas,
                      Slots.of(placement, placement_group, bundle_indices, actor_env(placement)), kwargs=kwargs,
                      timeouts=Timeouts.of(cluster))


def setup_learner_group(group: ActorGroup, cluster: ClusterSpec, total_steps: int) -> ActorGroup:
    """Wait for the spawned ranks, rendezvous at rank 0, and build every DeepSpeed engine in one collective call."""
    group.wait_ready(cluster.startup_timeout_s)
    host, port = rendezvous(group, cluster.startup_timeout_s)
    group.call("setup", host, port, total_steps, cluster.call_timeout_s, timeout=cluster.startup_timeout_s)
    return group


def rendezvous(group: ActorGroup, timeout_s: float) -> tuple[str, int]:
    """The address and port rank 0 of `group` hosts a process group on (it keeps the port until the group forms)."""
    (address,) = gather([group.actors[0].rendezvous_address.remote()], group.names[:1], timeout_s,
                        "rendezvous_address")
    return address[0], address[1]
