"""Decoding without transformers (rlhf_ray/data/decoding.py): tokenizer.json alone decodes every bundled family's,
the tiny model's and SmolLM2's tokenizer exactly as transformers does, and a folder it cannot vouch for is decoded
by AutoTokenizer."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from rlhf_ray.data.decoding import TextDecoder, file_decodes_alike
from rlhf_ray.models.families import FAMILIES, family_tokenizer


def random_ids(tokenizer, rng: random.Random) -> list[int]:
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
    return ids + rng.sample(tokenizer.all_special_ids, min(3, len(tokenizer.all_special_ids)))


def assert_decodes_alike(folder) -> None:
    reference, decoder = AutoTokenizer.from_pretrained(folder), TextDecoder(folder)
    rng = random.Random(0)
    for _ in range(200):
        ids = random_ids(reference, rng)
        rng.shuffle(ids)
        for skip in (False, True):
            assert decoder.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), ids


@pytest.fixture(scope="module")
def family_tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    for name, family in FAMILIES.items():
        family_tokenizer(family).save_pretrained(root / name)
    return root


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_decodes_from_its_file_as_transformers_does(family_tokenizers, name):
    assert file_decodes_alike(family_tokenizers / name)
    assert_decodes_alike(family_tokenizers / name)


def test_the_tiny_model_and_smollm2_decode_from_their_files_as_transformers_does(tiny_model, smollm2):
    for folder in (tiny_model, smollm2):
        assert file_decodes_alike(folder)
        assert_decodes_alike(folder)


def test_a_folder_the_file_cannot_vouch_for_is_decoded_by_transformers(family_tokenizers, tmp_path):
    import shutil

    for change in ("clean_up", "unmarked_special", "no_file"):
        folder = tmp_path / change
        shutil.copytree(family_tokenizers / "llama3", folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        if change == "clean_up":  # transformers would clean spaces up after decoding: not the file's behaviour
            config["clean_up_tokenization_spaces"] = True
        elif change == "unmarked_special":  # the config names a special token that the file does not mark special
            data = json.loads((folder / "tokenizer.json").read_text())
            for token in data["added_tokens"]:
                token["special"] = token["content"] != config["eos_token"]
            (folder / "tokenizer.json").write_text(json.dumps(data))
        else:
            AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
            (folder / "tokenizer.json").unlink()
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        assert not file_decodes_alike(folder), change
        if change != "no_file":  # (a BPE without its file: transformers itself may not reload it)
            assert type(TextDecoder(folder).backend).__name__ != "Tokenizer"


def test_the_reward_function_actor_decodes_without_importing_transformers(tiny_model):
    """~3 s of CPU less in every reward-function actor's start (its process imports torch, not transformers)."""
    code = ("import sys; from rlhf_ray.actors.reward_function import RewardFunctionWorker; "
            f"w = RewardFunctionWorker(rank=0, world_size=1, function='rlhf_ray.data.answers:last_number_reward', "
            f"tokenizer={str(tiny_model)!r}); print(w.texts.__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["texts", "False"]
