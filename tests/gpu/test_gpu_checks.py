"""GPU checks (issue #19, item 7): what CPU tests cannot show, ready for any machine with CUDA GPUs. CI has none
and skips them all; run them whenever a GPU is lent, and write the results in docs/benchmarks.md ("GPU checks"):

    pytest tests/gpu -q -rs                                  # one GPU: the first and the last check run
    python benchmarks/bench_memory_model.py --device gpu     # memory model: predicted against the CUDA allocator

- PPO with every role on one GPU (fractional bundles) and vLLM engines: after each weight sync the engines decode
  exactly like the learner; the weights are handed over by CUDA IPC (the transport `auto` picks ipc where the
  policy and the engines share the GPU: NCCL cannot join two processes on one device).
- The CUDA IPC handoff itself between two processes on one GPU: every byte arrives (models/weight_handoff.py).
- NCCL weight sync between a policy and engines on GPUs of their own (two GPUs or more).
- A tensor-parallel engine (tensor_parallel_size 2) receiving updates (two GPUs or more).
- vLLM sleep / wake (`vllm.sleep_when_idle`): engines free their GPU memory while the learners train on the same
  GPU and wake with the new weights.
- The same one-GPU PPO with the HF engine (`generation.engine: hf`; needs no vLLM).

Each check is the CPU weight-sync test (tests/test_ppo_job.py) with GPU placements: same models, same assertion
(greedy decoding of the engines equals the learner's own copy after every sync).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_ppo_job import engines_decode_like_the_learner

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.system, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU (CI has none)")]

ONE_GPU = ["policy.placement.num_gpus=0.2", "critic.placement.num_gpus=0.2", "generation.placement.num_gpus=0.3",
           "generation.engine=vllm", "generation.vllm.gpu_memory_utilization=0.25", "generation.vllm.dtype=fp32",
           "policy.placement.replicas=1", "generation.placement.replicas=1", "cluster.num_gpus=1"]
"""Every role on one GPU: one policy rank (two DeepSpeed ranks on one GPU would be two NCCL ranks on one device)."""


def test_every_role_on_one_gpu_engines_decode_like_the_learner(tmp_path, sft_model, rm_model):
    run = engines_decode_like_the_learner(tmp_path, sft_model, rm_model, *ONE_GPU,
                                          "generation.weight_sync.transport=auto")
    assert run["transport"] == "ipc"  # auto saw the policy and the engine share the GPU


def _receive_on_the_same_gpu(parts, results) -> None:
    """Another process: open each handed-over bucket, copy it into memory of its own, report checksums."""
    from rlhf_ray.models.weight_handoff import received

    torch.cuda.set_device(0)
    while (part := parts.get()) is not None:
        sums = {name: float(t.double().sum()) for name, t in received(part)}
        torch.cuda.synchronize()
        results.put(sums)


def test_cuda_ipc_handoff_between_two_processes_on_one_gpu():
    import torch.multiprocessing as mp

    from rlhf_ray.models.weight_handoff import HandoffSender

    torch.manual_seed(0)
    weights = [(f"model.layers.{i}.w", torch.randn(1024, 1024, device="cuda", dtype=torch.float16)) for i in range(8)]
    ctx = mp.get_context("spawn")
    parts, results = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_receive_on_the_same_gpu, args=(parts, results))
    receiver.start()
    try:
        got = {}
        for part in HandoffSender().parts([weights[:4], weights[4:]]):
            assert part.cuda and not part.files and part.nbytes == 4 * 1024 * 1024 * 2
            parts.put(part)
            got.update(results.get(timeout=120))  # the bucket stays alive until the receiver has copied it
        parts.put(None)
        assert got == {name: float(t.double().sum()) for name, t in weights}
    finally:
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()


@pytest.mark.skipif(GPUS < 2, reason="NCCL needs the policy and the engine on GPUs of their own: two GPUs")
def test_nccl_weight_sync_between_gpus(tmp_path, sft_model, rm_model):
    run = engines_decode_like_the_learner(
        tmp_path, sft_model, rm_model, *ONE_GPU, "policy.placement.num_gpus=1", "generation.placement.num_gpus=1",
        "critic.placement.num_gpus=0", f"cluster.num_gpus={GPUS}", "generation.weight_sync.transport=collective",
        "generation.weight_sync.bucket_mb=0.0625")
    assert run["transport"] == "collective"


@pytest.mark.skipif(GPUS < 2, reason="a tensor-parallel engine over two GPUs")
def test_tensor_parallel_engine_receives_updates(tmp_path, sft_model, rm_model):
    engines_decode_like_the_learner(
        tmp_path, sft_model, rm_model, *ONE_GPU, "policy.placement.num_gpus=0", "critic.placement.num_gpus=0",
        "generation.placement.num_gpus=2", "generation.vllm.tensor_parallel_size=2", f"cluster.num_gpus={GPUS}",
        "generation.weight_sync.transport=object_store", "generation.weight_sync.bucket_mb=0.0625")


def test_engines_sleep_while_learners_train_and_wake_with_the_new_weights(tmp_path, sft_model, rm_model):
    engines_decode_like_the_learner(tmp_path, sft_model, rm_model, *ONE_GPU, "generation.vllm.sleep_when_idle=true",
                                    "generation.weight_sync.transport=object_store")


def test_every_role_on_one_gpu_with_the_hf_engine(tmp_path, sft_model, rm_model):
    hf = [o for o in ONE_GPU if not o.startswith("generation.vllm") and o != "generation.engine=vllm"]
    run = engines_decode_like_the_learner(tmp_path, sft_model, rm_model, *hf, "generation.engine=hf",
                                          "generation.weight_sync.transport=auto")
    assert run["transport"] == "ipc"


def test_ema_averaged_on_the_gpu_equals_the_host_arithmetic():
    from rlhf_ray.learners.policy import average_into, host_average

    torch.manual_seed(0)
    weights = torch.randn(1 << 20, dtype=torch.float16, device="cuda")
    average = host_average({"w": torch.randn(1 << 20)}, weights.device)["w"]
    assert average.is_pinned()
    expected = 0.99 * average + 0.01 * weights.float().cpu()
    average_into(average, weights, 0.99)
    torch.cuda.synchronize()
    torch.testing.assert_close(average, expected, rtol=1e-5, atol=1e-6)
