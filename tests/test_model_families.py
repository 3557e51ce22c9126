"""The architecture matrix: tiny random models with the real config class and special-token conventions of Llama 3,
Qwen2, Qwen3, Mistral, Gemma 2, Phi-3, OPT and GPT-2 (rlhf_ray/models/families.py). For each: the token
conventions (BOS once, every stop id, pad from masks) and SFT rows, one PPO iteration on each engine with the
family's own model as the reward model, after the weight sync engine greedy == learner greedy token for token
(fp32), and an HF export that plain transformers reloads with the family's stop ids."""

from __future__ import annotations

import dataclasses

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_ray.config import load_job
from rlhf_ray.data.adapters import apply_chat_template, dschat_messages
from rlhf_ray.data.raw import RawSample
from rlhf_ray.data.tokenized import tokenize_pairs, tokenize_prompts, tokenize_sft
from rlhf_ray.algorithms.batch import RolloutBatch
from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.models.families import FAMILIES, build_family_model
from tests.conftest import ROOT
from tests.test_ppo_job import NO_REFERENCE

NAMES = list(FAMILIES)
SAMPLE = RawSample(" Human: Sort 3 1 2 Assistant:", " 1 2 3", " 3 2 1")


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: build_family_model(name, root / name) for name in NAMES}


def conventions(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer, TokenConventions.from_tokenizer(tokenizer, path)


@pytest.mark.parametrize("name", NAMES)
def test_conventions_follow_the_family(family_models, name):
    family = FAMILIES[name]
    tokenizer, tokens = conventions(family_models[name])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in family.specials}
    assert set(tokens.stop_ids) == {ids[t] for t in family.stops} | {ids[family.eos]}
    assert tokens.prefix_ids == ((ids[family.bos],) if family.adds_bos else ())
    assert tokens.pad_id == (ids[family.pad] if family.pad else ids[family.eos])  # no pad: eos fills, masks tell

    sample = apply_chat_template(SAMPLE, tokenizer) if family.chat_template else SAMPLE
    (sft,), _ = tokenize_sft([sample], tokenizer, tokens, max_seq_len=128)
    (pair,), _ = tokenize_pairs([sample], tokenizer, tokens, max_seq_len=128)
    (prompt,), _ = tokenize_prompts([sample], tokenizer, tokens, max_prompt_len=128)
    for seq in (sft["input_ids"], pair["chosen_ids"], pair["rejected_ids"], prompt["prompt_ids"]):
        if family.adds_bos:  # the tokenizer's BOS exactly once, even when the chat template wrote it too
            assert seq[0] == ids[family.bos] and seq[1] != ids[family.bos]
    for seq in (sft["input_ids"], pair["chosen_ids"], pair["rejected_ids"]):
        assert seq[-1] in tokens.stop_ids and tokens.end_of(seq[len(prompt["prompt_ids"]):]) == len(seq) - len(
            prompt["prompt_ids"])
    if family.chat_template:  # the answer ends on the template's end-of-turn, not a second appended eos
        rendered_end = tokenizer(sample.chosen, add_special_tokens=False)["input_ids"]
        assert sft["input_ids"][-1] == tokens.cut(rendered_end)[0][-1]


def test_trimmed_prompts_keep_their_bos(family_models):
    tokenizer, tokens = conventions(family_models["llama3"])
    long = RawSample(" Human: " + "word " * 60 + "Sort 1 0 Assistant:", " 0 1")
    (row,), report = tokenize_prompts([long], tokenizer, tokens, max_prompt_len=12)
    assert len(row["prompt_ids"]) == 12 and row["prompt_ids"][0] == tokens.prefix_ids[0]
    assert tokenizer.decode(row["prompt_ids"]).endswith("Assistant:") and sum(report.repaired.values()) == 1
    (sft,), _ = tokenize_sft([long], tokenizer, tokens, max_seq_len=16)
    assert len(sft["input_ids"]) == 16 and sft["input_ids"][0] == tokens.prefix_ids[0]


