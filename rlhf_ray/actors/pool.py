"""The generation pool: K engine replicas behind one call. Prompts are split across engines in contiguous,
balanced chunks; results come back in input order; weight updates reach every engine from the same buckets.

An engine that dies is replaced on its bundle, loaded with the current policy weights (the pool keeps the
references of the last broadcast) and given its prompts again, within the job's restart budget. An elastic pool
(`generation.placement.max_replicas`) also grows between iterations, by an engine on each node that made room
(`grow`), and drops an engine beyond its minimum whose node left, its prompts answered by the others."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import ray

from rlhf_ray.actors.elastic import ExtraEngines, node_gone
from rlhf_ray.actors.engine import RolloutSample, engine_env
from rlhf_ray.models.support import resolve_engine
from rlhf_ray.actors.generator import GenerationWorker, Loaded, RolloutPart
from rlhf_ray.actors.payload import answer_of
from rlhf_ray.actors.group import (ActorCallTimeout, ActorDiedError, ActorGroup, RemoteCallError, RestartBudget, Slots,
                                   Thread, Timeouts, gather, node_lost, resilient_gather)
from rlhf_ray.config.generation import GenerationSpec
from rlhf_ray.data.split import stable_seed
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.envs.episode import EPISODE_COLUMNS
from rlhf_ray.distributed import threads

log = logging.getLogger(__name__)


WEIGHT_CALLS = ("load_weights", "take_weights", "receive_weights")
"""An engine's calls that load weights: with partial rollouts they run beside its rollouts, in a thread of their
own."""
ROLLOUTS_AT_ONCE = 16
"""With partial rollouts, the rollout calls an engine takes in at once (its threads: each joins its prompts to the
answers in flight, then waits for its turn to drive the engine); more queue at Ray."""
CLOSE_TIMEOUT_S = 10
"""How long the job's end waits for the engines to shut down before it kills them anyway."""


def with_model_len(job) -> "GenerationSpec":
    """The generation spec with vllm.max_model_len defaulted to the job's prompt + answer limits (vLLM would
    otherwise size its KV cache for the model's full context)."""
    spec = job.generation
    if spec.vllm.max_model_len is not None:
        return spec
    limit = max(16, job.data.max_prompt_len + spec.max_answer_tokens)
    return spec.model_copy(update={"vllm": spec.vllm.model_copy(update={"max_model_len": limit})})


@dataclass(frozen=True)
class Rollout:
    """One batch of prompts answered by the engines: references to each engine's samples (engine order = prompt
    order; the driver never holds them) and what the metrics need."""

    refs: list
    version: int
    """The oldest policy version among the engines that sampled it."""
    samples: int
    tokens: int
    """Answer tokens generated."""
    engine_seconds: float
    """The slowest engine's generation time."""
    engine_busy_seconds: float
    """Generation time summed over engines."""
    prompt_keys: list = field(default_factory=list)
    """The keys given with the prompts answered (the PPO feed's: (rollout index, dataset index)), one per group in
    sample order: with partial rollouts, the first groups to finish among those in flight, not necessarily the
    prompts this rollout brought."""
    streamed_groups: int = 0
    """Its groups whose prompts another rollout brought (partial rollouts)."""
    restarted_answers: int = 0
    """Answers in flight that were started again while it generated, their first token over ppo.max_staleness
    versions old (partial rollouts: their tokens were wasted)."""
    engines: int = 0
    """Engines that answered a share of it (an elastic pool's engine that left meanwhile does not count)."""
    episodes: dict[str, float] = field(default_factory=dict)
    """Multi-turn episodes' totals (turns, tool calls, ...: EPISODE_COLUMNS) summed over samples; empty without
    an environment."""


@dataclass
class EnginesLoaded:
    """Every engine loaded the same weights (GenerationPool.broadcast)."""

    seconds: float
    """From the first engine's call to the last one's answer."""
    engine_seconds: float
    """The slowest engine's loading time."""


