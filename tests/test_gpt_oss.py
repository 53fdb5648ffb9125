"""gpt-oss (`gpt_oss`) against transformers' GptOssForCausalLM.

One tiny random checkpoint saved by transformers (fp32, eager attention and experts): 4 layers
alternating a window of 4 tokens with full attention, 4 query heads on 2 KV heads, 4 experts of
which each token takes 2, gpt-oss's YaRN RoPE block, random non-zero attention sinks and biases,
and gate/up weights large enough that the SwiGLU clamp bites. Our logits, greedy tokens (engine:
continuous batching, chunked prefill, prefix caching, with and without the CPU fast path), saved
weights and training gradients are compared with transformers'; MXFP4 dequantization with
transformers' own.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from serve_fixtures import assert_same_tokens, engine_greedy, positioned_logits, transformers_greedy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from slipstream.model import ModelConfig, load_model, weights
from slipstream.model.create import stdlib_tokenizer
from slipstream.model.presets import PRESETS
from slipstream.model.transformer import Transformer
from slipstream.model.weights import dequantize_mxfp4, save_model
from slipstream.perf import flops
from slipstream.perf.serving import cpu_decode_graph_declines
from slipstream.perf.shapes import TransformerShape, resolve_model
from slipstream.serve.tensor_parallel import check_tensor_parallel
from slipstream.train.parallel import apply_tensor_parallel

transformers = pytest.importorskip("transformers")
pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB_SIZE, MAX_NEW_TOKENS, WINDOW = 512, 12, 4
SHAPE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=512,
             eos_token_id=0, pad_token_id=0,
             rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 4096,
                              "rope_theta": 150000.0})


def _hf(model_dir, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager", experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny checkpoint: matrices N(0, 0.1) but gate/up N(0, 0.4) (so |gate_up| passes the
    limit of 7 for some units), norms 1 + N(0, 0.2), biases N(0, 0.2), sinks N(0, 1)."""
    out = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**SHAPE)
    hf = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0)
            elif "bias" in name:
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, 0.4 if name.endswith("gate_up_proj") else 0.1)
    hf.save_pretrained(out)
    stdlib_tokenizer(VOCAB_SIZE).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return out


def _token_ids(seed: int, shape=(2, 19)) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, shape, generator=torch.Generator().manual_seed(seed))


def _max_diff(model, hf, ids) -> float:
    with torch.no_grad():
        return (positioned_logits(model, ids).float() - hf(ids).logits.float()).abs().max().item()


def test_config_reads_transformers_defaults(model_dir):
    """config.json as transformers writes it: every layer routed, windows on the even layers,
    gpt-oss's YaRN (attention factor 0.1 ln 32 + 1, untruncated), biases, sinks, fp32-weight norms;
    and what we write back transformers reads the same."""
    config = ModelConfig.from_pretrained(model_dir)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert [config.layer_sliding_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert config.moe_layers == (0, 1, 2, 3) and config.moe_intermediate_size == 32
    assert config.qkv_bias and config.o_bias and config.attention_sinks and config.fp32_weight_norms
    assert config.rope_scaling.rope_type == "yarn" and config.rope_scaling.truncate is False
    assert config.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(32) + 1)
    back = transformers.GptOssConfig(**config.to_hf_dict())
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    for key in ("layer_types", "sliding_window", "num_local_experts", "num_experts_per_tok", "swiglu_limit",
                "swiglu_alpha", "attention_bias", "head_dim", "rms_norm_eps"):
        assert getattr(back, key) == getattr(hf, key), key
    assert ModelConfig.from_hf_dict(back.to_dict()) == config


def test_fp32_logits_match_transformers(model_dir):
    """Prompts of 19 tokens (windows of 4 matter): transformers' fp32 logits to 2e-5."""
    hf, ours, ids = _hf(model_dir), load_model(model_dir), _token_ids(0)
    diff = _max_diff(ours, hf, ids)
    print(f"fp32 max |logit difference| {diff:.3g}")
    assert diff < 2e-5


