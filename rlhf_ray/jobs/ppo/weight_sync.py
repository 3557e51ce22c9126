"""New policy weights to every generation engine, and the policy version they carry. The transport is chosen once,
when the run starts: the engines read the weights in policy rank 0's memory where they sit with it (ipc: shared
memory on a node's CPUs, CUDA IPC on one GPU), a broadcast over a process group of policy rank 0 and the engines
(collective: NCCL between GPUs, gloo on CPU), or buckets through Ray's object store."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import ray

from rlhf_ray.actors.group import ActorDiedError, gather, results_lost
from rlhf_ray.buffer.replay_buffer import Minibatches
from rlhf_ray.config.ppo_job import PPOJob
from rlhf_ray.jobs.ppo.workers import RoleWorkers, Trained
from rlhf_ray.learners.learner_group import rendezvous
from rlhf_ray.models.weight_transport import gpus_shared

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncResult:
    """One weight sync (all zeros when nothing was sent)."""

    version: int
    """The policy version the engines hold after it."""
    bytes: float = 0.0
    seconds: float = 0.0
    """Wall time at the driver, gathering to loaded."""
    gather_seconds: float = 0.0
    """Until the learner had packed (object store) or sent (collective) every bucket, at the driver."""
    learner_gather_seconds: float = 0.0
    """The learner's own time gathering and packing."""
    load_seconds: float = 0.0
    """Until every engine had loaded the weights, at the driver (collective: the whole pipelined transfer)."""
    engine_load_seconds: float = 0.0
    """The slowest engine's own loading time."""


def choose_transport(requested: str, members: dict[str, tuple[str, list]], elastic: bool = False) -> str:
    """The transport, once the members' places are known. `members`: policy rank 0 first, then every engine: name
    -> (node id, the GPU ids Ray gave it). auto: ipc when every engine sits with rank 0 (the same node, on CPU; the
    same GPU, where they have GPUs) and the pool is not `elastic` (an engine that joins may sit anywhere), else
    collective when every member has a GPU of its own (NCCL cannot put two ranks on one device), else the object
    store. An explicit choice that cannot work here is refused, naming why."""
    (learner, (node, gpus)), *engines = members.items()
    apart = [name for name, (n, g) in engines if n != node or sorted(map(str, g)) != sorted(map(str, gpus))]
    shared = gpus_shared(members)
    if requested == "ipc" and apart:
        place = f"GPU {gpus}" if gpus else "node"
        raise ValueError(f"generation.weight_sync.transport: ipc needs every engine on the {place} of {learner}, "
                         f"but {', '.join(apart)} {'is' if len(apart) == 1 else 'are'} elsewhere. Use transport: auto "
                         "or place the engines with the policy (placement.colocate_with: policy)")
    if requested == "collective" and shared:
        raise ValueError(f"generation.weight_sync.transport: collective needs policy rank 0 and every engine on a "
                         f"GPU of its own (NCCL cannot put two ranks on one device), but {'; '.join(shared)}. Use "
                         "transport: auto (ipc or the object store here) or whole GPUs (placement.num_gpus: 1)")
    if requested != "auto":
        return requested
    if not apart and not elastic:
        return "ipc"
    if gpus and all(g for _, (_, g) in engines) and not shared:
        return "collective"
    return "object_store"


def why_transport(transport: str, requested: str, members: dict[str, tuple[str, list]], elastic: bool = False) -> str:
    """Why choose_transport chose `transport`, for the job's log."""
    (learner, (node, _)), *engines = members.items()
    if requested != "auto":
        return "set in generation.weight_sync.transport"
    if transport == "ipc":
        return f"every engine is on the node of {learner}"
    together = all(n == node and sorted(map(str, g)) == sorted(map(str, members[learner][1])) for _, (n, g) in engines)
    if elastic and together:
        return "the pool is elastic (generation.placement.max_replicas): an engine that joins may sit on any node"
    elsewhere = [name for name, (n, _) in engines if n != node]
    where = (f"{', '.join(elsewhere)} on another node than {learner} (ipc shares memory within one node)"
             if elsewhere else f"the engines on other GPUs than {learner}'s")
    if transport == "collective":
        return f"{where}, every member on a GPU of its own"
    return f"{where}, and not every member has a GPU of its own for a collective"


def _node_and_gpus(_actor) -> tuple[str, list]:
    """Run in an actor (`__ray_call__`): its node id and the GPU ids Ray assigned it."""
    return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()