@pytest.mark.parametrize("name", NAMES)
def test_disable_dropout_makes_training_forwards_deterministic(family_models, name):
    """DeepSpeed-Chat's --disable_dropout: PPO's log-probs must be a function of the weights. OPT's layers copy
    their dropout rate at construction, so zeroing the config alone left them dropping (fails without the fix)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_ray.models.loading import disable_dropout

    model = AutoModelForCausalLM.from_pretrained(family_models[name], dtype=torch.float32)
    for module in model.modules():  # every rate the family has, set high so that any dropout left shows
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
        for key in ("dropout", "attention_dropout", "activation_dropout"):
            if type(getattr(module, key, None)) is float:
                setattr(module, key, 0.5)
    disable_dropout(model)
    model.train()
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(model(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_stop_set_cuts_at_the_first_stop_id():
    tokens = TokenConventions(name="t", eos_id=4, stop_ids=(4, 1, 5), pad_id=4, prefix_ids=(0,))
    assert tokens.cut([7, 8, 5, 9, 4]) == ([7, 8, 5], True)  # a non-eos stop id ends the answer
    assert tokens.cut([7, 8, 9]) == ([7, 8, 9], False)


def test_dschat_turns_become_chat_messages():
    assert dschat_messages(" Human: hi Assistant: hello Human: sort 2 1 Assistant:") == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "sort 2 1"}]
    assert dschat_messages("Plain question?") == [{"role": "user", "content": "Plain question?"}]


def test_a_registered_dataset_can_use_the_chat_template(family_models, tmp_path):
    from rlhf_ray.config.data import DataSpec, DatasetSpec
    from rlhf_ray.data.build import build_phase_data
    from rlhf_ray.data.registry import task_rule

    tokenizer, tokens = conventions(family_models["qwen2"])
    spec = DataSpec(datasets=[DatasetSpec(name="demo/sort", chat_template=True)], max_seq_len=96, max_prompt_len=64)
    data = build_phase_data(spec, tokenizer, "sft", seed=0, cache_dir=tmp_path, tokens=tokens)
    text = tokenizer.decode(data.train[0]["input_ids"])
    assert text.startswith("<|im_start|>user\nSort") and "Human:" not in text and text.endswith("<|im_end|>")
    ppo = build_phase_data(spec, tokenizer, "ppo", seed=0, cache_dir=tmp_path, tokens=tokens)
    assert task_rule("demo/sort")([ppo.train[0]["prompt"]], [ppo.train[0]["reference"]]) == [1.0]  # rule reads it
    plain = build_phase_data(DataSpec(datasets=[DatasetSpec(name="demo/sort")], max_seq_len=96), tokenizer, "sft",
                             seed=0, cache_dir=tmp_path, tokens=tokens)
    assert tokenizer.decode(plain.train[0]["input_ids"]).startswith(" Human:")


# ---- real actors on a local Ray ----------------------------------------------------------------------------

def _data_override(name: str) -> str:
    template = "true" if FAMILIES[name].chat_template else "false"
    return f"data.datasets=[{{name: demo/sort, chat_template: {template}}}]"


def _check_greedy(workers, prompts, learner, tokens, max_new_tokens) -> None:
    """After a weight sync the engines decode like the learner's weights, token for token, stop ids included."""
    state = workers.policy.call("gathered_state_dict")[0]
    learner.load_state_dict(state, strict=False)
    for s in workers.pool.generate(prompts, seed=0, greedy=True):
        ids = torch.tensor([s["prompt_ids"]])
        want = learner.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=list(tokens.stop_ids),
                                pad_token_id=tokens.pad_id)
        want, finished = tokens.cut(want[0, ids.shape[1]:].tolist())
        assert s["answer_ids"] == want and s["finished"] == finished


HF_TOO = {"gemma3"}
"""Families whose end-to-end test runs the hf engine before vLLM (tied embeddings, sliding-window attention)."""