def test_bf16_logits_close_to_transformers(model_dir):
    """In bf16 (transformers' softmax over scores and sinks in bf16, ours in fp32): within 0.2 of
    logits of a few units (0.086 measured), and the same argmax almost everywhere."""
    hf, ours, ids = _hf(model_dir, torch.bfloat16), load_model(model_dir, dtype=torch.bfloat16), _token_ids(0)
    with torch.no_grad():
        expected, got = hf(ids).logits.float(), positioned_logits(ours, ids).float()
    diff = (got - expected).abs().max().item()
    print(f"bf16 max |logit difference| {diff:.3g} (logits up to {expected.abs().max().item():.3g})")
    assert diff < 0.2
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_sinks_and_clamp_matter(model_dir):
    """The checkpoint exercises both gpt-oss particulars, so the parity tests would catch either
    missing: with the sinks at -inf (no sink) or the clamp lifted our logits leave transformers'."""
    hf, ids = _hf(model_dir), _token_ids(0)
    no_sinks = load_model(model_dir)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-torch.inf)
    unclamped = load_model(model_dir)
    for layer in unclamped.model.layers:
        layer.mlp.experts.limit = 1e9
    for label, model in (("no sinks", no_sinks), ("no clamp", unclamped)):
        diff = _max_diff(model, hf, ids)
        print(f"{label}: max |logit difference| {diff:.3g}")
        assert diff > 1e-2, label


ENGINE_CASES = {
    "batched": dict(),
    "plain modules": dict(fast_cpu_kernels=False),
    "chunked prefill": dict(max_num_batched_tokens=8, max_num_seqs=3),
    "prefix caching": dict(max_num_seqs=2, block_size=4),
    "multi-step": dict(max_num_seqs=3, num_scheduler_steps=4),
    "speculative": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 2}),
}


@pytest.fixture(scope="module")
def greedy_reference(model_dir):
    """Five prompts of 3 to 30 tokens sharing an 8-token prefix, and transformers' batched greedy
    tokens for them."""
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, VOCAB_SIZE, (8,), generator=g).tolist()
    prompts = [prefix[:n] if n <= 8 else prefix + torch.randint(3, VOCAB_SIZE, (n - 8,), generator=g).tolist()
               for n in (3, 9, 17, 24, 30)]
    return prompts, *transformers_greedy(_hf(model_dir), prompts, MAX_NEW_TOKENS)


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_greedy_tokens_match_transformers(model_dir, greedy_reference, case):
    """The engine's greedy tokens (paged attention with sinks, through the PyTorch paths; decode
    steps module by module) equal transformers' generate, in each scheduling case (several decode
    steps an engine step, n-gram speculation's verify passes included)."""
    prompts, expected, gaps = greedy_reference
    got = engine_greedy(model_dir, prompts, MAX_NEW_TOKENS, **ENGINE_CASES[case])
    assert_same_tokens(expected, gaps, got, f"gpt-oss, {case}")


def test_engine_declines_decode_graph(model_dir):
    """Neither the C decode graph nor the fused experts kernel takes gpt-oss (sinks, biased experts)."""
    from slipstream import LLM

    llm = LLM(str(model_dir), dtype="float32")
    assert llm.engine.runner.decode_graph is None


def test_saved_weights_load_in_transformers(model_dir, tmp_path):
    """Ours saved (stacked experts, sinks, router biases in HF's names) loads in transformers with
    the logits it had."""
    ours = load_model(model_dir)
    save_model(ours, tmp_path / "saved")
    ids = _token_ids(2)
    diff = _max_diff(ours, _hf(tmp_path / "saved"), ids)
    assert diff < 2e-5, diff


