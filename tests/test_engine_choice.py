"""Pure pieces of the generation side: weight buckets, the engine `auto` rule, engine processes' environment."""

from __future__ import annotations

import pytest
import torch

from rlhf_ray.actors import engine as engine_mod
from rlhf_ray.actors.engine import engine_env
from rlhf_ray.models import support
from rlhf_ray.models.support import resolve_engine
from rlhf_ray.actors.vllm_engine import engine_kwargs
from rlhf_ray.config.generation import GenerationSpec
from rlhf_ray.config.model import ModelSpec
from rlhf_ray.models.weight_buckets import group_by_size, pack, unpack


def test_buckets_round_trip_names_shapes_and_dtypes():
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5)), ("c", torch.randn(2, 2).to(torch.bfloat16)),
             ("d", torch.randn(1, 2, 3).to(torch.bfloat16)), ("e", torch.randn(7))]
    buckets = pack(named)
    assert [b.names for b in buckets] == [["a", "b"], ["c", "d"], ["e"]]  # one dtype per bucket, order kept
    assert sum(b.nbytes for b in buckets) == sum(t.numel() * t.element_size() for _, t in named)
    out = [pair for b in buckets for pair in unpack(b)]
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, got), (_, want) in zip(out, named):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_group_by_size_keeps_order_and_bounds_groups():
    sizes = [("a", 40), ("b", 40), ("c", 30), ("d", 200), ("e", 10)]
    assert list(group_by_size(sizes, 100)) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert list(group_by_size(sizes, 10**6)) == [["a", "b", "c", "d", "e"]]


def spec(**kwargs) -> GenerationSpec:
    return GenerationSpec.model_validate(kwargs)


def test_auto_picks_vllm_on_gpus_and_by_model_size_on_cpu(tiny_model, monkeypatch):
    model = ModelSpec(path=str(tiny_model), dtype="fp32")
    assert resolve_engine(spec(engine="hf"), model) == ("hf", "set in the config")
    assert resolve_engine(spec(placement={"num_gpus": 1}), model)[0] == "vllm"
    engine, reason = resolve_engine(spec(), model)
    assert engine == "hf" and "M-parameter model" in reason
    assert resolve_engine(spec(auto_vllm_min_params=1000), model)[0] == "vllm"
    monkeypatch.setattr(support, "vllm_installed", lambda: False)
    assert resolve_engine(spec(auto_vllm_min_params=1000), model) == ("hf", "vLLM is not installed")


def test_parameter_count_from_config_is_close_to_the_real_one(tiny_model):
    from transformers import AutoModelForCausalLM

    real = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert support.model_parameters(str(tiny_model)) == pytest.approx(real, rel=0.02)


