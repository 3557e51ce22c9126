"""A single-rank ZeRO-0 engine skips DeepSpeed's gradient all-reduce pass (flattening every gradient into buckets,
"reducing" over a group of one and copying back: transient memory the size of the gradients, measured in
docs/benchmarks.md "Memory model"); its gradients are the plain backward's. Run in a fresh process: it starts a
torch.distributed group of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_one_zero0_rank_skips_the_all_reduce_and_keeps_the_plain_gradients(tiny_model):
    script = textwrap.dedent(f"""
        import os, torch
        os.environ["DS_ACCELERATOR"] = "cpu"
        from rlhf_ray.config.deepspeed import DeepSpeedSpec
        from rlhf_ray.config.model import ModelSpec
        from rlhf_ray.config.optim import OptimizerSpec
        from rlhf_ray.learners.engine import build_engine, init_process_group, listen
        from rlhf_ray.models.loading import load_causal_lm

        sock = listen("127.0.0.1")
        init_process_group(0, 1, "127.0.0.1", sock.getsockname()[1], sock, 120)
        spec = ModelSpec(path="{tiny_model}", dtype="fp32", disable_dropout=True)
        plain = load_causal_lm(spec)
        ids = torch.randint(3, plain.config.vocab_size, (2, 12))
        plain(input_ids=ids).logits.logsumexp(-1).mean().backward()
        for stage, world_size_one_skips in ((0, True), (2, False)):
            engine, _ = build_engine(load_causal_lm(spec), spec, OptimizerSpec(lr=1e-3), DeepSpeedSpec(zero_stage=stage),
                                     2, 1, 10)
            assert engine.enable_backward_allreduce is (not world_size_one_skips), stage
        engine, _ = build_engine(load_causal_lm(spec), spec, OptimizerSpec(lr=1e-3), DeepSpeedSpec(zero_stage=0), 2, 1, 10)
        engine.backward(engine(input_ids=ids).logits.logsumexp(-1).mean())
        for (name, a), b in zip(plain.named_parameters(), engine.module.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=name)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
