"""A peft LoRA model's weights as the base model's: adapters folded into the weights they adapt, names without peft's
wrappers. The generation engines load these (they serve the plain architecture), bucket by bucket."""

from __future__ import annotations

import torch

PEFT_PREFIX = "base_model.model."
ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def lora_owner(name: str) -> str | None:
    """The LoRA-wrapped module a parameter belongs to (its base weight or bias, or an adapter), else None."""
    for part in (".base_layer.", *ADAPTER_PARTS):
        if part in name:
            return name.split(part)[0]
    return None


def units(names: list[str]) -> list[list[str]]:
    """Parameter names in module order, those of one LoRA-wrapped module together (they fold as one)."""
    out, where = [], {}
    for name in names:
        owner = lora_owner(name)
        if owner is None:
            out.append([name])
        elif owner in where:
            out[where[owner]].append(name)
        else:
            where[owner] = len(out)
            out.append([name])
    return out


def is_adapter(name: str) -> bool:
    return any(part in name for part in ADAPTER_PARTS)


def adapter_file_name(name: str) -> str:
    """A live adapter tensor's name -> its name in peft's adapter_model.safetensors (no adapter name), as vLLM's
    LoRA loader reads it."""
    return name.replace(".default.", ".")


def adapter_config(lora, base_model: str | None) -> dict:
    """peft's adapter_config.json for the policy's LoRA spec."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": 0.0, "target_modules": list(lora.target_modules), "bias": "none",
            "fan_in_fan_out": False, "base_model_name_or_path": base_model}


def base_name(name: str) -> str:
    """peft's name of a base-model tensor -> the base model's own."""
    name = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
    return name.replace(".modules_to_save.default.", ".")


def folded(module: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`named` (whole LoRA units, as `units` groups them) as base-model tensors: W + scaling * B @ A for each
    adapted weight (computed in fp32, returned in W's dtype), adapters and the frozen copies that
    `modules_to_save` keeps dropped."""
    tensors = dict(named)
    out = []
    for name, tensor in named:
        if is_adapter(name) or ".original_module." in name:
            continue
        if name.endswith(".base_layer.weight"):
            owner = name.removesuffix(".base_layer.weight")
            layer = module.get_submodule(owner)
            for adapter in layer.active_adapters:
                if f"{owner}.lora_A.{adapter}.weight" not in tensors or getattr(layer, "use_dora", {}).get(adapter):
                    raise ValueError(f"lora.target_modules: {base_name(owner)} is a {type(layer).__name__}; only plain "
                                     "LoRA on linear layers folds into the engines' weights (no embeddings, no DoRA)")
                a, b = tensors[f"{owner}.lora_A.{adapter}.weight"], tensors[f"{owner}.lora_B.{adapter}.weight"]
                delta = (b.float() @ a.float()) * layer.scaling[adapter]
                if getattr(layer, "fan_in_fan_out", False):
                    delta = delta.T
                tensor = (tensor.float() + delta).to(tensor.dtype)
        out.append((base_name(name), tensor))
    return out
