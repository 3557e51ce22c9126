"""A GGUF import keeps what the file says about its special tokens: add BOS / EOS, every stop id (eos, end of turn,
end of message), the chat template (or none, for a base model), named templates and sampling defaults. Checked on
small GGUF files written here (tests/tiny_gguf.py), for a byte-level BPE vocabulary (Llama, SmolLM2) and a
SentencePiece one (Gemma 3), through our TokenConventions and through plain transformers."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlhf_ray.data.tokens import TokenConventions
from rlhf_ray.models.gguf_tokens import read_gguf_tokens
from rlhf_ray.models.sources import import_gguf
from tests.tiny_gguf import BOS, EOM, EOS, EOT, GGUFSpec, write_tiny_gguf

TEMPLATE = "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}<eot>{% endfor %}"


def imported(tmp_path, spec: GGUFSpec):
    tmp_path.mkdir(parents=True, exist_ok=True)
    file = write_tiny_gguf(tmp_path / f"{spec.arch}.gguf", spec)
    out = import_gguf(file, tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(out)
    return out, tokenizer, TokenConventions.from_tokenizer(tokenizer, out)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("add_bos", [True, False])
def test_the_add_bos_flag_reaches_transformers_and_the_token_conventions(tmp_path, arch, add_bos):
    out, tokenizer, tokens = imported(tmp_path, GGUFSpec(arch=arch, add_bos=add_bos))
    assert read_gguf_tokens(tmp_path / f"{arch}.gguf").add_bos is add_bos
    plain = tokenizer("hi a", add_special_tokens=False)["input_ids"]
    assert tokenizer("hi a")["input_ids"] == ([BOS] if add_bos else []) + plain  # plain transformers
    assert tokens.prefix_ids == ((BOS,) if add_bos else ())  # what every prompt the project builds starts with
    assert tokens.encode_prompt(tokenizer, "hi a") == ([BOS] if add_bos else []) + plain
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is add_bos
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == {"llama": "LlamaForCausalLM",
                                                                         "gemma3": "Gemma3ForCausalLM"}[arch]


def test_add_eos_puts_eos_after_the_text_but_never_in_a_prompt(tmp_path):
    _, tokenizer, tokens = imported(tmp_path, GGUFSpec(add_bos=True, add_eos=True))
    plain = tokenizer("hi", add_special_tokens=False)["input_ids"]
    assert tokenizer("hi")["input_ids"] == [BOS, *plain, EOS]
    assert tokens.prefix_ids == (BOS,) and tokens.encode_prompt(tokenizer, "hi") == [BOS, *plain]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_end_of_turn_and_end_of_message_ids_stop_generation(tmp_path, arch):
    out, _, tokens = imported(tmp_path, GGUFSpec(arch=arch, eot=True, eom=True))
    assert tokens.stop_ids == (EOS, EOT, EOM) and tokens.eos_id == EOS
    assert GenerationConfig.from_pretrained(out).eos_token_id == [EOS, EOT, EOM]  # plain `generate` stops on each


def test_without_end_of_turn_eos_alone_stops(tmp_path):
    out, _, tokens = imported(tmp_path, GGUFSpec())
    assert tokens.stop_ids == (EOS,) and GenerationConfig.from_pretrained(out).eos_token_id == EOS


def test_a_chat_template_is_kept_and_a_base_model_has_none(tmp_path):
    _, with_template, _ = imported(tmp_path / "a", GGUFSpec(chat_template=TEMPLATE))
    assert with_template.chat_template == TEMPLATE
    assert with_template.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<bos>user: hi<eot>"
    _, base, _ = imported(tmp_path / "b", GGUFSpec(arch="gemma3", chat_template=None))
    assert base.chat_template is None


def test_named_chat_templates_are_kept_beside_the_default(tmp_path):
    tool = "TOOLS {% for m in messages %}{{ m['content'] }}{% endfor %}"
    _, tokenizer, _ = imported(tmp_path, GGUFSpec(chat_template=TEMPLATE, named_templates={"tool_use": tool}))
    message = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(message, tokenize=False) == "<bos>user: hi<eot>"
    assert tokenizer.apply_chat_template(message, tokenize=False, chat_template="tool_use") == "TOOLS hi"


def test_sampling_defaults_reach_the_generation_config(tmp_path):
    out, _, _ = imported(tmp_path, GGUFSpec(sampling={"temp": 0.6, "top_k": 20, "top_p": 0.95}))
    config = GenerationConfig.from_pretrained(out)
    assert config.do_sample and config.temperature == pytest.approx(0.6) and config.top_k == 20
    assert config.top_p == pytest.approx(0.95)
