"""Gemma and Gemma 2 in the serving engine.

The CPU decode graph implements Llama's layer only, so it declines these models (and a Llama
model given any one of their parts), and the engine decodes them module by module.
"""

from __future__ import annotations

import logging

import pytest
import torch
from serve_fixtures import random_model

from slipstream.model import ModelConfig
from slipstream.model.transformer import GeluTanhAndMul, GemmaRMSNorm
from slipstream.ops import cpu_kernels
from slipstream.ops.decode_graph import CpuDecodeGraph
from slipstream.ops.inference import optimize_for_cpu_inference
from slipstream.serve.runner import PagedKVCache

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
CONFIGS = {
    "gemma": dict(model_type="gemma"),
    "gemma2": dict(model_type="gemma2", sliding_window=8, query_pre_attn_scalar=48,
                   layer_types=("sliding_attention", "full_attention"),
                   attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
}


def _graph(model: torch.nn.Module, config: ModelConfig) -> CpuDecodeGraph | None:
    cache = PagedKVCache(config, num_blocks=4, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    return CpuDecodeGraph.build(model, cache.keys, cache.values)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_decode_graph_declines_gemma(family, caplog):
    """Gemma's and Gemma 2's optimised models get no CPU decode graph (its C layers would compute
    Llama's math with their weights), and the log says why."""
    config = ModelConfig(**SHAPE, **CONFIGS[family])
    fast = optimize_for_cpu_inference(random_model(config))
    with caplog.at_level(logging.INFO, logger="slipstream.ops.decode_graph"):
        assert _graph(fast, config) is None
    assert "no CPU decode graph" in caplog.text


def _set_attention(layer_idx: int, name: str, value):
    def change(model):
        setattr(model.model.layers[layer_idx].self_attn, name, value)
    return change


def _set_layer(layer_idx: int, path: str, module_type):
    def change(model):
        parent, _, name = path.rpartition(".")
        setattr(model.model.layers[layer_idx].get_submodule(parent), name, module_type())
    return change


CHANGES = {
    "one layer's scores soft-capped": _set_attention(1, "softcap", 5.0),
    "one layer's score scale": _set_attention(1, "scale", 0.1),
    "one layer's window": _set_attention(0, "sliding_window", 4),
    "a Gemma norm": _set_layer(0, "post_attention_layernorm", lambda: GemmaRMSNorm(64, 1e-6)),
    "a GeGLU MLP": _set_layer(1, "mlp.act", GeluTanhAndMul),
    "scaled embeddings": lambda model: setattr(model.model, "embed_scale", 8.0),
}


@pytest.mark.parametrize("change", [None, *CHANGES])
def test_decode_graph_declines_each_part_it_does_not_implement(change):
    """A Llama model's optimised form gets a graph; given any one part of Gemma's math the C layer
    stack does not compute, it gets none."""
    config = ModelConfig(model_type="llama", **SHAPE)
    fast = optimize_for_cpu_inference(random_model(config))
    if change is not None:
        CHANGES[change](fast)
    assert (_graph(fast, config) is None) == (change is not None)
