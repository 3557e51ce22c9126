"""PPO end to end on a real local Ray: SFT and RM first (quickstart configs, shortened), then PPO on demo/sort."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from rlhf_ray.config import load_job
from rlhf_ray.jobs.ppo import run_ppo
from tests.conftest import ROOT

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("shared_ray")]  # one embedded Ray for the module


@pytest.fixture(scope="module")
def stage_models(sft_model, rm_model):
    """An SFT policy and a reward model trained from the tiny model (the PPO starting point)."""
    return sft_model, rm_model


# No KL term, so no reference: for runs where a frozen model plays no part (one process less to start)
NO_REFERENCE = ["reference=null", "ppo.kl_coef=0"]
# GRPO scored by the demo task's rule beside the policy: no critic and no reward model (two processes less), for
# runs whose subject is not the critic or the reward model
RULE_GRPO = ["ppo.advantage_estimator=grpo", "generation.sampling.n_samples_per_prompt=4", "ppo.rollout_batch_size=8",
             "critic=null", "reward.model.path=null", "reward.function=rlhf_ray.data.demo_sort:score",
             "reward.placement.colocate_with=policy"]


def crashed_after(run: Path, step: int, into: Path) -> None:
    """`run`'s output folder as a run that died after checkpointing `step` would leave it (its later checkpoints and
    its export gone, the lines of later steps still logged), copied to `into`: resuming there redoes the rest of
    the run, one job start instead of two (a stopped run, then its resumption)."""
    shutil.copytree(run, into, ignore=lambda _, names: [n for n in names if n == "model" or
                                                         (n.startswith("step-") and int(n[5:]) > step)])


def iteration_steps(out: Path) -> list[int]:
    return [m["step"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "time/iteration" in m]


def ppo_job(tmp_path, sft, rm, *overrides):
    return load_job(ROOT / "configs/quickstart/ppo.yaml",
                    [f"policy.model.path={sft}", f"reward.model.path={rm}", f"output_dir={tmp_path / 'ppo'}",
                     "cluster.dashboard=false", "logging.progress=false", *overrides])


def test_ppo_raises_held_out_reward_and_accuracy(tmp_path, stage_models):
    """The quickstart PPO run as shipped (engine auto: the hf engine for a model this small): the reward-model score
    and the rule accuracy of the policy's sampled answers (what PPO optimises) rise; its greedy answers, already the
    SFT policy's most likely ones, keep about their score and accuracy (docs/jobs.md, "What to expect on the demo
    task"). Learning does not depend on the engine once the engine samples the learner's distribution, which is
    checked for vLLM on its own (mismatch ~0 after every sync in the LoRA tests below, log-probs equal the learner's
    in test_engines.py), so the same run with vLLM is not repeated here. With one evaluation half-way and
    `ppo.keep_best: sampled_reward`, best_model/ is the policy of the evaluation that scored highest (the first of
    equals): the starting SFT model, the half-way policy or the last one, which best.json and summary.json name."""
    import torch
    from safetensors.torch import load_file

    from rlhf_ray.models.support import resolve_engine

    sft, rm = stage_models
    job = ppo_job(tmp_path, sft, rm, "ppo.eval_every=50", "ppo.keep_best=sampled_reward")
    assert resolve_engine(job.generation, job.policy.model)[0] == "hf"
    summary = run_ppo(job)
    assert summary["sampled_reward_after"] > summary["sampled_reward_before"] + 0.5, summary
    assert summary["sampled_task_accuracy_after"] > summary["sampled_task_accuracy_before"] + 0.03, summary
    assert summary["reward_after"] > summary["reward_before"] - 0.1, summary
    assert summary["task_accuracy_after"] >= summary["task_accuracy_before"] - 0.1, summary

    out = tmp_path / "ppo"
    scored = [(m["step"], m["eval/sampled_reward"]) for m in map(json.loads, (out / "metrics.jsonl").read_text()
                                                                  .splitlines()) if "eval/sampled_reward" in m]
    assert [step for step, _ in scored] == [0, 50, 100]
    top = max(value for _, value in scored)
    iteration = next(step for step, value in scored if value == top)
    best = {"iteration": iteration, "metric": "sampled_reward", "value": top}
    assert json.loads((out / "best.json").read_text()) == best and summary["best"] == best
    kept = load_file(str(out / "best_model" / "model.safetensors"))
    starting, last = load_file(str(sft / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert set(kept) == set(last)
    same_as = {name for name, weights in (("start", starting), ("last", last))
               if all(torch.equal(kept[k], weights[k]) for k in kept)}
    assert same_as == {0: {"start"}, 50: set(), 100: {"last"}}[iteration], (iteration, same_as)


def test_grpo_with_a_reward_function_runs_without_a_critic(tmp_path, stage_models):
    """GRPO as published: KL (k3) in the loss. One on-policy step per rollout, so the policy's old log-probs come
    from its training forward and no separate policy forward runs during experience."""
    import json

    sft, rm = stage_models
    job = ppo_job(tmp_path, sft, rm, *RULE_GRPO, "ppo.iterations=3", "ppo.kl_in_loss=true", "ppo.kl_estimator=k3",
                  "ppo.kl_coef=0.5", "policy.optim.lr=1e-3", "logging.timeline=true")
    assert job.critic is None and "critic" not in job.placement_roles()
    assert job.old_logprobs_from_training
    summary = run_ppo(job)
    assert summary["iterations"] == 3
    # the rule reward of a greedy answer is its task accuracy: the function ran on decoded prompts and answers
    assert summary["reward_before"] == summary["task_accuracy_before"]
    assert summary["sampled_reward_after"] == summary["sampled_task_accuracy_after"]  # each sample with its prompt
    # standard errors over the held-out prompts: greedy, one answer each, the binomial one; sampled answers of a
    # prompt form one cluster, so their error is at most that of one answer per prompt
    n = summary["eval_prompts"]
    for when in ("before", "after"):
        p, sampled = summary[f"task_accuracy_{when}"], summary[f"sampled_task_accuracy_{when}"]
        assert summary[f"task_accuracy_se_{when}"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)))
        assert summary[f"sampled_task_accuracy_se_{when}"] <= math.sqrt(sampled * (1 - sampled) / (n - 1)) + 1e-9
    rows = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "policy/kl" in r]
    assert len(steps) == 3 and all("compute/policy_seconds" not in r for r in steps)  # no old-log-prob forward
    assert all(abs(r["policy/approx_kl"]) < 1e-12 and r["policy/clip_fraction"] == 0 for r in steps)  # ratio 1
    assert steps[0]["policy/kl"] < 1e-6 < steps[-1]["policy/kl"] == steps[-1]["kl/mean"]  # moves off the reference
    # the default leaves the tiny model padded (too small to gain from packing): sorted answers differ in length
    assert all(0 < r["policy/padding_fraction"] < 1 for r in steps)
    # logging.timeline: every actor call of the run in a Chrome trace
    calls = [e["name"] for e in json.loads((tmp_path / "ppo" / "timeline.json").read_text()) if e.get("ph") == "X"]
    assert calls.count("train") == 3 and calls.count("rollout") == 3 and "take_weights" in calls, sorted(set(calls))


def hacked_reward(prompts, answers):
    """A reward hacked on purpose: it pays for wrong sorts, what the held-out check (the task's rule) marks wrong."""
    from rlhf_ray.data.demo_sort import score

    return [1.0 - right for right in score(prompts, answers)]


def test_a_hacked_reward_rising_while_the_held_out_check_falls_is_warned_naming_where_they_parted(tmp_path,
                                                                                                  stage_models,
                                                                                                  caplog):
    """The reward pays for what the held-out check (demo/sort's rule, the dataset's own) marks wrong: at every
    evaluation the policy's held-out reward rises while the check falls, and after two such evaluations in a row
    the job warns once, naming the iteration where the two parted; the evaluation lines carry the signal."""
    import logging

    sft, rm = stage_models
    job = ppo_job(tmp_path, sft, rm, *RULE_GRPO, "reward.function=tests.test_ppo_job:hacked_reward",
                  "ppo.iterations=3", "ppo.eval_every=1", "ppo.eval_prompts=32", "ppo.eval_samples=0",
                  "ppo.kl_coef=0.0", "reference=null", "policy.optim.lr=1e-3")
    assert job.ppo.hacking_warning_evaluations == 2  # the default
    with caplog.at_level(logging.WARNING, logger="rlhf_ray.jobs.alerts"):
        run_ppo(job)
    evals = [r for r in map(json.loads, (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines())
             if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 3]
    checks = [r["eval/task_accuracy"] for r in evals]
    assert all(r["eval/reward"] == pytest.approx(1 - r["eval/task_accuracy"]) for r in evals)  # hacked: its mirror
    assert checks[-1] < checks[0] - 0.1, checks  # the policy learnt to sort wrong
    warned = [r.getMessage() for r in caplog.records if "over-optimisation" in r.getMessage()]
    assert len(warned) == 1, (checks, warned)
    parted = next(r for r in evals if r.get("eval/reward_hacking_signs"))
    assert f"they parted after iteration {int(parted['eval/parted_at'])}" in warned[0]
    assert warned[0].startswith(f"iteration {parted['step']}: possible reward over-optimisation")
    assert "the held-out check (the dataset's rule) falls" in warned[0]


def test_dapo_options_and_diagnostics_run_end_to_end(tmp_path, stage_models):
    """configs/recipes/smollm2-dapo.yaml's options on the tiny model (CPU, ~30 s): clip-higher, no KL term, the
    sequence-mean loss and the soft overlong punishment reach a real run; the punishment shows in the metrics.
    Without a KL term it runs with no reference (reference: null): nothing measures a KL, and nothing is missed.
    Dynamic sampling without fill trains on the sampled groups whose scores differ, at most 8 of 16, in optimizer
    steps of 2 groups (configs/recipes/smollm2-sft-grpo.yaml's combination: as many steps as the kept groups
    fill), with the old log-probs the engine returned (ppo.old_logprobs: engine): the policy runs no forward over
    the rollout however many steps it takes. The reward-hacking diagnostics too: the reward's correlation with length every iteration, and with
    ppo.eval_every a held-out evaluation between the first and last (reward beside rule accuracy)."""
    import json

    sft, rm = stage_models
    job = ppo_job(tmp_path, sft, rm, *RULE_GRPO, "ppo.iterations=2", "ppo.kl_coef=0.0", "ppo.clip_ratio_high=0.28",
                  "ppo.loss_aggregation=seq_mean_token_mean",
                  "generation.sampling.max_new_tokens=16", "ppo.overlong_buffer=12", "ppo.eval_prompts=8",
                  "ppo.eval_every=1", "ppo.dynamic_sampling.enabled=true", "ppo.dynamic_sampling.oversample=2",
                  "ppo.dynamic_sampling.fill=false", "ppo.train_batch_size=8", "policy.micro_batch_size=8",
                  "reference=null", "ppo.old_logprobs=engine")
    summary = run_ppo(job)
    assert summary["iterations"] == 2 and "reference" not in summary["peak_memory_gib"]
    lines = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "policy/loss" in r]
    assert len(steps) == 2 and not any("kl/mean" in r or "policy/kl" in r for r in steps)
    assert not any("compute/policy_seconds" in r or "generate/mismatch_kl" in r for r in steps)  # the engine's
    evals = [r for r in lines if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]  # before, every iteration, after
    assert all("eval/task_accuracy" in r and "eval/reward_hacking_signs" in r for r in evals)  # from the first:
    # a dashboard's panel has the series from the job's start (the metrics endpoint test missed a short job's later)
    assert all(-1.0 <= r["reward/length_correlation"] <= 1.0 for r in steps)
    # dynamic sampling without fill: 16 prompts sampled, only the groups whose scores differ (at most 8; one equal
    # group when none does) trained on; the mini-batch plan indexes the kept rows only (planning the 64 sampled ones
    # would index past the experience and fail the step)
    assert all(r["dynamic/sampled_groups"] == 16 and 0 <= r["dynamic/informative_groups"] <= 1 for r in steps)
    assert all(r["dynamic/trained_groups"] == max(1, round(8 * r["dynamic/informative_groups"])) for r in steps)
    assert all(r["policy/steps_applied"] == math.ceil(r["dynamic/trained_groups"] / 2) for r in steps), steps
    for step in steps:  # answers of ~5 tokens pass the 4-token mark: each loses (length - 4) / 12
        assert -1.0 <= step["answer/overlong_penalty"] < 0, step
        # the mean of max(length - 4, 0) / 12 is at least what the mean length alone gives
        assert step["answer/overlong_penalty"] <= min(0.0, -(step["answer/length"] - 4) / 12) + 1e-6, step
        assert math.isfinite(step["policy/loss"])


def sockets_off_loopback() -> list[str]:
    """Listening sockets of this test's process tree (the embedded Ray and every actor) not bound to loopback."""
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1"):
                    found.append(f"{proc.name()} (pid {proc.pid}) listens on {conn.laddr.ip}:{conn.laddr.port}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


SYNC_CHECK = ["generation.placement.replicas=2", "generation.placement.num_cpus=0.25", "generation.vllm.dtype=fp32",
              "generation.vllm.max_model_len=128", "generation.weight_sync.bucket_mb=0.0625",
              "policy.placement.replicas=2", "policy.placement.num_cpus=0.25", "critic.placement.num_cpus=0.25",
              "policy.micro_batch_size=16", "policy.optim.lr=0.001"]
"""Two policy ranks, two engines and 64 KiB buckets: under ZeRO-3 every bucket is a separate gather of parameter
groups."""


def engines_decode_like_the_learner(tmp_path, sft, rm, *overrides) -> dict:
    """Two PPO iterations (SYNC_CHECK, then `overrides`); after each weight sync every engine is at the new policy
    version, the bytes sent are the learner's whole state, and the engines' greedy answers equal those of the
    learner's own weights loaded into a local copy. Also used by the GPU checks (tests/gpu)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ray.data.build import build_phase_data
    from tests.conftest import one_update, placed_trainer

    job = ppo_job(tmp_path, sft, rm, *SYNC_CHECK, *overrides)
    tokenizer = AutoTokenizer.from_pretrained(sft)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, tmp_path / "cache")
    probe = data.eval[:6]
    learner_copy = AutoModelForCausalLM.from_pretrained(sft).eval()
    with placed_trainer(job, tokenizer, data) as trainer:
        pool, policy = trainer.workers.pool, trainer.workers.policy
        if trainer.weights.transport == "collective":  # every store is up: DeepSpeed's and the weight-sync one
            assert not sockets_off_loopback(), sockets_off_loopback()
        for iteration in range(2):
            rows = data.train[iteration * 32:(iteration + 1) * 32]
            rollout = pool.collect(pool.submit([r["prompt_ids"] for r in rows], seed=iteration))
            result = one_update(trainer, iteration, rollout)
            assert pool.versions() == [iteration + 1] * len(pool.group)
            state = {k: v.cpu() for k, v in policy.call("gathered_state_dict")[0].items()}
            assert result["sync/bytes"] == sum(t.numel() * t.element_size() for t in state.values())
            learner_copy.load_state_dict(state, strict=False)
            samples = pool.generate([r["prompt_ids"] for r in probe], seed=0, greedy=True)
            for s in samples:
                ids = torch.tensor([s["prompt_ids"]])
                want = learner_copy.generate(ids, max_new_tokens=job.generation.sampling.max_new_tokens,
                                             do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                             pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
                if tokenizer.eos_token_id in want:
                    want = want[: want.index(tokenizer.eos_token_id) + 1]
                assert s["answer_ids"] == want
        return {"transport": trainer.weights.transport,
                "padding": {k: v for k, v in result.items() if k.endswith("padding_fraction")}}


# (the hf engine with a ZeRO-2 policy, the defaults, is the first leg of every family's end-to-end test in
# test_model_families.py; ipc in place, ZeRO-0 fp32, is test_smollm2.py's SFT -> PPO pipeline's; the object store is
# test_fault_tolerance.py's: the same check, not run again here. ipc here: 64 KiB buckets, each vLLM reloads on its own)
# the first also cuts every role's micro-batches by a token budget: the two ZeRO-3 policy ranks then need different
# numbers of micro-batches, and must still run as many forwards (their gathers are collectives)
# the second runs every role's micro-batches packed (models/packing.py), the ZeRO-3 policy's among them
BUDGET = [f"{role}.{key}" for role in ("policy", "critic", "reference", "reward")
          for key in ("max_tokens_per_micro_batch=100", "pack_sequences=false")]
PACKED = [f"{role}.pack_sequences=true" for role in ("policy", "critic", "reference", "reward")]


@pytest.mark.parametrize("engine,zero_stage,transport,budget", [("vllm", 3, "ipc", BUDGET),
                                                                 ("hf", 3, "collective", PACKED)])
def test_after_each_weight_sync_engines_decode_like_the_learner(tmp_path, stage_models, engine, zero_stage,
                                                                transport, budget):
    sft, rm = stage_models
    run = engines_decode_like_the_learner(tmp_path, sft, rm, f"generation.engine={engine}",
                                          f"generation.weight_sync.transport={transport}",
                                          f"policy.deepspeed.zero_stage={zero_stage}", *budget)
    assert run["transport"] == transport
    assert set(run["padding"]) == {"policy/padding_fraction", "critic/padding_fraction"}
    assert (max(run["padding"].values()) == 0) == (budget is PACKED), run["padding"]


def test_ppo_resumed_by_more_ranks_ends_with_the_weights_of_the_uninterrupted_run(tmp_path, stage_models):
    """Resumed from iteration 2's checkpoint by twice as many ranks (ZeRO-2: the checkpoint converted to the
    universal format), PPO ends with the weights of the uninterrupted run that wrote the checkpoint (a run ended by
    `stop_after`: the partial-rollout test below). (A resume by the same ranks: the LoRA
    test below, weights to 1e-5, and test_multinode.py's lost learner node, losses and evaluations to 1e-4.) The
    runs warm the critic up for one iteration: that iteration trains the critic alone and leaves the policy, and
    the engines' weights, at version 0. No KL term, so no reference (a resumed reference starting from the original
    model, not the checkpoint, shows in test_multinode.py's numbers and test_fault_tolerance.py's resubmission)."""
    import torch
    from safetensors.torch import load_file

    sft, rm = stage_models
    common = ["ppo.iterations=4", "ppo.rollout_batch_size=16", "ppo.eval_prompts=8", "policy.micro_batch_size=16",
              "critic.micro_batch_size=16", "ppo.critic_warmup=1",  # iteration 1 trains the critic alone
              "checkpoint.every_steps=2", *NO_REFERENCE]
    straight = run_ppo(ppo_job(tmp_path / "a", sft, rm, *common))
    lines = [json.loads(line) for line in (tmp_path / "a" / "ppo" / "metrics.jsonl").read_text().splitlines()]
    first, second = ([m for m in lines if m["step"] == step and "time/iteration" in m][0] for step in (1, 2))
    assert "critic/loss" in first and "policy/loss" not in first and first["policy_version"] == 0
    assert "policy/loss" in second and second["policy_version"] == 1
    crashed_after(tmp_path / "a" / "ppo", 2, into=tmp_path / "b" / "ppo")
    before = json.loads((tmp_path / "b" / "ppo" / "metrics.jsonl").read_text().splitlines()[0])["eval/reward"]
    regrouped = ppo_job(tmp_path / "b", sft, rm, *common, "policy.micro_batch_size=8", "critic.micro_batch_size=8",
                        "policy.placement.replicas=2", "critic.placement.replicas=2",
                        "policy.placement.num_cpus=0.25", "critic.placement.num_cpus=0.25",
                        "reward.placement.num_cpus=0.125")
    resumed = run_ppo(regrouped)
    assert resumed["reward_before"] == before  # carried over from the checkpoint, not evaluated again at step 2
    assert iteration_steps(tmp_path / "b" / "ppo") == [1, 2, 3, 4]  # the copied lines of 3 and 4 redone, not kept
    assert (tmp_path / "b" / "ppo" / "checkpoints" / "step-00000002" / "policy" / "state_universal").is_dir()
    a = load_file(str(tmp_path / "a" / "ppo" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "ppo" / "model" / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-4, msg=key)


def test_lora_ppo_syncs_folded_weights_resumes_and_exports_merged_and_adapter(tmp_path, stage_models):
    """LoRA on the policy (q_proj, v_proj; ZeRO-3 over 2 ranks, 64 KiB sync buckets) and on the critic: only
    adapters (and the critic's value head) train; the engines get the adapters folded into the base weights, so
    after every sync a vLLM engine samples from exactly the learner's distribution (mismatch ~0 in fp32, where
    unfolded weights would leave the base model); a run resumed from its iteration-2 checkpoint (adapter-only
    checkpoints) ends as the uninterrupted one; the export is the merged model plus the adapter alone."""
    import json

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sft, rm = stage_models
    common = ["ppo.iterations=4", "ppo.rollout_batch_size=16", "ppo.eval_prompts=8", "policy.micro_batch_size=8",
              "policy.deepspeed.zero_stage=3", "policy.placement.replicas=2", "policy.placement.num_cpus=0.25",
              "critic.placement.num_cpus=0.25", "generation.placement.num_cpus=0.25",
              "generation.weight_sync.bucket_mb=0.0625",
              "critic.micro_batch_size=16", "policy.model.lora.rank=8", "policy.model.lora.alpha=16",
              "policy.model.lora.target_modules=[q_proj, v_proj]", "policy.optim.lr=0.005",
              "critic.model.lora.rank=8", "critic.model.lora.target_modules=[q_proj, v_proj]",
              "generation.engine=vllm", "generation.vllm.dtype=fp32", "checkpoint.every_steps=2",
              *NO_REFERENCE]
    straight = run_ppo(ppo_job(tmp_path / "a", sft, rm, *common))
    crashed_after(tmp_path / "a" / "ppo", 2, into=tmp_path / "b" / "ppo")
    run_ppo(ppo_job(tmp_path / "b", sft, rm, *common))
    assert iteration_steps(tmp_path / "b" / "ppo") == [1, 2, 3, 4]  # resumed: 3 and 4 redone, logged once
    assert straight["iterations"] == 4
    out = tmp_path / "a" / "ppo"
    steps = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "policy/loss" in m]
    assert len(steps) == 4
    assert all(abs(m["generate/mismatch_kl"]) < 1e-5 for m in steps), [m["generate/mismatch_kl"] for m in steps]
    start, merged = load_file(str(sft / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert set(start) == set(merged)
    changed = {k for k in start if not torch.equal(start[k], merged[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed
    # the adapter alone, applied to the starting model, is the merged model
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft), out / "model" / "adapter")
    folded = with_adapter.merge_and_unload().state_dict()
    for key in changed:
        torch.testing.assert_close(folded[key], merged[key], rtol=0, atol=1e-6, msg=key)
    resumed = load_file(str(tmp_path / "b" / "ppo" / "model" / "model.safetensors"))
    for key in merged:
        torch.testing.assert_close(resumed[key], merged[key], rtol=0, atol=1e-5, msg=key)


def test_lora_adapter_sync_sends_only_the_adapters_and_vllm_applies_them(tmp_path, stage_models):
    """generation.weight_sync.lora: adapter: each sync moves the adapters alone (32 KiB here against the model's
    2 MiB) and vLLM applies them: after each sync the engine samples exactly the learner's distribution (mismatch
    ~0 in fp32) while the policy moves away from the reference. At the job's end the engine leaves nothing outside
    its process: neither the adapter's folder (in /dev/shm: memory) nor vLLM's rendezvous file."""
    from rlhf_ray.actors.vllm_engine import ADAPTER_PREFIX
    from tests.conftest import left_on_the_node

    def left_outside() -> set:
        return left_on_the_node(ADAPTER_PREFIX + "*", "vllm_dist_*")

    before = left_outside()
    sft, rm = stage_models
    job = ppo_job(tmp_path, sft, rm, "ppo.iterations=3", "ppo.eval_prompts=0", *RULE_GRPO,
                  "policy.micro_batch_size=16", "policy.model.lora.rank=8",
                  "policy.model.lora.target_modules=[q_proj, v_proj]", "policy.optim.lr=0.005",
                  "generation.engine=vllm", "generation.vllm.dtype=fp32", "generation.weight_sync.lora=adapter")
    run_ppo(job)
    steps = [m for m in map(json.loads, (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines())
             if "policy/loss" in m]
    adapter_bytes = 2 * 2 * 2 * 8 * 128 * 4  # layers x (q, v) x (A, B) x rank x width x fp32
    assert [m["sync/bytes"] for m in steps] == [adapter_bytes] * 3
    assert steps[-1]["policy/kl"] > 1e-3  # the adapters moved the policy ...
    assert all(abs(m["generate/mismatch_kl"]) < 1e-5 for m in steps)  # ... and the engine samples it
    assert not left_outside() - before


def test_async_generation_ahead_fills_evicts_and_refuses_stale_experience_with_ema_ptx_and_tis(tmp_path,
                                                                                              stage_models):
    """Four rollouts ahead, a buffer of three, staleness bound 1. The first five rollouts are sampled by the
    starting weights and all are put by the second update (an engine takes a weight update only after the rollouts
    queued before it), however generation and scoring interleave: four entries after one take do not fit in three
    (an eviction), and the second update takes one of the three, leaving starting-weight experience that is two
    versions old at the third update (refused). Every update still trains within the bound. The same run keeps an
    EMA of the policy, mixes a pretraining loss in (ptx) and weights each token by its truncated importance ratio
    (TIS), which experience one version old needs; none of these needs a KL term, so it runs with no reference."""
    import torch
    from safetensors.torch import load_file

    from rlhf_ray.data.preprocess import preprocess

    sft, rm = stage_models
    text = tmp_path / "plain.txt"
    text.write_text("\n".join(f"The number {i} comes before {i + 1}. Sorting puts small numbers first." for i in range(200)))
    preprocess([text], sft, tmp_path / "corpus", max_len=32, workers=1)
    job = ppo_job(tmp_path, sft, rm, "ppo.mode=async", "ppo.rollouts_ahead=4", "ppo.buffer_capacity=3",
                  "ppo.max_staleness=1", "ppo.iterations=5", "ppo.rollout_batch_size=8", "ppo.eval_prompts=0",
                  "policy.micro_batch_size=8", "critic.micro_batch_size=8", "ppo.ema.enabled=true",
                  "ppo.ema.beta=0.5", "policy.max_tokens_per_micro_batch=120",
                  f"ppo.pretrain_data=[{tmp_path / 'corpus'}]", "ppo.ptx_coef=0.5", "ppo.tis_cap=2.0",
                  *NO_REFERENCE)
    assert run_ppo(job)["iterations"] == 5
    out = tmp_path / "ppo"
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in logged if "experience/staleness" in m]
    assert len(steps) == 5 and [m["policy_version"] for m in steps] == [1, 2, 3, 4, 5]
    assert all(m["experience/staleness"] <= 1 for m in steps)
    assert steps[-1]["buffer/evicted"] >= 1 and steps[-1]["buffer/refused_stale"] >= 1
    assert steps[-1]["buffer/put"] >= 6  # more experience was made than trained on
    assert all(m["buffer/entries"] <= 3 for m in steps)
    assert all(m["policy/ptx_loss"] > 0 for m in steps)
    # off-policy correction: the first batch was sampled and scored by the weights the learner has (engine and
    # learner agree up to float noise, TIS weights 1); a batch sampled by weights one version older than those that
    # scored it (its old log-probs) differs, which the mismatch and the TIS weights show. Measured: mismatch ~1e-9
    # on batches scored before the next update, 1e-5 to 2e-5 on those scored after it (at least the batch of the
    # third update: the starting weights' are refused there, and the batch sampled by the first update's weights
    # is scored while the second trains), mean weight 1 +- 1e-3 there.
    assert steps[0]["experience/staleness"] == 0
    assert steps[0]["generate/mismatch_kl"] < 1e-7 and abs(steps[0]["policy/tis_weight"] - 1) < 1e-6
    disagree = [m for m in steps if m["generate/mismatch_kl"] > 1e-6]
    assert disagree and all(m["experience/staleness"] == 1 for m in disagree), steps
    assert all(abs(m["policy/tis_weight"] - 1) > 1e-5 for m in disagree), [m["policy/tis_weight"] for m in steps]
    final, ema, start = (load_file(str(p / "model.safetensors")) for p in (out / "model", out / "model_ema", sft))
    key = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(ema[key], final[key]) and not torch.equal(ema[key], start[key])  # an average of both


@pytest.mark.parametrize("engine,iterations,stop_after", [
    (["generation.engine=hf"], 6, 2), (["generation.engine=vllm", "generation.vllm.dtype=fp32"], 4, None)],
    ids=["hf-stopped-and-resumed", "vllm"])
def test_async_grpo_with_partial_rollouts_takes_updates_mid_answer(tmp_path, stage_models, monkeypatch, engine,
                                                                   iterations, stop_after):
    """generation.partial_rollouts on each engine, with the test hook holding each rollout call's first round (the
    engine's first call aside) after 3 tokens (5 s at most) until an update asks for the engine: the rollouts
    started while an update trains are generating when its weights arrive, so their answers (8 tokens each) carry
    two policy versions, and the update that trains on them finds some of their tokens one version old; the
    rollouts stream (the next rollout's prompts join the running one), and no experience is older than
    max_staleness. On hf the run stops after 2 of its 6 updates and resumes: the checkpoint resumes at a rollout no
    later than the one after the last trained on (earlier while answers of an older one were still generating), and
    the resumed run ends the job."""
    import json

    from rlhf_ray.actors.update_gate import HOLD_ENV

    monkeypatch.setenv(HOLD_ENV, "3:5")
    sft, rm = stage_models
    job = ppo_job(tmp_path, sft, rm, "ppo.mode=async", *engine, "generation.partial_rollouts=true", *RULE_GRPO,
                  f"ppo.iterations={iterations}", "ppo.eval_prompts=0", "generation.sampling.max_new_tokens=8",
                  "generation.sampling.min_new_tokens=8", "ppo.tis_cap=2.0", *NO_REFERENCE)
    if stop_after:
        assert run_ppo(job, stop_after=stop_after)["stopped_at_iteration"] == stop_after
        from rlhf_ray.jobs.checkpoints import Checkpoints

        state = Checkpoints.state(Checkpoints(tmp_path / "ppo", 2).latest())
        assert state["step"] == stop_after and state["rollout"] <= stop_after
    assert run_ppo(job)["iterations"] == iterations
    logged = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in logged if "experience/staleness" in m]
    assert len(steps) == iterations  # a resumed run's lines replace nothing twice
    mixed = [m for m in steps if m["generate/multi_version_answers"] > 0]
    assert mixed, [m["generate/multi_version_answers"] for m in steps]
    assert all(0 < m["experience/tokens_staleness_1"] < 1 and m["experience/staleness"] == 1 for m in mixed)
    assert steps[0]["experience/tokens_staleness_0"] == 1  # rollout 0: the starting weights only
    assert all(m["experience/staleness"] <= 1 and m["experience/tokens_staleness_2plus"] == 0 for m in steps)
    assert all(m["answer/length"] == 8 for m in steps)  # every answer continued to its end, no token lost
    assert all(m["policy/tis_weight"] > 0 for m in steps)


def test_reward_functions_score_each_sample_against_its_own_ground_truth(tmp_path, stage_models):
    """demo/arithmetic through two engines and two reward actors, GRPO with the last-number checker: every row the
    reward function scores carries the `answer` column of its own prompt (through pool, experience and buffer),
    the scores are the checker's against that truth, and two GRPO iterations train on them. With dynamic sampling
    (4 of 8 sampled groups train) the reward scores first and the reference only the kept groups, whose rows of
    the experience carry their own reference log-probs; the reward metrics stay those of every sampled answer."""
    import ray
    import torch
    from transformers import AutoTokenizer

    from rlhf_ray.algorithms.advantages import informative_groups_first
    from rlhf_ray.data.answers import last_number_reward
    from rlhf_ray.data import demo
    from rlhf_ray.data.build import build_phase_data
    from tests.conftest import one_update, placed_trainer

    sft, rm = stage_models
    job = ppo_job(tmp_path, sft, rm, "critic=null", "reward.model.path=null",
                  "reward.function=rlhf_ray.data.answers:last_number_reward", "reward.placement.replicas=2",
                  "reward.placement.num_cpus=0.1", "reward.placement.colocate_with=null",
                  "ppo.advantage_estimator=grpo", "generation.sampling.n_samples_per_prompt=2",
                  "generation.placement.replicas=2", "generation.placement.num_cpus=0.25", "generation.engine=hf",
                  "ppo.rollout_batch_size=4", "ppo.dynamic_sampling.enabled=true", "ppo.dynamic_sampling.oversample=2",
                  "policy.micro_batch_size=8", "data.datasets=[{name: demo/arithmetic}]")
    tokenizer = AutoTokenizer.from_pretrained(sft)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, tmp_path / "cache")
    with placed_trainer(job, tokenizer, data) as trainer:
        pool, workers = trainer.workers.pool, trainer.workers
        scored_rows = []  # (role, rows) each role is asked to score, on the driver's side
        submit = workers.scorer.submit
        workers.scorer.submit = lambda group, method, batch, rows: (scored_rows.append((group.role, rows)),
                                                                    submit(group, method, batch, rows))[1]
        for iteration in range(2):
            rows = data.train[iteration * 8:(iteration + 1) * 8]
            rollout = pool.collect(pool.submit([r["prompt_ids"] for r in rows], seed=iteration,
                                               columns=[r["columns"] for r in rows]))
            (assembler,) = trainer.workers.assembler.actors
            batch_ref = assembler.batch.remote(rollout.refs)
            batch = ray.get(batch_ref)
            width = batch.prompt_width
            prompts = [tokenizer.decode(s[:width][m[:width].bool()]) for s, m in
                       zip(batch.sequences, batch.attention_mask)]
            answers = [tokenizer.decode(s[width:][m[width:].bool()], skip_special_tokens=True) for s, m in
                       zip(batch.sequences, batch.attention_mask)]
            truth = [c["answer"] for c in batch.columns]
            assert truth == [str(demo.parse_prompt(p).value) for p in prompts]  # each row's own ground truth
            scores = trainer.workers.scorer.reward_scores(batch_ref, len(truth))
            assert scores.tolist() == last_number_reward(prompts, answers, answer=truth)
            if iteration == 0:
                reference = workers.scorer.gather(workers.reference, "logprobs", submit(
                    workers.reference, "logprobs", batch_ref, len(truth)))
                reference = torch.cat(ray.get([r.ref for r in reference]))
                scored_rows.clear()
                assembled = workers.scorer.advantages(workers.scorer.score(rollout), trainer.weights.version).experience
                kept, _ = informative_groups_first(scores, 2, 4)
                assert scored_rows == [("reward", 16), ("reference", 8)] and assembled.rows == 8
                experience = ray.get(assembled.ref)
                assert experience.sequences.tolist() == batch.sequences[kept].tolist()
                torch.testing.assert_close(experience.ref_logp, reference[kept], rtol=0, atol=1e-5)
                assert assembled.stats.rollout.reward_mean == scores.mean().item()
            result = one_update(trainer, iteration, rollout)
            assert pool.versions() == [iteration + 1] * 2 and result["reward/mean"] == scores.mean().item()
            assert result["dynamic/sampled_groups"] == 8 and result["dynamic/trained_groups"] == 4  # filled


def test_a_warmed_up_student_distils_from_the_teacher(tmp_path, stage_models, tiny_model):
    """A distillation pipeline with a warm-up stage: the teacher is the SFT model (the sft stage, found complete in
    its folder and reused), the student the untrained tiny model. The teacher answers 32 training prompts on the
    cluster (the ppo stage's generation engine and sampling settings), the student is fine-tuned on those answers
    (warmup: its held-out loss on them falls), then `advantage_estimator: distill` starts from the warmed-up student:
    the teacher (its own actor group) scores every sampled token, each token's advantage is their log-prob
    difference (one iteration here: that it learns is the test above)."""
    import yaml

    from rlhf_ray.jobs.pipeline import run_pipeline

    sft, rm = stage_models
    quick = {kind: yaml.safe_load((ROOT / f"configs/quickstart/{kind}.yaml").read_text()) for kind in ("sft", "ppo")}
    for section in quick.values():
        del section["cluster"]  # the pipeline's, below
    config = {"kind": "pipeline", "output_dir": str(tmp_path), "seed": 1234, "cluster": {"num_cpus": 2},
              "sft": {**quick["sft"], "output_dir": str(sft.parent)},  # complete: reused, not run
              "warmup": {"prompts": 32, "data": {"max_seq_len": 64}, "train": {"max_steps": 16, "micro_batch_size": 4,
                         "global_batch_size": 4}, "optim": {"lr": 3e-3, "warmup_steps": 0},
                         "deepspeed": {"zero_stage": 0}, "placement": {"replicas": 1, "num_cpus": 1}},
              "ppo": {**quick["ppo"], "output_dir": str(tmp_path / "ppo"), "critic": None,
                      "policy": {**quick["ppo"]["policy"], "model": {"path": str(tiny_model), "dtype": "fp32"}},
                      "teacher": {"model": {"dtype": "fp32"}, "placement": {"num_cpus": 0.25, "colocate_with": "policy"}},
                      "reward": {"function": "rlhf_ray.data.demo_sort:score",
                                 "placement": {"num_cpus": 0.25, "colocate_with": "policy"}}}}
    (tmp_path / "distill.yaml").write_text(yaml.safe_dump(config))
    job = load_job(tmp_path / "distill.yaml",
                   ["cluster.dashboard=false", "logging.progress=false", "ppo.ppo.advantage_estimator=distill",
                    "ppo.ppo.kl_coef=0", "ppo.ppo.iterations=1", "ppo.ppo.eval_prompts=8", "ppo.reference=null"])
    assert job.ppo.teacher.model.path == str(sft) and job.warmup.model.path == str(tiny_model)
    assert job.ppo.policy.model.path == str(tmp_path / "warmup" / "model")  # PPO starts from the warm-up's model
    summary = run_pipeline(job)

    assert summary["sft"]["reused"] and list(summary) == ["sft", "warmup", "ppo"]
    answers = [json.loads(line) for line in (tmp_path / "warmup" / "teacher_answers.jsonl").read_text().splitlines()]
    sampled = summary["warmup"]["teacher_answers"]
    assert sampled["prompts"] == 32 and sampled["answers"] == len(answers) == 32 - sampled["unfinished"] > 0
    assert all(a["finished"] and a["columns"]["answer"] for a in answers)  # each with its prompt's ground truth
    # the teacher's answers became likelier under the student: 6.8 -> 2.6 nats per token here
    assert summary["warmup"]["eval_loss_last"] < summary["warmup"]["eval_loss_first"] - 1.0, summary["warmup"]
    assert summary["ppo"]["iterations"] == 1 and "teacher" in summary["ppo"]["peak_memory_gib"]
    # run again: every stage is complete, so nothing runs and nothing is sampled again
    again = run_pipeline(job)
    assert all(again[name]["reused"] for name in ("sft", "warmup", "ppo"))
    assert again["warmup"]["teacher_answers"] == {"answers": len(answers), "tokens": sampled["tokens"], "reused": True,
                                                  "prompts": None, "unfinished": None, "engine": None}
    assert list(sampled) == list(again["warmup"]["teacher_answers"]) and sampled["engine"] == "hf"  # the same fields


def test_on_policy_distillation_moves_the_student_towards_the_teacher(tmp_path, stage_models, tiny_model):
    """`advantage_estimator: distill`: the untrained tiny model (student) samples, the SFT model (teacher, its own
    actor group) scores every sampled token, and each token's advantage is their log-prob difference: the
    student's reverse KL to the teacher falls over the iterations."""
    import json

    sft, rm = stage_models
    job = ppo_job(tmp_path, tiny_model, rm, "ppo.advantage_estimator=distill", f"teacher.model.path={sft}",
                  "teacher.placement.colocate_with=policy", "teacher.placement.num_cpus=0.25", "critic=null",
                  "reward.model.path=null", "reward.function=rlhf_ray.data.demo_sort:score",
                  "reward.placement.colocate_with=policy", "ppo.kl_coef=0", "ppo.iterations=4",
                  "policy.optim.lr=3e-3", "ppo.ppo_epochs=4", "ppo.eval_prompts=32")
    assert "teacher" in job.placement_roles() and not job.old_logprobs_from_training
    run_ppo(job)
    lines = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    kl = [m["distill/reverse_kl"] for m in lines if "distill/reverse_kl" in m]
    # PPO's clipping bounds how far a token's probability moves per update, so from a random student the KL falls
    # slowly: 6.90 -> 6.43 nats per token in 4 iterations here
    assert len(kl) == 4 and kl[-1] < kl[0] - 0.2, kl
    assert (tmp_path / "ppo" / "logs" / "teacher-0.log").is_file()