@pytest.mark.system
class TestEndToEnd:
    """Every family through real actors, on the session's shared embedded Ray (shared_ray)."""

    @pytest.mark.parametrize("name", NAMES)
    def test_grpo_greedy_parity_and_export(self, family_models, shared_ray, tmp_path, name):
        """A GRPO iteration scored by the family's own model as a reward model, sampled by a vLLM engine (for
        HF_TOO's families first by the hf engine, then, the pool swapped for a vLLM engine, a second iteration); after
        each weight sync engine greedy == learner greedy; the exported model reloads in plain transformers with the
        family's stop ids. (No SFT job per family: the SFT learner loads and steps the model as the policy learner
        does here; the family's SFT rows are test_conventions_follow_the_family's. The hf engine runs the learner's
        own transformers class, so one family's run of it stands for all; vLLM maps each family's weights its own
        way, so every family runs it. No KL term, so no reference: it would load the model as the reward does.)"""
        from rlhf_ray import cluster
        from rlhf_ray.data.build import build_phase_data
        from rlhf_ray.plan import ResourcePlan
        from tests.conftest import one_update, swap_engine, trainer_on

        path = family_models[name]
        engines = ["hf", "vllm"] if name in HF_TOO else ["vllm"]
        common = ["cluster.dashboard=false", "logging.progress=false", _data_override(name)]
        ppo_job = load_job(ROOT / "configs/quickstart/ppo.yaml",
                           [f"policy.model.path={path}", f"reward.model.path={path}", f"output_dir={tmp_path / 'ppo'}",
                            "critic=null", *NO_REFERENCE,
                            "reward.placement.colocate_with=policy", "ppo.advantage_estimator=grpo",
                            "generation.sampling.n_samples_per_prompt=2", f"generation.engine={engines[0]}",
                            "generation.vllm.dtype=fp32", "ppo.rollout_batch_size=8", "policy.micro_batch_size=16",
                            "policy.optim.lr=0.01", *common])
        vllm_job = ppo_job.model_copy(update={"generation": ppo_job.generation.model_copy(update={"engine": "vllm"})})
        tokenizer, tokens = conventions(path)
        data = build_phase_data(ppo_job.data, tokenizer, "ppo", ppo_job.seed, tmp_path / "cache", tokens=tokens)
        probe = [r["prompt_ids"] for r in data.eval[:4]]
        learner = AutoModelForCausalLM.from_pretrained(path).eval()
        start = {n: p.clone() for n, p in learner.named_parameters()}
        max_new = ppo_job.generation.sampling.max_new_tokens
        plan = ResourcePlan.from_roles(ppo_job.placement_roles())
        placements = cluster.place(plan, shared_ray.nodes(), 120)
        try:
            with trainer_on(ppo_job, plan, placements, tokenizer, data, tokens) as trainer:
                workers = trainer.workers
                for iteration, engine in enumerate(engines):
                    if iteration > 0:  # the same learners, reference and reward; a vLLM engine on the same bundle
                        swap_engine(trainer, vllm_job, plan, placements, tokens)
                    assert workers.pool.group.call("engine_name") == [engine]
                    rows = data.train[iteration * 8:(iteration + 1) * 8]
                    rollout = workers.pool.collect(workers.pool.submit([r["prompt_ids"] for r in rows],
                                                                       seed=iteration))
                    result = one_update(trainer, iteration, rollout)
                    assert workers.pool.versions() == [iteration + 1]
                    assert torch.isfinite(torch.tensor(result["reward/mean"]))
                    assert result["reward/std"] > 0  # the reward model scored the answers differently
                    _check_greedy(workers, probe, learner, tokens, max_new)
                workers.policy.call("export_hf", str(tmp_path / "export"))
        finally:
            cluster.remove(placements)
        assert any(not torch.equal(start[n], p) for n, p in learner.named_parameters())  # it trained
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
        assert type(exported).__name__ == FAMILIES[name].architecture
        trained = dict(learner.named_parameters())
        for n, p in exported.named_parameters():
            torch.testing.assert_close(p, trained[n], rtol=0, atol=0)
        again = TokenConventions.from_tokenizer(AutoTokenizer.from_pretrained(tmp_path / "export"), tmp_path / "export")
        assert replace(again, name="") == replace(tokens, name="")


# ---- checks before anything starts ---------------------------------------------------------------------------

