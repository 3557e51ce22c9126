"""Write a trained module as a Hugging Face checkpoint, atomically (built aside, then renamed into place)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rlhf_ray.config.model import ModelSpec

ADAPTER_DIR = "adapter"
"""Inside an exported LoRA model's folder: the adapter alone (peft's adapter_config.json + weights)."""


def _merged_lora(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Rebuild the peft model on CPU from the gathered weights (the live one may be ZeRO-3 partitioned), then
    fold the adapters into the base weights."""
    from peft import get_peft_model

    base = module.get_base_model()
    cpu_model = type(base)(base.config)
    peft_model = get_peft_model(cpu_model, module.peft_config["default"])
    missing, unexpected = peft_model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "lora_" in k]:
        raise RuntimeError(f"LoRA export: weights do not match the model (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    return peft_model.merge_and_unload()


def save_hf_model(module: torch.nn.Module, state: dict[str, torch.Tensor], spec: ModelSpec, directory: Path) -> str:
    """A LoRA model is written merged (with its adapter in ADAPTER_DIR), or as the adapter alone when
    lora.merge_on_export is false."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if spec.lora.enabled and spec.lora.merge_on_export:
        _merged_lora(module, state).save_pretrained(tmp)
        module.save_pretrained(tmp / ADAPTER_DIR, state_dict=state)  # the adapter too, for peft / vLLM LoRA users
    else:
        module.save_pretrained(tmp, state_dict=state)  # a peft module saves just its adapter from this
    AutoTokenizer.from_pretrained(spec.tokenizer_path, trust_remote_code=spec.trust_remote_code,
                                  revision=spec.revision).save_pretrained(tmp)
    replace_dir(tmp, directory)
    return str(directory)


def replace_dir(new: Path, target: Path) -> None:
    """Put `new` at `target`; an existing `target` is only removed once `new` is in place."""
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)
