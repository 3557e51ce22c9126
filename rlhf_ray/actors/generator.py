"""A generation engine replica (Ray actor): one engine (transformers or vLLM, see engine.py), the policy version
its weights belong to, and the receiving end of weight broadcasts."""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from dataclasses import dataclass, field

import ray
import torch

from rlhf_ray.actors.engine import GenerationEngine, RolloutSample
from rlhf_ray.actors.partial_rollout import PartialRollouts, samples_of
from rlhf_ray.actors.update_gate import HOLD_ENV, UpdateGate, hold_point
from rlhf_ray.config.generation import ENGINES, GenerationSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.envs.episode import EPISODE_COLUMNS
from rlhf_ray.models.weight_buckets import unpack
from rlhf_ray.models.weight_handoff import HandoffPart, received
from rlhf_ray.memory.probe import PeakMemory


def build_engine(model: ModelSpec, spec: GenerationSpec, tokens: TokenConventions, engine: str) -> GenerationEngine:
    """The engine named by `engine`: an ENGINES name ("hf", "vllm"; `resolve_engine` turns "auto" into one of
    them) or `package.module:Class`."""
    path = ENGINES.get(engine, engine)
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"unknown generation engine {engine!r}; expected one of {', '.join(ENGINES)} or "
                         "'package.module:Class'")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, GenerationEngine)):
        raise TypeError(f"generation engine {engine!r} is not a GenerationEngine subclass (rlhf_ray/actors/engine.py)")
    return cls(model, spec, tokens)


@dataclass
class RolloutPart:
    """One engine's answer to `GenerationWorker.rollout`: its samples stay in the object store."""

    ref: object
    """ObjectRef of the samples (list[RolloutSample]); set by `gather`."""
    samples: int
    keys: list
    """The caller's key of each prompt answered, one per group in sample order."""
    version: int
    """The policy version of its oldest token."""
    tokens: int
    """Answer tokens generated (those the policy wrote: tool output excluded)."""
    seconds: float
    """Generation time."""
    streamed: int = 0
    """Partial rollouts: groups whose prompts another call brought."""
    restarted: int = 0
    """Partial rollouts: answers in flight started again meanwhile, their first token too old."""
    episodes: dict[str, float] = field(default_factory=dict)
    """Multi-turn episodes' totals (EPISODE_COLUMNS) over its samples; empty without an environment."""


@dataclass
class Loaded:
    """An engine's answer to a weight update (load_weights, receive_weights, take_weights)."""

    version: int
    """The policy version it serves now."""
    tensors: int
    """Tensors loaded."""
    seconds: float