def _validate(capsys, *args) -> tuple[int, str]:
    from rlhf_ray.cli import main

    code = main(["validate", *args, "--quiet"])
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())  # rich wraps long lines


def test_validate_names_a_missing_gguf_file_and_where_it_was_set(capsys, tmp_path):
    code, out = _validate(capsys, str(ROOT / "configs/quickstart/sft.yaml"), "--set", "model.path=null",
                          "--set", f"model.gguf_file={tmp_path / 'gone.gguf'}")
    assert code != 0 and f"--set model.gguf_file={tmp_path / 'gone.gguf'}" in out and "gone.gguf does not exist" in out


def test_validate_refuses_an_architecture_the_engine_cannot_serve(capsys, family_models, tmp_path):
    import json
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(family_models["llama3"], odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["TotallyNewForCausalLM"]}))
    common = [str(ROOT / "configs/quickstart/ppo.yaml"), "--set", f"policy.model.path={odd}",
              "--set", f"reward.model.path={family_models['llama3']}"]
    code, out = _validate(capsys, *common, "--set", "generation.engine=vllm")
    assert code != 0 and "generation.engine" in out and "cannot serve TotallyNewForCausalLM" in out
    code, out = _validate(capsys, *common, "--set", "generation.engine=hf")
    assert code != 0 and "transformers has no TotallyNewForCausalLM" in out
    code, out = _validate(capsys, str(ROOT / "configs/quickstart/sft.yaml"), "--set", f"model.path={odd}")
    assert code != 0 and "model.path" in out and "TotallyNewForCausalLM" in out
    from rlhf_ray.jobs.ppo import run_ppo
    from rlhf_ray.jobs.supervised import run_supervised

    with pytest.raises(ValueError, match="model.path: transformers has no TotallyNewForCausalLM"):  # before Ray
        run_supervised(load_job(ROOT / "configs/quickstart/sft.yaml", [f"model.path={odd}",
                                                                       f"output_dir={tmp_path / 'sft'}"]))
    with pytest.raises(ValueError, match="generation.engine: the vllm engine cannot serve TotallyNewForCausalLM"):
        run_ppo(load_job(ROOT / "configs/quickstart/ppo.yaml", [f"policy.model.path={odd}", "generation.engine=vllm",
                                                                f"reward.model.path={family_models['llama3']}",
                                                                f"output_dir={tmp_path / 'ppo'}"]))
    import ray

    assert not ray.is_initialized()
    code, out = _validate(capsys, str(ROOT / "configs/quickstart/ppo.yaml"), "--set",
                          f"policy.model.path={family_models['phi3']}", "--set",
                          f"reward.model.path={family_models['phi3']}", "--set", "generation.engine=vllm")
    assert code == 0, out
    # packed rows need SDPA-able attention: Gemma 2 soft-caps its attention logits
    code, out = _validate(capsys, str(ROOT / "configs/quickstart/ppo.yaml"), "--set",
                          f"policy.model.path={family_models['gemma2']}", "--set",
                          f"reward.model.path={family_models['gemma2']}", "--set", "generation.engine=hf",
                          "--set", "policy.pack_sequences=true")
    assert code != 0 and "policy.pack_sequences" in out and "Gemma2ForCausalLM soft-caps" in out, out


def test_a_reward_model_with_another_tokenizer_is_bridged_or_refused_by_name(capsys, family_models, tmp_path):
    import shutil

    ppo = str(ROOT / "configs/quickstart/ppo.yaml")
    code, out = _validate(capsys, ppo, "--set", f"policy.model.path={family_models['qwen2']}",
                          "--set", f"reward.model.path={family_models['gpt2']}")
    assert code == 0, out  # another tokenizer with an eos: bridged by re-tokenising
    no_eos = tmp_path / "no-eos"
    shutil.copytree(family_models["gpt2"], no_eos)
    tokenizer = AutoTokenizer.from_pretrained(no_eos)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(no_eos)
    code, out = _validate(capsys, ppo, "--set", f"policy.model.path={family_models['qwen2']}",
                          "--set", f"reward.model.path={no_eos}")
    assert code != 0 and "reward.model.tokenizer" in out
    assert str(no_eos) in out and str(family_models["qwen2"]) in out  # both tokenizers named