def test_training_step_matches_transformers(model_dir):
    """One training forward and backward (fp32, train mode): transformers' loss and every
    parameter's gradient (the sinks', router's and stacked experts' included), same names."""
    hf = _hf(model_dir).train()
    ours = load_model(model_dir).train()
    ids = _token_ids(3, (2, 13))
    positions = torch.arange(13).expand(2, 13)
    logits = ours(ids, positions)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    expected = hf(ids, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, hf_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert ours.model.layers[0].self_attn.sinks.grad.abs().max() > 0


@pytest.mark.parametrize("values_per_step", [64, 1 << 22])
def test_mxfp4_dequantization_matches_transformers(monkeypatch, values_per_step):
    """Random blocks and scales (the whole e8m0 range: overflow to inf in fp16 included)
    dequantize as transformers' convert_moe_packed_tensors does, bit for bit, whether an expert's
    rows are decoded in one step or in steps of 1 row and of 2 rows of 32 codes per group."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(0)
    for groups in (2, 1):
        monkeypatch.setattr(weights, "_MXFP4_VALUES_PER_STEP", values_per_step)
        blocks = torch.randint(0, 256, (3, 9, groups, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(0, 256, (3, 9, groups), dtype=torch.uint8, generator=g)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            expected = mxfp4.convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
            got = dequantize_mxfp4(blocks, scales, dtype)
            bits = {4: torch.int32, 2: torch.int16}[got.element_size()]  # NaNs (0 x 2^128) too
            assert got.dtype == dtype and torch.equal(got.view(bits), expected.view(bits)), (groups, dtype)


class _LargestOutput(TorchDispatchMode):
    """The bytes of the largest tensor any op makes: `torch.empty`'s (a result allocated once) and
    views and in-place results (outputs sharing an input's storage) left out."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        if func.overloadpacket is not torch.ops.aten.empty:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_mxfp4_dequantization_decodes_an_expert_at_a_time():
    """Guards the dequantization's transient memory: beside its bf16 result, no op makes a tensor
    larger than one expert's fp32 values (4 bytes x in x out); the whole tensor's int64 codes and
    fp32 values (8 times the bf16 result: 32 times that bound for 4 experts) were made at once."""
    num_experts, rows, groups = 4, 64, 4
    blocks = torch.randint(0, 256, (num_experts, rows, groups, 16), dtype=torch.uint8)
    scales = torch.randint(120, 130, (num_experts, rows, groups), dtype=torch.uint8)
    with _LargestOutput() as seen:
        dequantize_mxfp4(blocks, scales, torch.bfloat16)
    one_expert_fp32 = 4 * rows * 32 * groups
    print("largest transient", seen.largest, "bytes; one expert in fp32", one_expert_fp32)
    assert seen.largest <= one_expert_fp32


def test_mxfp4_checkpoint_loads(model_dir, tmp_path):
    """A checkpoint whose experts are MXFP4 (as the released ones, with quantization_config) loads,
    its experts dequantized as transformers dequantizes them, the rest as stored."""
    from safetensors.torch import load_file, save_file

    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    out = tmp_path / "mxfp4"
    out.mkdir()
    state = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    expected = {}
    for name in [n for n in state if n.endswith(("gate_up_proj", "down_proj"))]:
        num_experts, num_in, num_out = state.pop(name).shape
        groups = (num_experts, num_out, num_in // 32)
        blocks = torch.randint(0, 256, (*groups, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(120, 130, groups, dtype=torch.uint8, generator=g)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        expected[name] = mxfp4.convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)
    save_file(state, out / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    model = load_model(out)
    params = dict(model.named_parameters())
    for name, value in expected.items():
        assert torch.equal(params[name], value), name
    assert torch.equal(params["model.layers.0.self_attn.sinks"], state["model.layers.0.self_attn.sinks"])
    # One matrix stored both plain and quantized: a ValueError naming it, neither silently kept.
    name = "model.layers.1.mlp.experts.down_proj"
    save_file(state | {name: expected[name].contiguous()}, out / "model.safetensors")
    with pytest.raises(ValueError, match=f"{name} is stored twice"):
        load_model(out)


def test_tensor_parallel_serving_matches_transformers(model_dir, greedy_reference):
    """Two ranks (sinks split with their heads, every expert's units split, down biases once, the
    router whole), with chunked prefill: transformers' greedy tokens (2 s: a worker process)."""
    prompts, expected, gaps = greedy_reference
    got = engine_greedy(model_dir, prompts, MAX_NEW_TOKENS, tensor_parallel_size=2, max_num_batched_tokens=8)
    assert_same_tokens(expected, gaps, got, "gpt-oss, two ranks")


def test_tensor_parallel_training_refused(model_dir):
    """Tensor-parallel training refuses gpt-oss with a ValueError naming it; serving checks only
    that the split divides (intermediate_size 32 does not split 3 ways)."""
    with pytest.raises(ValueError, match="tensor_parallel_degree.*gpt_oss"):
        apply_tensor_parallel(load_model(model_dir), None, sequence_parallel=False)
    config = ModelConfig.from_pretrained(model_dir).replace(num_attention_heads=6, num_key_value_heads=3,
                                                            intermediate_size=32)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_tensor_parallel(config, 3, torch.device("cpu"))


@pytest.mark.parametrize(("change", "match"), [
    ({"swiglu_limit": 0}, "swiglu_limit must be a positive number, got 0"),
    ({"swiglu_alpha": -1.0}, "swiglu_alpha must be a positive number"),
    ({"layer_types": ["sliding_attention", "global", "full_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention"]}, "layer_types names 1 layers"),
    ({"layer_types": "sliding_attention"}, "layer_types must be a list"),
    ({"swiglu_limit": None}, "null for swiglu_limit"),
    ({"moe_intermediate_size": 64, "model_type": "gpt_oss"}, None),  # not a gpt-oss key: ignored
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
])
def test_bad_config_values(model_dir, change, match):
    """Bad gpt-oss config.json values are ValueErrors naming the key."""
    d = json.loads((model_dir / "config.json").read_text()) | change
    if match is None:
        assert ModelConfig.from_hf_dict(d).moe_intermediate_size == 32
        return
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(d)


def test_swiglu_fields_refused_for_other_families():
    """The SwiGLU limit is gpt-oss's alone."""
    with pytest.raises(ValueError, match="swiglu_limit=5.0 given for model_type 'llama'"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=2, swiglu_limit=5.0)


def _tiny_config() -> ModelConfig:
    return ModelConfig.from_hf_dict(transformers.GptOssConfig(**SHAPE).to_dict())


def test_parameter_counts_equal_the_models():
    """Total parameters (sinks, router bias, expert biases included) equal our model's and
    transformers'; active parameters equal our model's less the stacked experts' idle rows
    (X - k experts of each layer, their weights and biases)."""
    config = _tiny_config()
    with torch.device("meta"):
        ours = Transformer(config)
        hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**SHAPE))
    total = sum(p.numel() for p in ours.parameters())
    assert total == sum(p.numel() for p in hf.parameters())
    idle = sum(p[0].numel() * (config.num_experts - config.num_experts_per_tok)
               for layer in ours.model.layers for p in layer.mlp.experts.parameters())
    shape = TransformerShape.from_model_config(config)
    assert flops.num_params(config) == shape.num_params() == total
    assert flops.active_params(config) == shape.active_params() == total - idle
    assert shape.matmul_params() == flops.matmul_params(config)


def test_published_parameter_counts():
    """The presets' totals are OpenAI's 20.9B and 116.8B; active per token without the input
    embedding (OpenAI's count) 3.6B and 5.1B."""
    for name, total, active in (("gpt-oss-20b", 20.9e9, 3.6e9), ("gpt-oss-120b", 116.8e9, 5.1e9)):
        config = PRESETS[name].config
        print(name, flops.num_params(config), flops.active_params(config, include_embedding=False))
        assert abs(flops.num_params(config) - total) < 0.05e9
        assert abs(flops.active_params(config, include_embedding=False) - active) < 0.05e9


def test_forward_flops_equal_flop_counter(model_dir):
    """Forward FLOPs of the real model (router, k experts a token, attention's explicit matmuls
    over every key) equal FlopCounterMode's count of its matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    model, ids = load_model(model_dir), _token_ids(4, (2, 9))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        positioned_logits(model, ids)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    counted = sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm", "aten.bmm"))
    assert counted == flops.forward_flops_per_token(model.config, 9) * ids.numel()


@pytest.mark.parametrize(("name", "tp"), [("gpt-oss-20b", "1"), ("gpt-oss-120b", "4")])
def test_perf_predicts_the_presets(name, tp, capsys):
    """`slipstream perf serve` prices the real shapes on H100s (120B's 234 GB of bf16 weights on
    four), decoded outside the C decode graph."""
    from slipstream.cli import main

    assert main(["perf", "serve", "--model", name, "--hardware", "h100", "--tp", tp]) == 0
    assert "decode ms/token" in capsys.readouterr().out
    assert cpu_decode_graph_declines(resolve_model(name)) == "attention sinks, layers of different windows"


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_with_sinks_equals_dense(dtype, window, head_dim, use_kernel):
    """Paged attention with sinks (a prefill chunk of 5 after 6 cached tokens, a decode of 7 keys
    and one of 203, which the C decode kernel splits into chunks it merges; 4 query heads on 2 KV
    heads) equals dense causal attention with the same sinks over the whole sequences, computed
    in fp32: through the C kernels (head_dim 64 takes the prefill kernel too) and PyTorch."""
    from slipstream.ops.attention import dense_causal_attention
    from slipstream.ops.paged_attention import PagedBatch, paged_attention, write_kv

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, block_size = 4, 2, 4
    sinks = 2 * torch.randn(heads, generator=g)
    lengths, new = (11, 7, 203), (5, 1, 1)
    qs = [torch.randn(n, heads, head_dim, generator=g) for n in lengths]
    ks = [torch.randn(n, kv_heads, head_dim, generator=g) for n in lengths]
    vs = [torch.randn(n, kv_heads, head_dim, generator=g) for n in lengths]
    k_cache = torch.zeros(60, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = [[5, 1, 7], [2, 0], list(range(59, 8, -1))]
    for k, v, table in zip(ks, vs, tables, strict=True):  # every token but the new ones, cached before
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(len(k))])
        write_kv(k_cache, v_cache, k.to(dtype), v.to(dtype), slots)
    batch = PagedBatch.build(seq_lens=lengths, query_lens=new, block_tables=tables, block_size=block_size)
    q = torch.cat([q[-n:] for q, n in zip(qs, new, strict=True)]).to(dtype)
    got = paged_attention(q, k_cache, v_cache, batch, sliding_window=window, sinks=sinks.to(dtype),
                          use_kernel=use_kernel)
    def rounded(x: torch.Tensor) -> torch.Tensor:  # what the cache and the queries hold, in fp32
        return x.to(dtype).float()[None]

    expected = torch.cat([
        dense_causal_attention(rounded(q), rounded(k), rounded(v), sliding_window=window,
                               sinks=sinks.to(dtype).float())[0, -n:]
        for q, k, v, n in zip(qs, ks, vs, new, strict=True)])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
    plain = paged_attention(q, k_cache, v_cache, batch, sliding_window=window, use_kernel=use_kernel)
    assert (plain.float() - expected).abs().max() > 0.05  # the sinks matter here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_fallback_attends_in_pieces_of_bounded_scores(monkeypatch, dtype):
    """Guards the PyTorch prefill path's memory with sinks (the only one on CUDA): a chunk of 24
    queries over 64 keys (4 heads on 2) whose fp32 scores are 4.8 times the piece budget attends
    in pieces whose scores fit it, no tensor made above the budget (the whole (H, T, L + 1)
    scores, and copies beside them, were), and equals dense causal attention with the same sinks
    (and the same chunk attended whole, one piece), with a window and without, soft-capped or not."""
    from slipstream.ops import paged_attention
    from slipstream.ops.attention import dense_causal_attention

    g = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, seq_len, new = 4, 2, 4, 64, 24
    q = torch.randn(seq_len, heads, head_dim, generator=g)
    k, v = (torch.randn(seq_len, kv_heads, head_dim, generator=g) for _ in range(2))
    sinks = 2 * torch.randn(heads, generator=g)
    budget = 4 * heads * seq_len * 5  # 5 query rows of fp32 scores a piece
    monkeypatch.setattr(paged_attention, "onednn_multiplies", lambda dtype: True)  # bf16 as well

    def attend(piece_bytes, window, softcap):
        monkeypatch.setattr(paged_attention, "_SCORE_PIECE_BYTES", piece_bytes)
        with _LargestOutput() as seen:
            out = paged_attention._attend(q[-new:].to(dtype), k.to(dtype), v.to(dtype), window,
                                          softcap=softcap, sinks=sinks)
        return out.float(), seen.largest

    for window, softcap in ((None, None), (9, None), (None, 3.0)):
        pieces, largest = attend(budget, window, softcap)
        whole, _ = attend(1 << 30, window, softcap)
        expected = dense_causal_attention(*(x.to(dtype).float()[None] for x in (q, k, v)),
                                          sliding_window=window, softcap=softcap, sinks=sinks)[0, -new:]
        print(dtype, window, softcap, "largest tensor", largest, "budget", budget)
        assert largest <= budget
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(pieces, expected, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=1e-6)


def test_softmax_with_sinks_in_place_equals_the_copy():
    """The in-place sink softmax equals `softmax_with_sinks` (rows partly masked, one all masked:
    zeros, sinks above and below the scores) and writes into the scores it was given."""
    from slipstream.ops.attention import softmax_with_sinks, softmax_with_sinks_

    g = torch.Generator().manual_seed(2)
    scores = 3 * torch.randn(2, 3, 7, generator=g)
    scores[0, 1, 4:] = -torch.inf
    scores[1, 2] = -torch.inf
    sinks = torch.tensor([-9.0, 0.5, 9.0])[:, None]
    expected = softmax_with_sinks(scores, sinks)
    got = softmax_with_sinks_(scores, sinks)
    assert got.data_ptr() == scores.data_ptr()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(got[1, 2], torch.zeros(7))


def test_sinks_of_the_wrong_shape_are_value_errors():
    """Sinks that are not one logit per query head are a ValueError naming them, through paged
    attention (either path) and the C kernels' own entry (they read H floats whatever they get)."""
    from slipstream.ops import cpu_kernels
    from slipstream.ops.paged_attention import PagedBatch, paged_attention

    q, cache = torch.randn(1, 4, 64), torch.zeros(2, 4, 2, 64)
    batch = PagedBatch.build(seq_lens=(3,), query_lens=(1,), block_tables=[[1]], block_size=4)
    for use_kernel in (True, False):
        with pytest.raises(ValueError, match=r"sinks must hold one logit per query head, shape \(4,\)"):
            paged_attention(q, cache, cache, batch, sinks=torch.zeros(2), use_kernel=use_kernel)
    if cpu_kernels.library() is not None:
        with pytest.raises(ValueError, match="sinks must hold one logit per query head"):
            cpu_kernels.paged_decode_attention(q, cache, cache, batch.decode_block_tables,
                                               batch.decode_seq_lens, None, sinks=torch.zeros(4, 1))


def test_softmax_with_sinks_by_hand():
    """Each row's probabilities are exp(s_i) / (sum_j exp(s_j) + exp(sink)); a fully masked row
    gives zeros, not NaN; the sink gets a gradient."""
    from slipstream.ops.attention import softmax_with_sinks

    scores = torch.tensor([[0.5, -1.0, 2.0], [-torch.inf, -torch.inf, -torch.inf]])
    sinks = torch.tensor([[1.0], [0.3]], requires_grad=True)
    probs = softmax_with_sinks(scores, sinks)
    row = scores[0].exp() / (scores[0].exp().sum() + math.exp(1.0))
    torch.testing.assert_close(probs[0], row)
    assert torch.equal(probs[1], torch.zeros(3))
    probs[0].sum().backward()
    assert sinks.grad[0] < 0


def test_published_config_json_reads_as_the_preset(caplog):
    """openai/gpt-oss-20b's config.json (MXFP4 quantization_config, transformers 4 RoPE keys,
    its duplicate keys) reads as the `gpt-oss-20b` preset, with no key left unread."""
    published = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
        "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True,
        "vocab_size": 201088,
    }
    with caplog.at_level("WARNING"):
        config = ModelConfig.from_hf_dict(published)
    assert "ignoring" not in caplog.text
    assert config.replace(dtype="bfloat16") == PRESETS["gpt-oss-20b"].config


def test_int8_bytes_are_the_quantized_models_bytes():
    """Under int8 (ops.quant) the attention's linears are quantized, and the router and the stacked
    experts stay in the dtype: perf's weight bytes are the quantized model's, and a batch-1 decode
    reads them but the idle experts' slices (weights and biases) and the untied input table."""
    from slipstream.ops.quant import Int8Linear, quantize_linears

    config = _tiny_config().replace(dtype="bfloat16")
    model = Transformer(config).to(torch.bfloat16)
    quantize_linears(model, "int8")
    assert not any(isinstance(layer.mlp.router, Int8Linear) for layer in model.model.layers)
    tensors = {id(p): p for p in model.parameters()}
    for linear in model.modules():
        if isinstance(linear, Int8Linear):
            tensors |= {id(linear.qweight): linear.qweight, id(linear.scale): linear.scale}
    held = sum(t.nbytes for t in tensors.values())
    assert flops.weight_bytes(config, "bfloat16", "int8") == held
    idle = sum(p[0].nbytes * (config.num_experts - config.num_experts_per_tok)
               for layer in model.model.layers for p in layer.mlp.experts.parameters())
    expected = held - model.model.embed_tokens.weight.nbytes + config.hidden_size * 2 - idle
    got = flops.decode_bytes_per_step(config, "bfloat16", 1, 0, quantization="int8")
    assert got == pytest.approx(expected, rel=1e-12)


def test_perf_prices_no_tensor_parallel_training():
    """The performance model refuses tensor-parallel training of gpt-oss as the trainer does, and
    prices tensor-parallel serving, which the engine runs."""
    shape = resolve_model("gpt-oss-20b")
    assert "attention sinks" in shape.tensor_parallel_error(2)
    assert shape.tensor_parallel_error(2, serving=True) is None
    assert shape.tensor_parallel_error(1) is None


def test_init_weights_from_the_meta_device():
    """A model built on the meta device and materialized initialises every parameter (stacked
    experts normal, down at the residual std; biases and sinks zero), as training from scratch
    does, and runs a finite forward and backward."""
    config = _tiny_config()
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu")
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.std().item() == pytest.approx(0.02, rel=0.05)
    assert experts.down_proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.05)
    for tensor in (experts.gate_up_proj_bias, experts.down_proj_bias, model.model.layers[0].self_attn.sinks,
                   model.model.layers[0].mlp.router.bias):
        assert torch.equal(tensor, torch.zeros_like(tensor))
    ids = _token_ids(5, (2, 9))
    logits = model(ids, torch.arange(9).expand(2, 9))
    logits.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