class WeightSync:
    def __init__(self, job: PPOJob, workers: RoleWorkers, version: int = 0):
        self.job, self.workers, self.version = job, workers, version
        spec = job.generation.weight_sync
        self.bucket_bytes, self.adapters_only = int(spec.bucket_mb * 2**20), spec.lora == "adapter"
        places = self._places()
        self.transport = choose_transport(spec.transport, places, job.generation.placement.elastic)
        log.info("weight sync: %s (%s)", self.transport, why_transport(self.transport, spec.transport, places,
                                                                       job.generation.placement.elastic))
        self.behind: set[int] | None = None  # ipc: engines replaced during a handoff, given the weights after it
        self.closing: list | None = None  # ipc: the call that frees the last part, not waited for
        if self.transport == "collective":
            self._form_broadcast()
            workers.pool.on_replaced = self._rejoin
            workers.pool.on_dropped = self._form_broadcast  # without the engines that left
        elif self.transport == "ipc":
            workers.pool.on_replaced = self._hand_off_again
        else:
            workers.pool.on_replaced = self._resync_published

    def sync(self, bump: bool = True) -> SyncResult:
        """Policy weights -> every engine, bucket by bucket; the policy version goes up by one (unless `bump` is
        false: a re-sync after an engine was replaced, or after a resume)."""
        start = time.perf_counter()
        self.version += int(bump)
        policy, pool = self.workers.policy, self.workers.pool
        if self.transport == "ipc":
            return self._hand_off(start)
        if self.transport == "collective":
            learner = policy.submit("broadcast_weights", self.bucket_bytes, self.adapters_only)
            engines = pool.receive(self.version)
            sent = policy.gather(learner, "broadcast_weights")[0]
            loaded = pool.group.gather(engines, "receive_weights")
            if stale := [n for n, r in zip(pool.group.names, loaded) if r.version != self.version]:
                raise RuntimeError(f"{', '.join(stale)} did not reach policy version {self.version}")
            seconds = time.perf_counter() - start  # one pipelined transfer: all of it counts as gathering
            return SyncResult(self.version, float(sent.bytes), seconds, seconds, sent.seconds, seconds, 0.0)
        published = policy.call("publish_weights", self.bucket_bytes, self.adapters_only)[0]
        gathered = time.perf_counter()
        with self._published_weights_lost("during `publish_weights`"):
            loaded = pool.broadcast(published.refs, self.version)
        return SyncResult(self.version, float(published.bytes), time.perf_counter() - start, gathered - start,
                          published.seconds, loaded.seconds, loaded.engine_seconds)

    def unchanged(self, minibatches: Minibatches, trained: Trained) -> SyncResult:
        """An update that left the policy's weights as they were (the critic's warm-up, or every policy step skipped
        for non-finite gradients): same weights, same version, nothing to send."""
        if trained.policy is not None:
            log.warning("update on rollout %d: every policy optimizer step was skipped (inf / nan gradients); the "
                        "policy stays at version %d and no weights are sent", minibatches.meta.rollout_index + 1,
                        self.version)
        return SyncResult(self.version)

    def _form_broadcast(self) -> None:
        """Policy rank 0 and every engine join a fresh weight-sync process group (again after an engine is
        replaced)."""
        timeout = self.job.cluster.call_timeout_s
        policy, pool = self.workers.policy, self.workers.pool
        address = rendezvous(policy, timeout)
        world = len(pool.group) + 1
        learner = policy.submit("join_weight_sync", *address, world, timeout)
        engines = [actor.join_weight_sync.remote(*address, rank + 1, world, timeout)
                   for rank, actor in enumerate(pool.group.actors)]
        policy.gather(learner, "join_weight_sync")
        pool.group.gather(engines, "join_weight_sync")

    def _hand_off(self, start: float, ranks: list[int] | None = None) -> SyncResult:
        """ipc: bucket by bucket, policy rank 0 gives where the weights lie in its memory and every engine (or
        those of `ranks`) loads them from there; the next bucket is asked for once all have. After the last one the
        call that frees it is not waited for (the policy runs it before anything else; the next handoff collects
        it). An engine replaced meanwhile is given every bucket once the others have them."""
        policy, pool = self.workers.policy, self.workers.pool
        if self.closing is not None:
            policy.gather(self.closing, "handoff_weights")
            self.closing = None
        learner_seconds = engine_seconds = 0.0
        nbytes = 0
        self.behind = set()
        while True:
            asked = time.perf_counter()
            part = policy.call("handoff_weights", self.bucket_bytes, self.adapters_only)[0]
            learner_seconds += time.perf_counter() - asked
            if part is None:
                break
            nbytes += part.nbytes
            loaded = pool.take(part, self.version, ranks)
            engine_seconds += max(r.seconds for r in loaded)
            if part.last:
                self.closing = policy.submit("handoff_weights", self.bucket_bytes, self.adapters_only)
                break
        behind, self.behind = sorted(self.behind), None
        if behind:
            self._hand_off(time.perf_counter(), behind)
        seconds = time.perf_counter() - start
        return SyncResult(self.version, float(nbytes), seconds, learner_seconds, learner_seconds,
                          seconds - learner_seconds, engine_seconds)

    @contextlib.contextmanager
    def _published_weights_lost(self, when: str):
        """Engines that cannot read the buckets policy rank 0 published: they went with their owner, whose node died
        meanwhile. That is policy rank 0's death (the job restarts every role from its checkpoint), not the engine's
        failure. `when`: what the message says of the time it died."""
        try:
            yield
        except Exception as err:
            if results_lost(err):
                policy = self.workers.policy.names[0]
                raise ActorDiedError(f"{policy} died {when}: the engines could not read the weights it had "
                                     f"published ({err.cause})", policy, "publish_weights") from err
            raise

    def _resync_published(self, rank: int) -> None:
        """object_store: a replacement engine loads the last published weights, if their owner still lives."""
        with self._published_weights_lost("after `publish_weights` (a replacement engine found its weights gone)"):
            self.workers.pool.resync(rank)

    def _hand_off_again(self, rank: int) -> None:
        """ipc: a replacement engine gets the current weights (after the handoff in progress, if there is one)."""
        if self.behind is not None:
            self.behind.add(rank)
        elif self.version:
            self._hand_off(time.perf_counter(), [rank])

    def _places(self) -> dict[str, tuple[str, list]]:
        """Policy rank 0 and every engine: name -> (node id, GPU ids)."""
        policy, pool = self.workers.policy, self.workers.pool
        members = [(policy.names[0], policy.actors[0])] + list(zip(pool.group.names, pool.group.actors))
        found = gather([actor.__ray_call__.remote(_node_and_gpus) for _, actor in members], [n for n, _ in members],
                       self.job.cluster.call_timeout_s, "GPU ids")
        return dict(zip([n for n, _ in members], found))

    def _rejoin(self, rank: int) -> None:
        """Collective transport: a replacement engine joins a new group with everyone, then all get the weights."""
        self._form_broadcast()
        self.sync(bump=False)