@dataclass
class PendingRollout:
    """A rollout submitted to the engines (GenerationPool.submit), not yet collected."""

    args: list[tuple]
    """Each engine's call arguments (to ask a replacement engine again)."""
    refs: list
    """Each engine's call: the ObjectRefs of its samples and of its RolloutPart."""
    names: list[str]
    """The engines called (an elastic pool's may have changed since)."""


class GenerationPool:
    def __init__(self, group: ActorGroup, engine: str, budget: RestartBudget, extra: ExtraEngines | None = None):
        self.group, self.engine, self.budget, self.extra = group, engine, budget, extra
        self.weights: tuple[list, int] | None = None  # (bucket refs, version) of the last broadcast
        self.on_replaced = self.resync
        """Brings a replacement (or joining) engine to the current weights; the collective and ipc transports set
        their own."""
        self.on_dropped = lambda: None
        """After engines left an elastic pool; the collective transport forms its group again without them."""
        self.base_nodes: dict[str, str] = {}
        """An elastic pool's engines on the job's own placement group -> their node's id (recorded by `grow`): one
        whose node leaves while the pool is above its minimum is dropped rather than replaced."""

    @classmethod
    def start(cls, job, placement_group, bundle_indices: list[int], tokens: TokenConventions,
              budget: RestartBudget | None = None, wait: bool = True) -> "GenerationPool":
        """The engines of `job` on their bundles; with wait=False their processes start and the caller waits with
        `group.wait_ready` (so other roles start meanwhile). An elastic pool asks for its extra engines' placement
        groups at once; they start when `grow` finds them granted."""
        spec = with_model_len(job)
        engine, reason = resolve_engine(spec, job.policy.model)
        log.info("generation engine: %s (%s)", engine, reason)
        placement = spec.placement
        group = ActorGroup(GenerationWorker, "generation", placement.replicas,
                           Slots.of(placement, placement_group, bundle_indices,
                                    env_vars=engine_env(engine, spec, threads(placement))),
                           kwargs={"model": job.policy.model.model_dump(), "generation": spec.model_dump(),
                                   "engine": engine, "tokens": tokens, "max_staleness": job.ppo.max_staleness},
                           timeouts=Timeouts.of(job.cluster),
                           threads={"weights": Thread(WEIGHT_CALLS),
                                    "rollouts": Thread(("rollout",), ROLLOUTS_AT_ONCE)} if spec.partial_rollouts else None)
        extra = None
        if placement.elastic:
            bundle = {"CPU": placement.num_cpus} | ({"GPU": placement.num_gpus} if placement.num_gpus else {})
            extra = ExtraEngines(placement.max_replicas - placement.replicas, bundle, placement.max_replicas,
                                 minimum=placement.replicas)
            extra.ask()
        if wait:
            group.wait_ready(job.cluster.startup_timeout_s)
        return cls(group, engine, budget or RestartBudget(job.cluster.max_actor_restarts), extra)

    def grow(self) -> list[str]:
        """An elastic pool: an engine on each placement group Ray granted since the last call, and on each vacant
        bundle of the job's own group Ray has placed again, loaded with the current weights before it takes a
        request. Returns the engines that joined (none without `max_replicas`). One that fails to start on a
        granted group gives it back and asks again; on a bundle of the job's group it counts as a restart, as in
        a fixed pool, and the bundle is tried again next time."""
        if self.extra is None:
            return []
        joined = []
        for pg, bundle in self.extra.placed_again():
            rank = None
            try:
                rank = self.group.add(pg, bundle)  # a failed start is not kept
                self.on_replaced(rank)
            except (ActorDiedError, ActorCallTimeout, RemoteCallError) as err:
                log.warning("an engine did not start on its bundle, placed again: %s", str(err).splitlines()[0])
                if rank is not None:
                    self.group.drop(rank)
                self.extra.vacant.append((pg, bundle))
                self.budget.spend(err)
                continue
            joined.append(self.group.names[rank])
            log.info("%s joined the generation pool on the job's bundle %d (%d engines now)",
                     self.group.names[rank], bundle, len(self.group))
        self._note_base_nodes()
        for pg in self.extra.granted():
            rank = None
            try:
                rank = self.group.add(pg)  # a failed start is not kept
                name = self.group.names[rank]
                (node,) = gather([self.group.actors[rank].__ray_call__.remote(_node_id)], [name],
                                 self.group.call_timeout_s, "node id")
                self.on_replaced(rank)
            except (ActorDiedError, ActorCallTimeout, RemoteCallError) as err:
                log.warning("an engine on a granted placement group did not start or load the weights; asking for "
                            "another group: %s", str(err).splitlines()[0])
                if rank is not None:
                    self.group.drop(rank)
                self.extra.give_back(pg, failed_start=True)
                continue
            self.extra.hold(name, pg, node)
            joined.append(name)
            log.info("%s joined the generation pool (%d engines now)", name, len(self.group))
        return joined

    def _note_base_nodes(self) -> None:
        """Record the node of each engine on the job's own placement group not recorded yet."""
        for rank, name in enumerate(self.group.names):
            if self.extra.holds(name) or name in self.base_nodes:
                continue
            try:
                (self.base_nodes[name],) = gather([self.group.actors[rank].__ray_call__.remote(_node_id)], [name],
                                                  self.group.call_timeout_s, "node id")
            except (ActorDiedError, ActorCallTimeout, RemoteCallError):
                pass  # not recorded: the next call to it meets the death (replaced, as in a fixed pool)

    def _shards(self, prompts: list[list[int]], seed: int, greedy: bool) -> tuple[list[int], list[tuple]]:
        """The prompts cut into contiguous, balanced slices, each with its seed: one per engine; in an elastic pool
        always max_replicas, dealt to the engines present (`_assign`), so that which engines answer changes nothing
        in the samples."""
        k = len(self.group) if self.extra is None else self.extra.slices
        bounds = [round(i * len(prompts) / k) for i in range(k + 1)]
        return bounds, [(prompts[bounds[i]: bounds[i + 1]], stable_seed(seed, "engine", i), greedy) for i in range(k)]

    def resync(self, rank: int) -> None:
        """A replacement engine starts from the model files (version 0); bring it to the current version."""
        if self.weights is not None:
            refs, version = self.weights
            gather([self.group.bound(self.group.actors[rank], "load_weights").remote(refs, version)],
                   [self.group.names[rank]],
                   self.group.call_timeout_s, "load_weights")
            log.info("%s re-synced to policy version %d", self.group.names[rank], version)

    def _call(self, method: str, per_rank_args: list[tuple], refs: list | None = None, names: list[str] | None = None,
              redo: bool = True) -> list:
        """Each engine's call (rank order); an engine that died is replaced and asked again (resilient_gather). In an
        elastic pool an extra engine whose node left is dropped instead: its share goes to the engine with the
        fewest shares so far when `redo` (prompts), or is left out of the results (weights). `refs` and `names`:
        calls made earlier (a submitted rollout) and the engines they were made on."""
        if self.extra is None:
            if refs is None:
                refs = [self.group.bound(a, method).remote(*args) for a, args in zip(self.group.actors, per_rank_args)]
            return resilient_gather(self.group, method, per_rank_args, refs, self.budget,
                                    lambda rank: self.on_replaced(rank))
        if refs is None:
            names, refs = self._start(method, per_rank_args)
        return self._elastic_call(method, per_rank_args, refs, names, redo)

    def _start(self, method: str, per_share_args: list[tuple]) -> tuple[list[str], list]:
        """An elastic pool's calls: share i to engine i mod the engines present. Returns (engines, call refs)."""
        names = [self.group.names[i % len(self.group)] for i in range(len(per_share_args))]
        actors = dict(zip(self.group.names, self.group.actors))
        return names, [self.group.bound(actors[name], method).remote(*args) for name, args in zip(names, per_share_args)]

    def _elastic_call(self, method: str, per_share_args: list[tuple], refs: list, names: list[str], redo: bool) -> list:
        """Each share's result, in share order. A share whose engine died is asked again: of a replacement (the
        restart budget's), of another engine where an extra engine's node left (dropped: no restart spent), or
        not at all for weights (`redo` false). Shares on an engine that was replaced meanwhile go to its
        replacement."""
        lost: set[str] = set()
        results: dict[int, object] = {}
        given = Counter(names)  # shares each engine was given
        actors = dict(zip(self.group.names, self.group.actors))
        pending = [(share, name, actors.get(name), ref) for share, (name, ref) in enumerate(zip(names, refs))]
        while pending:
            share, runner, actor, ref = pending.pop(0)
            try:
                results[share] = gather([ref], [runner], self.group.call_timeout_s, method)[0]
                continue
            except (ActorDiedError, ActorCallTimeout) as err:
                current = dict(zip(self.group.names, self.group.actors))
                if runner not in current:  # dropped since the call was made
                    lost.add(runner)
                elif current[runner] is not actor:  # replaced since: its replacement answers
                    pass
                elif isinstance(err, ActorDiedError) and self.extra.holds(runner) and (
                        node_lost(err) or self.extra.node_left(runner)):
                    lost.add(runner)
                    log.warning("%s left with its node; dropping it from the generation pool", runner)
                    self._drop(runner)
                elif (isinstance(err, ActorDiedError) and runner in self.base_nodes
                      and len(self.group) > self.extra.minimum
                      and self.group.places[self.group.names.index(runner)][0] is not None
                      and (node_lost(err) or node_gone(self.base_nodes[runner]))):
                    lost.add(runner)
                    log.warning("%s left with its node; the pool stays above its minimum (%d), so it is dropped; "
                                "an engine starts on its bundle once Ray places it again", runner,
                                self.extra.minimum)
                    self._vacate(runner)
                else:
                    self.budget.spend(err)
                    self.base_nodes.pop(runner, None)  # its replacement may start elsewhere
                    rank = self.group.names.index(runner)
                    self.group.replace(rank)
                    self.on_replaced(rank)
            if runner in lost:
                if not redo:
                    continue
                runner = min(self.group.names, key=lambda n: (given[n], self.group.names.index(n)))
                given[runner] += 1
            actor = self.group.actors[self.group.names.index(runner)]
            pending.insert(0, (share, runner, actor, self.group.bound(actor, method).remote(*per_share_args[share])))
        return [results[share] for share in sorted(results)]

    def _vacate(self, name: str) -> None:
        """Remove an engine of the job's own placement group that left with its node; its bundle waits in
        `extra.vacant` until Ray places it again (`grow`)."""
        rank = self.group.names.index(name)
        self.extra.vacant.append(self.group.places[rank])
        del self.base_nodes[name]
        self.group.drop(rank)
        log.info("generation pool: %d engines now", len(self.group))
        self.on_dropped()

    def _drop(self, name: str) -> None:
        """Remove an engine that left with its node; its group is given back and asked for again."""
        self.extra.release(name)
        self.group.drop(self.group.names.index(name))
        log.info("generation pool: %d engines now", len(self.group))
        self.on_dropped()

    def generate(self, prompts: list[list[int]], seed: int, greedy: bool = False,
                 columns: list[dict] | None = None) -> list[RolloutSample]:
        """All samples, in prompt order, brought to the caller (evaluation; training uses `submit`). `columns`
        (one dict per prompt) reach the engines' environments, when there are any."""
        bounds, args = self._shards(prompts, seed, greedy)
        if columns is not None:
            args = [(*a, columns[bounds[i]: bounds[i + 1]]) for i, a in enumerate(args)]
        merged = []
        for i, rows in enumerate(self._call("generate", args)):
            merged += [{**row, "prompt_index": row["prompt_index"] + bounds[i]} for row in rows]
        return merged

    def submit(self, prompts: list[list[int]], seed: int, columns: list[dict] | None = None,
               keys: list[int] | None = None) -> PendingRollout:
        """Start a rollout without waiting (async mode overlaps it with training); `collect` its result. `columns`
        (one dict per prompt) ride along with each prompt's samples; `keys` (one per prompt) name the prompts
        answered in the result."""
        bounds, args = self._shards(prompts, seed, False)
        args = [(*a[:2], None if columns is None else columns[bounds[i]: bounds[i + 1]],
                 None if keys is None else keys[bounds[i]: bounds[i + 1]]) for i, a in enumerate(args)]
        if self.extra is not None:
            names, refs = self._start("rollout", args)
            return PendingRollout(args, refs, names)
        return PendingRollout(args, [self.group.bound(actor, "rollout").remote(*a)
                                     for actor, a in zip(self.group.actors, args)], list(self.group.names))

    def finished(self, pending: PendingRollout) -> bool:
        """Whether every engine has finished its part of a submitted rollout (`collect` would not wait)."""
        done, _ = ray.wait([answer_of(call) for call in pending.refs], num_returns=len(pending.refs), timeout=0)
        return len(done) == len(pending.refs)

    def collect(self, pending: PendingRollout) -> Rollout:
        """The submitted rollout, once every engine has answered its share (an engine that died meanwhile is
        replaced and answers again; an elastic pool's engine whose node left: another answers its share)."""
        parts: list[RolloutPart] = self._call("rollout", pending.args, pending.refs, pending.names)
        return Rollout(refs=[p.ref for p in parts], version=min(p.version for p in parts),
                       samples=sum(p.samples for p in parts), tokens=sum(p.tokens for p in parts),
                       engine_seconds=max(p.seconds for p in parts),
                       engine_busy_seconds=sum(p.seconds for p in parts),
                       prompt_keys=[k for p in parts for k in p.keys],
                       streamed_groups=sum(p.streamed for p in parts),
                       restarted_answers=sum(p.restarted for p in parts),
                       episodes={k: sum(p.episodes[k] for p in parts if p.episodes)
                                 for k in EPISODE_COLUMNS if any(p.episodes for p in parts)},
                       engines=len(set(pending.names) & set(self.group.names)))

    def broadcast(self, bucket_refs: list, version: int) -> EnginesLoaded:
        """Every engine loads the same buckets (object refs; the driver never holds the tensors)."""
        start = time.perf_counter()
        self.weights = (bucket_refs, version)
        results: list[Loaded] = self._call("load_weights", [(bucket_refs, version)] * len(self.group), redo=False)
        stale = [name for name, r in zip(self.group.names, results) if r.version != version]
        if stale:
            raise RuntimeError(f"{', '.join(stale)} did not reach policy version {version}")
        return EnginesLoaded(time.perf_counter() - start, max(r.seconds for r in results))

    def take(self, part, version: int, ranks: list[int] | None = None) -> list[Loaded]:
        """Every engine (or those of `ranks`) loads one part of a colocated handoff from the learner's memory."""
        if ranks is None:
            return self._call("take_weights", [(part, version)] * len(self.group))
        return gather([self.group.bound(self.group.actors[r], "take_weights").remote(part, version) for r in ranks],
                      [self.group.names[r] for r in ranks], self.group.call_timeout_s, "take_weights")

    def receive(self, version: int) -> list:
        """Every engine starts receiving a collective broadcast (returns the call refs)."""
        return [self.group.bound(actor, "receive_weights").remote(version) for actor in self.group.actors]

    def sleep(self) -> None:
        """vLLM engines on GPUs with `vllm.sleep_when_idle` release their memory until the next call wakes them
        (so colocated learners can train); elsewhere nothing happens."""
        self.group.call("sleep")

    def versions(self) -> list[int]:
        return self.group.call("get_version")

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """End every engine: each first releases what it holds outside its process (vLLM's files and shared
        memory, `GenerationEngine.close`), then every process is killed, those that are dead, hung or slower than
        `timeout_s` too; an elastic pool's own placement groups are removed."""
        with contextlib.suppress(Exception):
            self.group.call("close", timeout=timeout_s)
        self.group.kill()
        if self.extra is not None:
            self.extra.close()


def _node_id(_actor) -> str:
    """Run in an actor (`__ray_call__`): the id of its node."""
    return ray.get_runtime_context().get_node_id()
