"""The model: config, the decoder, weights and tokenizer. Pure math; no distributed, paging or
training code lives here.

`Transformer`, `load_model` and `save_model` load torch on first use, so that the torch-free
parts (`ModelConfig`, the presets, the tokenizer) import in a fraction of a second: the
performance model's commands (`slipstream perf plan`) never need torch.
"""

import importlib

from slipstream.model.config import ModelConfig, RopeScaling

__all__ = ["ModelConfig", "RopeScaling", "Transformer", "load_model", "save_model"]

_EXPORTS = {
    "Transformer": "slipstream.model.transformer",
    "load_model": "slipstream.model.weights",
    "save_model": "slipstream.model.weights",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'slipstream.model' has no attribute {name!r}")