class GenerationWorker:
    def __init__(self, *, rank: int, world_size: int, model: dict, generation: dict, engine: str,
                 tokens: TokenConventions, max_staleness: int | None = None):
        if engine == "vllm":  # the library's own import is runtime, as torch's is: not what the engine holds
            importlib.import_module("vllm")
        self.memory = PeakMemory()  # before the engine: its peak counts the weights, the KV cache and the rest
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.rank = rank
        self.spec = GenerationSpec.model_validate(generation)
        model_spec = ModelSpec.model_validate(model)
        self.engine = build_engine(model_spec, self.spec, tokens, engine)
        self.version = 0
        self.gate = UpdateGate() if self.spec.partial_rollouts else None
        """partial_rollouts: weight updates arrive in a thread of their own and take the engine between tokens."""
        self.partial = None if self.gate is None else PartialRollouts(
            self.engine, self.spec.sampling, self.gate, lambda: self.version, max_staleness=max_staleness,
            hold=hold_point(os.environ.get(HOLD_ENV)))
        """partial_rollouts: rollouts run together and return their first whole groups (partial_rollout.py)."""
        self.episodes = None
        if self.spec.environment is not None:
            from rlhf_ray.envs.episode import EpisodeRunner
            from rlhf_ray.models.loading import load_tokenizer

            self.episodes = EpisodeRunner(self.spec.environment, load_tokenizer(model_spec), tokens,
                                          self.spec.sampling)

    def peak_memory(self) -> dict:
        """This engine's peak memory above what its process held before the engine (memory/probe.py)."""
        return self.memory.peak()

    def generate(self, prompts: list[list[int]], seed: int, greedy: bool = False,
                 columns: list[dict] | None = None) -> list[RolloutSample]:
        """Samples of `prompts` (see GenerationEngine.generate) with the versions that wrote them; with an
        environment, one multi-turn episode per sample
        (envs/episode.py), its prompt the environment's first messages and its statistics in `episode`. With
        partial rollouts a weight update gets the engine between tokens (between turns, for episodes)."""
        if self.episodes is not None:
            with self.gate.generation() if self.gate is not None else contextlib.nullcontext():
                samples = self.episodes.play(self.engine, prompts, columns, seed, greedy, self._turn_version)
        elif self.partial is not None:
            samples = self.partial.generate(prompts, seed, greedy)
        else:
            samples = [{**s, "versions": [self.version] * len(s["answer_ids"])}
                       for s in self.engine.generate(prompts, self.spec.sampling, seed, greedy)]
        return [{**s, "version": min(s["versions"], default=self.version)} for s in samples]

    def _turn_version(self) -> int:
        """Before an episode's turn: a weight update that waits loads first (partial rollouts); the version the
        turn samples with."""
        if self.gate is not None and self.gate.requested:
            self.gate.pause()
        return self.version

    @ray.method(num_returns=2)
    def rollout(self, prompts: list[list[int]], seed: int, columns: list[dict] | None = None,
                keys: list[int] | None = None) -> tuple[list[RolloutSample], RolloutPart]:
        """`generate`, but the samples stay in the object store (payload.py): the caller gets a summary, with
        the `keys` of the prompts answered (the caller's, one per prompt; default their positions), one per group
        in sample order. Each sample carries its prompt's dataset `columns` (for reward functions), and an
        episode's statistics. With partial rollouts (no environment) the groups are the first to finish among those
        in flight, this call's prompts or other calls'."""
        start = time.perf_counter()
        keys, counts = list(range(len(prompts))) if keys is None else keys, {"streamed": 0, "restarted": 0}
        if self.partial is not None and self.episodes is None:
            groups, counts, seconds = self.partial.rollout(prompts, seed, columns, keys)
            samples = [{**s, "version": min(s["versions"], default=self.version), "columns": g.columns or {}}
                       for g in groups for s in samples_of([g])]
            keys = [g.key for g in groups]
        else:
            samples = self.generate(prompts, seed, columns=columns)
            if columns is not None or self.episodes is not None:
                samples = [{**s, "columns": {**(columns[s["prompt_index"]] if columns else {}),
                                             **s.get("episode", {})}} for s in samples]
            seconds = time.perf_counter() - start
        episodes = [s["episode"] for s in samples if "episode" in s]
        return samples, RolloutPart(None, len(samples), keys,
                           version=min((s["version"] for s in samples), default=self.version),
                           tokens=sum(sum(s.get("answer_mask") or [1] * len(s["answer_ids"])) for s in samples),
                           seconds=seconds, streamed=counts["streamed"], restarted=counts["restarted"],
                           episodes={k: sum(e[k] for e in episodes) for k in EPISODE_COLUMNS} if episodes else {})

    def load_weights(self, bucket_refs: list, version: int) -> Loaded:
        """Fetch the buckets one by one from the object store and load them in place; then this engine serves
        policy `version`."""
        start = time.perf_counter()

        def stream():
            for ref in bucket_refs:
                yield from unpack(ray.get(ref))

        with self._updating():
            tensors = self.engine.load_weights(stream())
            self.version = version
        return Loaded(version, tensors, time.perf_counter() - start)

    def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> int:
        from rlhf_ray.models.weight_transport import WeightBroadcast

        self.weight_broadcast = WeightBroadcast(host, port, rank, world_size, timeout_s)
        return rank

    def receive_weights(self, version: int) -> Loaded:
        """Load the buckets learner rank 0 broadcasts, as they arrive; then this engine serves `version`."""
        start = time.perf_counter()
        with self._updating():
            tensors = self.engine.load_weights(self.weight_broadcast.receive())
            self.version = version
        return Loaded(version, tensors, time.perf_counter() - start)

    def take_weights(self, part: HandoffPart, version: int) -> Loaded:
        """Load one part of a colocated handoff (transport ipc) from the learner's memory: its shared-memory files
        mapped, or its GPU buffers opened; this engine serves `version` once the driver has given it every part."""
        start = time.perf_counter()
        with self._updating(last=part.last):  # a rollout waits until the last part is in
            tensors = self.engine.load_weights(received(part), complete=False)
            if part.cuda:
                torch.cuda.synchronize()  # copied before the learner frees the buffers
            self.version = version
        return Loaded(version, tensors, time.perf_counter() - start)

    def _updating(self, last: bool = True):
        """The engine for a weight update: at once, or (partial_rollouts) when the running rollout pauses."""
        return self.gate.update(last) if self.gate is not None else contextlib.nullcontext()

    def get_version(self) -> int:
        return self.version

    def engine_name(self) -> str:
        return self.engine.name

    def sleep(self) -> None:
        """Release engine memory until the next generate or weight load (vLLM on GPUs; a no-op elsewhere)."""
        getattr(self.engine, "sleep", lambda: None)()

    def close(self) -> None:
        """The job's end: the engine releases what it holds outside this process (the process is killed next)."""
        if self.partial is not None:
            self.partial.close()
        self.engine.close()