def test_vllm_engines_get_threads_and_no_core_pinning_on_cpu():
    env = engine_env("vllm", spec(vllm={"kv_cache_gb": 2}), threads=3)
    assert env["OMP_NUM_THREADS"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "VLLM_CPU_KVCACHE_SPACE" not in env
    fraction = spec(vllm={"kv_cache_gb": 0.25, "tensor_parallel_size": 2})
    assert engine_kwargs(ModelSpec(path="m"), fraction, on_gpu=False)["kv_cache_memory_bytes"] == 2**27  # per worker
    assert engine_env("vllm", fraction, threads=4)["OMP_NUM_THREADS"] == "2"  # each worker half the CPUs
    if engine_mod.intel_openmp_library():
        assert "libiomp5.so" in env["LD_PRELOAD"]
    assert "LD_PRELOAD" not in engine_env("vllm", spec(vllm={"preload_intel_openmp": False}), 1)
    assert engine_env("hf", spec(), threads=2) == {"OMP_NUM_THREADS": "2"}


def test_vllm_dtype_is_the_policys_unless_set():
    fp32 = ModelSpec(path="m", dtype="fp32")
    assert engine_kwargs(fp32, spec(), on_gpu=False)["dtype"] == "float32"  # never bf16 behind the user's back
    assert engine_kwargs(fp32, spec(), on_gpu=True)["dtype"] == "float32"
    assert engine_kwargs(ModelSpec(path="m", dtype="bf16"), spec(), on_gpu=True)["dtype"] == "bfloat16"
    assert engine_kwargs(fp32, spec(vllm={"dtype": "bf16"}), on_gpu=False)["dtype"] == "bfloat16"
    cpu = engine_kwargs(fp32, spec(vllm={"kv_cache_gb": 0.5, "extra": {"max_num_seqs": 8}}), on_gpu=False)
    assert cpu["enforce_eager"] is True and cpu["kv_cache_memory_bytes"] == 2**29 and cpu["max_num_seqs"] == 8
    assert cpu["block_size"] == 32
    gpu = engine_kwargs(fp32, spec(vllm={"gpu_memory_utilization": 0.5}), on_gpu=True)
    assert gpu["enforce_eager"] is False and gpu["gpu_memory_utilization"] == 0.5
    assert "block_size" not in gpu
    assert engine_kwargs(fp32, spec(vllm={"block_size": 64}), on_gpu=True)["block_size"] == 64



def test_weight_sync_reads_in_place_where_engines_sit_with_the_policy_and_over_nccl_only_on_gpus_of_their_own():
    """Engines on policy rank 0's node (CPU) or GPU (fractional bundles, configs/recipes/opt-1.3b-single-gpu.yaml)
    read its memory (ipc); one GPU shared by fractional bundles cannot host an NCCL group, so an explicit
    `collective` is refused there by name, and an explicit `ipc` where an engine is elsewhere."""
    from rlhf_ray.jobs.ppo.weight_sync import choose_transport, why_transport
    from rlhf_ray.models.weight_transport import gpus_shared

    one_gpu = {"policy-0": ("node-a", [0]), "generation-0": ("node-a", [0])}
    own_gpus = {"policy-0": ("node-a", [0]), "generation-0": ("node-a", [1]), "generation-1": ("node-b", [0])}
    tensor_parallel = {"policy-0": ("node-a", [0]), "generation-0": ("node-a", [1, 2]),
                       "generation-1": ("node-a", [2, 3])}
    cpu = {"policy-0": ("node-a", []), "generation-0": ("node-a", []), "generation-1": ("node-a", [])}
    two_nodes_cpu = {"policy-0": ("node-a", []), "generation-0": ("node-a", []), "generation-1": ("node-b", [])}
    half_shared = {"policy-0": ("node-a", [0]), "generation-0": ("node-a", [0]), "generation-1": ("node-a", [1])}
    assert gpus_shared(one_gpu) == ["policy-0 and generation-0 share GPU 0 of node node-a"]
    assert gpus_shared(own_gpus) == [] and gpus_shared(cpu) == []
    assert gpus_shared(tensor_parallel) == ["generation-0 and generation-1 share GPU 2 of node node-a"]
    chosen = {name: choose_transport("auto", members) for name, members in
              [("one_gpu", one_gpu), ("own_gpus", own_gpus), ("tensor_parallel", tensor_parallel), ("cpu", cpu),
               ("two_nodes_cpu", two_nodes_cpu), ("half_shared", half_shared)]}
    assert chosen == {"one_gpu": "ipc", "own_gpus": "collective", "tensor_parallel": "object_store", "cpu": "ipc",
                      "two_nodes_cpu": "object_store", "half_shared": "object_store"}
    assert why_transport("object_store", "auto", two_nodes_cpu) == (
        "generation-1 on another node than policy-0 (ipc shares memory within one node), and not every member has a "
        "GPU of its own for a collective")
    assert why_transport("ipc", "auto", cpu) == "every engine is on the node of policy-0"
    assert choose_transport("object_store", cpu) == "object_store"
    assert choose_transport("collective", two_nodes_cpu) == "collective"  # gloo: sharing a CPU is fine
    with pytest.raises(ValueError, match=r"weight_sync.transport: collective .*policy-0 and generation-0 share GPU 0"):
        choose_transport("collective", one_gpu)
    with pytest.raises(ValueError, match=r"transport: ipc needs every engine on the node of policy-0, but "
                                         r"generation-1 is elsewhere"):
        choose_transport("ipc", two_nodes_cpu)
    with pytest.raises(ValueError, match=r"ipc needs every engine on the GPU \[0\] of policy-0, but generation-1"):
        choose_transport("ipc", half_shared)


def test_tensor_parallel_engines_take_one_gpu_per_worker_or_share_cpus():
    assert spec(engine="vllm", vllm={"tensor_parallel_size": 2}).placement.num_gpus == 0  # CPU: worker processes
    assert spec(engine="vllm", vllm={"tensor_parallel_size": 2}, placement={"num_gpus": 2})
    with pytest.raises(ValueError, match="needs 2 GPUs per replica, but placement.num_gpus is 1"):
        spec(engine="vllm", vllm={"tensor_parallel_size": 2}, placement={"num_gpus": 1})
    with pytest.raises(ValueError, match="the hf engine has no tensor parallelism"):
        spec(engine="hf", vllm={"tensor_parallel_size": 2})


def test_an_elastic_pool_never_reads_policy_memory_and_refuses_what_would_strand_a_joining_engine():
    """An engine that joins an elastic pool (generation.placement.max_replicas) may land on any node, so auto does
    not choose ipc even where the first engines sit with policy rank 0; the settings a joining or leaving engine
    cannot honour are refused at their field."""
    from rlhf_ray.jobs.ppo.weight_sync import choose_transport, why_transport

    cpu = {"policy-0": ("node-a", []), "generation-0": ("node-a", [])}
    assert choose_transport("auto", cpu) == "ipc" and choose_transport("auto", cpu, elastic=True) == "object_store"
    assert "elastic" in why_transport("object_store", "auto", cpu, elastic=True)
    own_gpus = {"policy-0": ("node-a", [0]), "generation-0": ("node-b", [0])}
    assert choose_transport("auto", own_gpus, elastic=True) == "collective"
    assert spec(placement={"replicas": 1, "max_replicas": 3}).placement.elastic
    assert not spec(placement={"replicas": 2, "max_replicas": 2}).placement.elastic
    with pytest.raises(ValueError, match=r"max_replicas\b.*1 is fewer than replicas \(2\)"):
        spec(placement={"replicas": 2, "max_replicas": 1})
    for refused, match in [({"weight_sync": {"transport": "ipc"}}, "cannot read the weights in policy rank 0's"),
                           ({"partial_rollouts": True}, "answers stay in flight on an engine"),
                           ({"placement": {"max_replicas": 3, "colocate_with": "policy"}}, "placement groups of their own")]:
        with pytest.raises(ValueError, match=match):
            spec(**({"placement": {"max_replicas": 3}} | refused))


def test_a_vllm_engine_starts_with_the_heap_of_its_imports_frozen(tiny_model, monkeypatch):
    """vLLM's start runs full garbage collections over every object its process holds (1.2 of the 6.8 CPU-seconds an
    engine of the tiny model took to start): the engine freezes the heap of its imports before calling vLLM, so the
    collections skip it."""
    import gc
    import sys
    import types

    from rlhf_ray.actors.vllm_engine import VLLMEngine
    from rlhf_ray.data.tokens import TokenConventions

    class Started(Exception):
        pass

    def llm(**kwargs):
        raise Started(gc.get_freeze_count())

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=llm))
    gc.unfreeze()
    try:
        with pytest.raises(Started) as started:
            VLLMEngine(ModelSpec(path=str(tiny_model)), GenerationSpec(), TokenConventions("tiny", eos_id=1, stop_ids=(1,), pad_id=0))
    finally:
        gc.unfreeze()
    assert started.value.args[0] > 10_000  # the objects of torch, transformers and the rest, frozen
