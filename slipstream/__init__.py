"""slipstream: serve, train and measure large language models on PyTorch.

`LLM`, `SamplingParams`, `BeamSearchParams`, `StructuredOutputsParams`, `PoolingParams`,
`LoRARequest` and `RequestOutput` are importable from here; they load on first use, so that
torch-free parts (the scheduler, the performance model) stay importable without torch.
"""

import importlib

__all__ = ["LLM", "BeamSearchParams", "LoRARequest", "PoolingParams", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]

_EXPORTS = {
    "LLM": "slipstream.serve.llm",
    "BeamSearchParams": "slipstream.serve.beam_search",
    "LoRARequest": "slipstream.serve.lora",
    "PoolingParams": "slipstream.serve.pooling",
    "RequestOutput": "slipstream.serve.request",
    "SamplingParams": "slipstream.serve.request",
    "StructuredOutputsParams": "slipstream.serve.structured",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'slipstream' has no attribute {name!r}")
