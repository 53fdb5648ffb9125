"""The performance model prices Gemma and Gemma 2 as slipstream runs them: parameters against the
built models (ours and transformers'), FLOPs against torch's FlopCounterMode (SDPA and Gemma 2's
explicit soft-capped attention), per-layer windows against the masks the layers apply, the CPU
decode graph's refusal against the graph itself, and the perf commands on gemma2-2b and on a saved
Gemma 2 directory. (Activation memory and eager pointwise bytes: tests/test_perf_training.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from slipstream.cli import main
from slipstream.model import ModelConfig
from slipstream.model.presets import get_preset
from slipstream.model.transformer import Transformer
from slipstream.model.weights import save_model
from slipstream.ops import cpu_kernels
from slipstream.ops.attention import causal_mask, dense_causal_attention
from slipstream.ops.decode_graph import CpuDecodeGraph
from slipstream.ops.inference import optimize_for_cpu_inference
from slipstream.perf import flops, hardware
from slipstream.perf.accelerators import get_accelerator
from slipstream.perf.efficiency import Efficiency
from slipstream.perf.fit import apply_scales
from slipstream.perf.layers import (
    Device,
    LayerSpec,
    attention_core_backward,
    attention_core_forward,
    layer_gemms,
    pointwise_forward,
)
from slipstream.perf.model import Layout, TrainSetup, predict_training
from slipstream.perf.serving import ServeSetup, cpu_decode_graph_declines, step_time
from slipstream.perf.shapes import TransformerShape, resolve_model
from slipstream.serve.runner import PagedKVCache

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
GEMMA2 = dict(model_type="gemma2", sliding_window=8, query_pre_attn_scalar=48,
              layer_types=("sliding_attention", "full_attention") * 2, attn_logit_softcapping=5.0,
              final_logit_softcapping=3.0)
CONFIGS = {"llama": dict(model_type="llama"), "gemma": dict(model_type="gemma"), "gemma2": GEMMA2}


def _config(family: str, **changes) -> ModelConfig:
    return ModelConfig(**(SMALL | CONFIGS[family] | changes))


@pytest.mark.parametrize("family", ["gemma", "gemma2"])
def test_num_params_equal_the_built_models(family):
    """Guards the parameter count (Gemma 2's four norms per layer, tied embeddings) against
    sum(numel) of slipstream's model and of transformers' (built on the meta device) for the small
    test shape and for Gemma 2 2B, through `flops.num_params` and `TransformerShape.num_params`."""
    configs = [_config(family)] + ([get_preset("gemma2-2b").config] if family == "gemma2" else [])
    for config in configs:
        with torch.device("meta"):
            ours = sum(p.numel() for p in Transformer(config).parameters())
            hf_model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**config.to_hf_dict()))
            theirs = sum(p.numel() for p in hf_model.parameters())
        print(family, config.hidden_size, "slipstream", ours, "transformers", theirs)
        shape = TransformerShape.from_model_config(config)
        assert ours == theirs == flops.num_params(config) == shape.num_params()


def _counted_flops(config: ModelConfig, batch: int, seq_len: int, backward: bool) -> int:
    torch.manual_seed(0)
    model = Transformer(config)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len))  # (B, T)
    positions = torch.arange(seq_len).expand(batch, seq_len)
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(tokens, positions)  # (B, T, V)
        if backward:
            logits.float().square().mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_flops_equal_torchs_flop_counter(family):
    """Guards the FLOP formulas against FlopCounterMode, which counts matmuls (two FLOPs a
    multiply-accumulate) but has no formula for the CPU's SDPA kernel
    (`_scaled_dot_product_flash_attention_for_cpu`): Gemma 2's explicit soft-capped attention,
    every query against every key on every layer (the windowed ones compute the whole T x T before
    masking), counts exactly `forward_flops_per_token(T)` (PaLM's, no causal halving) per token
    forward and 3x that forward and backward (`train_flops_per_token`); Llama through SDPA counts
    that less the attention (`attention_flops_per_token`) on torch 2.13."""
    config = _config(family)
    batch, seq_len = 2, 24
    sdpa = family == "llama"
    for backward, factor in ((False, 1), (True, 3)):
        counted = _counted_flops(config, batch, seq_len, backward)
        model = factor * batch * seq_len * flops.forward_flops_per_token(config, seq_len)
        attention = factor * batch * seq_len * flops.attention_flops_per_token(config, seq_len)
        print(family, "backward" if backward else "forward", "FlopCounterMode", counted, "model", model,
              "of which attention", attention)
        # (a torch whose FlopCounterMode knew the CPU SDPA kernel would count its attention too)
        assert counted in ((model - attention, model) if sdpa else (model,))
    assert flops.train_flops_per_token(config, seq_len) * batch * seq_len == model


def test_keys_follow_each_layers_window():
    """Guards per-layer windows (Gemma 2 windows only its "sliding_attention" layers) against the
    masks the layers apply (`causal_mask` with each layer's `layer_sliding_window`): the mean
    layer's keys of a prompt, of a chunk that continues one, of decode steps, the KV positions a
    chunk reads (the union of its queries' windows) and a decode step's bytes; Mistral's window on
    every layer keeps its whole-number counts."""
    config = _config("gemma2")
    layers = range(config.num_hidden_layers)

    def masks(start: int, num_tokens: int) -> list[torch.Tensor]:  # (queries, keys) per layer
        return [causal_mask(num_tokens, start + num_tokens, sliding_window=config.layer_sliding_window(i))
                for i in layers]

    def mask_keys(start: int, num_tokens: int) -> float:  # the mean layer's allowed (query, key) pairs
        return sum(mask.sum().item() for mask in masks(start, num_tokens)) / len(layers)

    def mask_positions(start: int, num_tokens: int) -> float:  # keys any query of the chunk sees
        return sum(mask.any(0).sum().item() for mask in masks(start, num_tokens)) / len(layers)

    for start, num_tokens in ((0, 30), (5, 3), (20, 7), (40, 1)):
        assert flops.causal_keys(config, start, num_tokens) == mask_keys(start, num_tokens)
        assert flops.kv_positions_read(config, start, num_tokens) == mask_positions(start, num_tokens)
    assert flops.mean_keys_per_query(config, 30) == mask_keys(0, 30) / 30
    contexts = [0, 6, 7, 30]
    assert flops.decode_keys(config, contexts, 3) == sum(mask_keys(c, 3) for c in contexts)
    shape = TransformerShape.from_model_config(config)
    assert shape.full_attention_layers == (1, 3)
    assert shape.causal_pairs(30) == mask_keys(0, 30)
    assert [shape.decode_kv_positions(c) for c in contexts] == [mask_keys(c, 1) for c in contexts]
    kv_bytes = flops.kv_cache_bytes_per_token(config, "float32")
    weights = flops.decode_bytes_per_step(config, "float32", 2, 0)
    assert flops.decode_bytes_per_step(config, "float32", 2, 30) - weights == pytest.approx(
        2 * mask_keys(29, 1) * kv_bytes)
    mistral = ModelConfig(**SMALL, model_type="mistral", sliding_window=8)
    assert flops.causal_keys(mistral, 0, 30) == 8 * 9 // 2 + 22 * 8
    assert isinstance(flops.decode_keys(mistral, contexts, 3), int)


def test_training_prices_gemma2s_explicit_attention():
    """Guards training on a soft-capped shape: the trainer computes every query against every key
    (`attention_kernel` "unfused", whatever `attention` says), so the step does at least the
    model FLOPs of full T x T attention and keeps T x T scores per head: more activation memory
    than the same shape without soft caps, by the 8 bytes per score (tanh's output, the fp32
    softmax and its bf16 cast) of the layers' heads."""
    shape = resolve_model("gemma2-2b")
    uncapped = dataclasses.replace(shape, attention_softcap=False)
    setups = [TrainSetup(shape=s, global_batch_size=8, seq_len=4096, micro_batch_size=1, attention="flash")
              for s in (shape, uncapped)]
    assert [s.attention_kernel for s in setups] == ["unfused", "flash"]
    capped, flash = (predict_training(s, Layout(dp=8, zero_stage=3), get_accelerator("h100")) for s in setups)
    extra = capped.memory.activations_bytes - flash.memory.activations_bytes
    scores = shape.num_layers * shape.num_heads * 4096 * 4096
    print("gemma2-2b activations", capped.memory.activations_bytes / 2**30, "GiB, uncapped",
          flash.memory.activations_bytes / 2**30)
    assert extra > 8 * scores
    assert capped.step_time_s > flash.step_time_s


def test_a_fitted_overhead_scales_the_module_calls_too():
    """`perf fit` folds an overhead multiplier into the per-call costs: a Gemma 2 CPU decode step
    (module by module) priced at the folded efficiency has exactly k times the overhead seconds
    (every overhead is a call count times a cost, or a host cost), its other components unchanged;
    the module calls were left unscaled, so an engine fit did not reproduce itself."""
    setup = ServeSetup(shape=TransformerShape.from_model_config(_config("gemma2")), dtype="fp32",
                       decode_graph_max_batch=256)
    cpu = hardware.get_accelerator("cpu")
    base = Efficiency(gemm_overhead_s=5e-6, kernel_overhead_s=5e-6, module_call_overhead_s=12e-6,
                      step_overhead_s=2e-4, sequence_overhead_s=2e-5)
    before, after = (step_time(setup, cpu, decode_contexts=[40], efficiency=e)
                     for e in (base, apply_scales(base, {"overhead_s": 1.5})))
    assert after.overhead_s == pytest.approx(1.5 * before.overhead_s, rel=1e-12)
    assert (after.gemm_s, after.memory_s) == (before.gemm_s, before.memory_s)


class _ScorePasses(TorchDispatchMode):
    """Bytes and kernels of the ops torch's dispatcher runs on score-sized tensors (at least
    `scores` elements), matmuls and views (outputs sharing an input's storage) left out."""

    def __init__(self, scores: int):
        super().__init__()
        self.scores, self.bytes, self.kernels = scores, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        view = any(t.untyped_storage().data_ptr() in storages for t in outputs)
        if (not func.__name__.startswith(("mm", "bmm")) and not view
                and any(t.numel() >= self.scores for t in inputs + outputs)):
            self.bytes += sum(t.numel() * t.element_size() for t in inputs + outputs)
            self.kernels += 1
        return out


@pytest.mark.parametrize("explicit", ["softcap", "sinks"])
@pytest.mark.parametrize("recipe", ["fp32", "autocast", "bf16"])
def test_explicit_score_passes_match_the_dispatcher(recipe, explicit):
    """Guards the score passes of the attention `ops.attention` computes explicitly (between its
    two matmuls: Gemma 2's soft-capped scores, gpt-oss's sinks) against what torch's dispatcher
    sees it run on score-sized tensors, forward and backward (each pass once: the backward is
    autograd's gradients of the forward's ops, not the forward twice), in fp32, in fp32 under
    bf16 autocast (the trainer) and in bf16 parameters: the bytes `attention_core_forward` and
    `attention_core_backward` stream besides their matmuls' traffic (q, k, v and the scores
    written and read: twice in the backward) within 2% (the broadcast mask's read, the sinks'
    column), the kernels exactly. Sinks were priced as a plain e-byte softmax."""
    batch, tokens, heads, head_dim = 2, 256, 8, 32
    dtype = torch.bfloat16 if recipe == "bf16" else torch.float32
    q, k, v = (torch.randn(batch, tokens, heads, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    kwargs = ({"softcap": 5.0} if explicit == "softcap"
              else {"sinks": torch.randn(heads, dtype=dtype, requires_grad=True)})
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "autocast"):
        dense_causal_attention(q, k, v, scale=0.1, **kwargs)  # the cached mask, made outside the count
        scores = batch * heads * tokens * tokens
        forward, backward = _ScorePasses(scores), _ScorePasses(scores)
        with forward:
            out = dense_causal_attention(q, k, v, scale=0.1, **kwargs)
    with backward:
        out.backward(torch.randn_like(out))

    shape = TransformerShape(name=explicit, num_layers=1, hidden_size=heads * head_dim, num_heads=heads,
                             num_kv_heads=heads, head_dim=head_dim, ffn_hidden_size=64, vocab_size=64,
                             attention_softcap=explicit == "softcap", attention_sinks=explicit == "sinks")
    e = 4 if recipe == "fp32" else 2
    device = Device(accelerator=get_accelerator("h100"), efficiency=Efficiency(), dtype="bf16",
                    element_bytes=e)
    spec = LayerSpec(shape=shape, num_tokens=batch * tokens, attention="unfused",
                     attention_pairs=batch * tokens * tokens)
    matmuls = e * batch * tokens * 4 * heads * head_dim + 2 * scores * e
    priced = [(attention_core_forward(spec, device), matmuls),
              (attention_core_backward(spec, device), 2 * matmuls)]
    for (work, matmul_bytes), seen in zip(priced, (forward, backward), strict=True):
        passes = work.memory_bytes - matmul_bytes
        print(recipe, explicit, "priced", passes / scores, "B/score, dispatcher", seen.bytes / scores,
              seen.kernels)
        assert passes == pytest.approx(seen.bytes, rel=0.02)
    assert (priced[0][0].overhead_s - 2 * Efficiency().gemm_overhead_s) / Efficiency().kernel_overhead_s == (
        pytest.approx(forward.kernels))
    assert (priced[1][0].overhead_s - 4 * Efficiency().gemm_overhead_s) / Efficiency().kernel_overhead_s == (
        pytest.approx(backward.kernels))


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")
@pytest.mark.parametrize("family", ["llama", "gemma", "gemma2"])
def test_the_decode_graph_rule_matches_the_graph(family):
    """Guards `cpu_decode_graph_declines` (the rule read off the shape) against the CPU decode
    graph itself, built for the fast-path model: it declines Gemma and Gemma 2 and holds Llama."""
    config = _config(family)
    model = optimize_for_cpu_inference(Transformer(config).eval())
    cache = PagedKVCache(config, num_blocks=4, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    graph = CpuDecodeGraph.build(model, cache.keys, cache.values)
    reason = cpu_decode_graph_declines(TransformerShape.from_model_config(config))
    print(family, "graph" if graph else "no graph", reason)
    assert (graph is None) == (reason is not None)


@pytest.mark.parametrize("family", ["llama", "gemma", "gemma2"])
def test_cpu_decode_outside_the_graph_pays_module_calls(family):
    """A CPU decode step the decode graph declines (Gemma, Gemma 2) runs module by module in the
    engine: every layer call costs `module_call_overhead_s`, so the step rises by exactly (calls
    per layer x layers) x the added cost, the calls counted in closed form from `layer_gemms` and
    the kernels the layer prices; Llama's graph-replayed step does not move."""
    shape = TransformerShape.from_model_config(_config(family))
    setup = ServeSetup(shape=shape, dtype="fp32", decode_graph_max_batch=256)
    cpu = hardware.get_accelerator("cpu")
    base = Efficiency(gemm_overhead_s=5e-6, kernel_overhead_s=5e-6, module_call_overhead_s=5e-6,
                      roofline_overlap=0.5)
    cheap, dear = (step_time(setup, cpu, decode_contexts=[40],
                             efficiency=base.replace(module_call_overhead_s=call)) for call in (5e-6, 15e-6))
    spec = LayerSpec(shape=shape, num_tokens=1, attention_pairs=41, kv_read_tokens=41)
    unit = Device(accelerator=cpu, efficiency=Efficiency(gemm_overhead_s=1.0, kernel_overhead_s=1.0),
                  dtype="fp32", element_bytes=4)
    kernels = (attention_core_forward(spec, unit) + pointwise_forward(spec, unit)).overhead_s
    calls = (kernels + sum(count for *_, count in layer_gemms(shape, 1, 1))) * shape.num_layers
    print(family, "calls", calls, "step", cheap.total_s, dear.total_s)
    expected = 0.0 if family == "llama" else calls * 10e-6
    assert dear.overhead_s - cheap.overhead_s == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_perf_commands_run_on_gemma2(tmp_path, capsys):
    """`slipstream perf train`, `serve` and `plan` run on --model gemma2-2b, and `perf serve` on a
    saved Gemma 2 model directory (its config.json read through ModelConfig)."""
    save_model(Transformer(_config("gemma2")), tmp_path / "gemma2", dtype="float32")
    commands = (
        ["perf", "train", "--model", "gemma2-2b", "--hardware", "h100", "--devices", "8", "--global-batch",
         "64", "--seq-len", "4096", "--json"],
        ["perf", "serve", "--model", "gemma2-2b", "--hardware", "h100", "--json"],
        ["perf", "plan", "--model", "gemma2-2b", "--hardware", "h100", "--devices", "8", "--global-batch",
         "64", "--seq-len", "4096", "--json"],
        ["perf", "serve", "--model", str(tmp_path / "gemma2"), "--hardware", "h100", "--input-len", "200",
         "--output-len", "100", "--context", "300", "--json"],
    )
    for argv in commands:
        assert main(argv) == 0, argv
        assert json.loads(capsys.readouterr().out)