def test_a_bridged_reward_model_scores_its_own_tokenisation(family_models):
    from rlhf_ray.actors.scoring import RewardWorker
    from rlhf_ray.algorithms.experience import pack_rollouts
    from rlhf_ray.config.model import ModelSpec

    policy_tok, policy_tokens = conventions(family_models["qwen2"])
    rm_tok, rm_tokens = conventions(family_models["gpt2"])
    prompts = [" Human: Sort 3 1 2 Assistant:", " Human: Sort 9 4 Assistant:"]
    answers = [" 1 2 3", " 4 9 and more"]
    answer_ids = [policy_tok(answers[0], add_special_tokens=False)["input_ids"] + [policy_tokens.eos_id],
                  policy_tok(answers[1], add_special_tokens=False)["input_ids"]]
    batch = pack_rollouts([policy_tokens.encode_prompt(policy_tok, p) for p in prompts], answer_ids,
                          policy_tokens.pad_id)
    batch = dataclasses.replace(batch, ended=torch.tensor([True, False]))  # the second answer was cut short
    spec = ModelSpec(path=str(family_models["gpt2"]), dtype="fp32").model_dump()
    torch.manual_seed(0)  # the same (fresh) score head in both workers
    bridged = RewardWorker(rank=0, world_size=1, model=spec, micro_batch_size=4, tokens=rm_tokens,
                           bridge_from=str(family_models["qwen2"]))
    seq, mask = bridged.retokenize(batch, 0, 2)
    own = [rm_tok(prompts[0] + answers[0], add_special_tokens=False)["input_ids"] + [rm_tokens.eos_id],
           rm_tok(prompts[1] + answers[1], add_special_tokens=False)["input_ids"]]
    assert [row[m.bool()].tolist() for row, m in zip(seq, mask)] == own
    torch.manual_seed(0)
    direct = RewardWorker(rank=0, world_size=1, model=spec, micro_batch_size=4, tokens=rm_tokens)
    # what a reward model with its own data would be given: its tokens, right-padded (no prompt columns)
    plain = RolloutBatch(sequences=seq, attention_mask=mask, action_mask=mask.float(), prompt_width=0)
    torch.testing.assert_close(bridged.score.computes(bridged, batch, 0, 2),
                               direct.score.computes(direct, plain, 0, 2))


def test_vllm_max_model_len_defaults_to_the_jobs_limits():
    from rlhf_ray.actors.pool import with_model_len

    job = load_job(ROOT / "configs/quickstart/ppo.yaml", ["data.max_prompt_len=40",
                                                          "generation.sampling.max_new_tokens=24"])
    assert with_model_len(job).vllm.max_model_len == 64
    job = load_job(ROOT / "configs/quickstart/ppo.yaml", ["generation.vllm.max_model_len=512"])
    assert with_model_len(job).vllm.max_model_len == 512


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(capsys, family_models):
    """Distillation compares two models' log-probs of the same ids: a teacher of another tokenizer is refused at
    validate, at its field, naming both tokenizers; one of the policy's family passes."""
    ppo = str(ROOT / "configs/quickstart/ppo.yaml")
    distill = ["--set", "ppo.advantage_estimator=distill", "--set", "critic=null", "--set", "reward.model.path=null",
               "--set", "reward.function=rlhf_ray.data.demo_sort:score", "--set", "reward.placement.colocate_with=policy",
               "--set", "generation.engine=hf", "--set", "teacher.placement.colocate_with=policy",
               "--set", "teacher.placement.num_cpus=0.25",
               "--set", f"policy.model.path={family_models['qwen2']}"]
    code, out = _validate(capsys, ppo, *distill, "--set", f"teacher.model.path={family_models['gpt2']}")
    assert code != 0 and "teacher.model.path" in out and "the teacher's tokenizer" in out, out
    assert str(family_models["gpt2"]) in out and str(family_models["qwen2"]) in out
    code, out = _validate(capsys, ppo, *distill, "--set", f"teacher.model.path={family_models['qwen2']}")
    assert code == 0, out
