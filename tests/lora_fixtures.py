"""PEFT LoRA adapters for tests, written as PEFT saves them, and the reference they are checked
against: the base model with each adapter merged into its weights (W + scaling * B @ A), which
transformers then runs as an ordinary checkpoint.

PEFT's format (peft.utils.save_and_load, `PeftModel.save_pretrained`): `adapter_config.json` and
`adapter_model.safetensors`, whose tensors are `base_model.model.<module>.lora_A.weight` (r, in)
and `...lora_B.weight` (out, r)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_random_adapter(
    directory: Path, hf_model: torch.nn.Module, *, rank: int = 8, alpha: float = 16.0,
    target_modules: tuple[str, ...] = ALL_PROJECTIONS, seed: int = 0, scale: float = 0.05,
    use_rslora: bool = False, rank_pattern: dict[str, int] | None = None,
) -> Path:
    """A random adapter for transformers model `hf_model` in `directory` (made if missing): every
    linear whose last name is in `target_modules` gets A and B drawn from N(0, scale^2) (B is not
    zero, as a trained adapter's is not), of `rank`, or of `rank_pattern`'s rank for a module whose
    name matches one of its regular expressions (PEFT's rule: the pattern matches the name's end)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in hf_model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.rsplit(".", 1)[-1] not in target_modules:
            continue
        if name == "lm_head":
            continue
        r = _pattern_value(rank_pattern or {}, name, rank)
        a = torch.randn(r, module.in_features, generator=generator) * scale
        b = torch.randn(module.out_features, r, generator=generator) * scale
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "target_modules": list(target_modules), "bias": "none", "use_rslora": use_rslora,
        "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "lora_dropout": 0.0,
        "rank_pattern": rank_pattern or {}, "alpha_pattern": {}, "base_model_name_or_path": "random",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory


@torch.no_grad()
def merge_adapter(hf_model: torch.nn.Module, directory: Path) -> torch.nn.Module:
    """`hf_model` with the adapter in `directory` merged into its weights, in place (computed in
    float64, rounded once to the weight's dtype)."""
    from safetensors.torch import load_file

    config = json.loads((directory / "adapter_config.json").read_text())
    tensors = load_file(directory / "adapter_model.safetensors")
    modules = dict(hf_model.named_modules())
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        r = a.shape[0]
        alpha = _pattern_value(config.get("alpha_pattern") or {}, name, config["lora_alpha"])
        scaling = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        weight = modules[name].weight
        merged = weight.double() + scaling * (b.double() @ a.double())
        weight.copy_(merged.to(weight.dtype))
    return hf_model


def _pattern_value(patterns: dict[str, float], name: str, default: float) -> float:
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return value
    return default
