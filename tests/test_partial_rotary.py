"""Phi-4-mini's partial rotary embedding (`partial_rotary_factor` < 1: only the first
int(head_dim * factor) dimensions of each head turn, the rest pass through), checked against
transformers' Phi3ForCausalLM: config keys, logits, gradients, the C rotary kernel, and the serving
engine's greedy tokens on the plain path, the C kernels with the decode graph, and two ranks."""

from __future__ import annotations

import json

import pytest
import torch
from serve_fixtures import uncached_greedy
from test_phi3_longrope import random_phi3

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig, load_model
from slipstream.model.create import stdlib_tokenizer
from slipstream.model.transformer import Rotary, rope_cos_sin, rope_inv_freq
from slipstream.ops import cpu_kernels
from slipstream.ops.decode_graph import CpuDecodeGraph
from slipstream.ops.inference import KernelRotary, optimize_for_cpu_inference

transformers = pytest.importorskip("transformers")

pytest_plugins = ["serve_fixtures"]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 128, 4, 2, 32
ORIGINAL, MAX_POSITIONS = 24, 192
VOCAB = 320


def _longrope(base_dim: int) -> dict:
    """Longrope factors for frequencies over `base_dim` = int(head_dim * factor): one per pair,
    rounded up (transformers' arange(0, base_dim, 2))."""
    half = (base_dim + 1) // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.5 + 0.9 * i for i in range(half)]}


def _hf_model(tmp_path, factor: float, longrope: bool, dtype: torch.dtype = torch.float32):
    """A random transformers Phi-3 with `factor`, and longrope over its rotary dims where asked,
    saved to `tmp_path` (in `dtype`) with a tokenizer."""
    rope = {"rope_scaling": _longrope(int(HEAD_DIM * factor)),
            "original_max_position_embeddings": ORIGINAL} if longrope else {}
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POSITIONS,
        partial_rotary_factor=factor, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        initializer_range=0.1, **rope)
    hf = random_phi3(config)
    hf.to(dtype).save_pretrained(tmp_path)
    stdlib_tokenizer(VOCAB).save_pretrained(tmp_path)
    return hf


def _hf_rotary_dims(hf_config) -> int:
    """The dimensions transformers' Phi-3 turns: twice its frequencies."""
    return 2 * transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf_config).inv_freq.numel()


@pytest.mark.parametrize("spelling", [
    {"partial_rotary_factor": 0.75},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    {"partial_rotary_factor": 0.5,  # the block's wins
     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
    {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 4096,  # Phi-4-mini's spelling
     "rope_scaling": {"type": "longrope", **{k: v for k, v in _longrope(24).items() if k != "rope_type"}}},
])
def test_config_reads_and_writes_the_factor_as_transformers(tmp_path, spelling):
    """Each spelling transformers reads (top level, its rope_parameters block, and a transformers 4
    rope_scaling block beside a top-level factor) gives transformers' factor and number of rotary
    dimensions; the config.json we write reads back in transformers to the same RoPE parameters."""
    d = {"model_type": "phi3", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 96,
         "num_hidden_layers": 1, "num_attention_heads": HEADS, "max_position_embeddings": 8192} | spelling
    hf = transformers.AutoConfig.for_model(**json.loads(json.dumps(d)))
    ours = ModelConfig.from_hf_dict(d)
    assert ours.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"]
    assert ours.rotary_dim == _hf_rotary_dims(hf) < HEAD_DIM
    ours.save_pretrained(tmp_path)
    again = transformers.AutoConfig.from_pretrained(tmp_path)
    for key in ("rope_type", "rope_theta", "partial_rotary_factor", "short_factor", "long_factor",
                "original_max_position_embeddings"):
        assert again.rope_parameters.get(key) == hf.rope_parameters.get(key), key
    assert _hf_rotary_dims(again) == ours.rotary_dim
    assert ModelConfig.from_pretrained(tmp_path) == ours


@pytest.mark.parametrize("change, match", [
    ({"partial_rotary_factor": 0}, "partial_rotary_factor must be a number in \\(0, 1\\], got 0"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be a number in \\(0, 1\\], got 1.5"),
    ({"partial_rotary_factor": -0.5}, "partial_rotary_factor must be a number in"),
    ({"partial_rotary_factor": "0.5"}, "partial_rotary_factor must be a number in"),
    ({"partial_rotary_factor": None}, "partial_rotary_factor must be a number in"),
    ({"partial_rotary_factor": 0.01}, "partial_rotary_factor=0.01 turns .* = 0 dimensions"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 2}}, "got 2"),
    ({"partial_rotary_factor": 0.75, "rope_scaling": _longrope(32)},
     "short_factor must have int\\(head_dim \\* partial_rotary_factor\\) / 2, rounded up, = 12 factors, "
     "got 16"),
    ({"model_type": "llama", "partial_rotary_factor": 0.5},
     "partial_rotary_factor=0.5 is only supported for model_type 'phi3', not 'llama'"),
    ({"model_type": "qwen3", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5 is only supported for model_type 'phi3', not 'qwen3'"),
])
def test_a_bad_factor_is_a_value_error_naming_it(change, match):
    """A factor outside (0, 1], one that turns no dimension, longrope factors for another number of
    dimensions, and a factor below 1 for a family whose transformers code turns the whole head:
    ValueErrors naming the factor."""
    d = {"model_type": "phi3", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 96,
         "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS} | change
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("factor, longrope", [(0.75, False), (0.5, True), (0.75, True), (0.28125, False)])
def test_logits_and_gradients_equal_transformers(tmp_path, factor, longrope):
    """fp32 logits over a sequence past longrope's original context (its long factors) and the
    gradients of every weight under a cross-entropy loss agree with transformers' to fp32
    rounding; a model that turned the whole head would be far off. 0.28125 of 32 dimensions is 9,
    odd: transformers turns 10, with frequencies over 9."""
    hf = _hf_model(tmp_path, factor, longrope)
    ours = load_model(tmp_path)
    assert ours.config.rotary_dim == _hf_rotary_dims(hf.config)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40).expand(2, 40)
    expected = hf(ids).logits
    got = ours(ids, positions)
    print(f"factor {factor}, longrope {longrope}: max |logit diff| {(got - expected).abs().max():.3g}")
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    targets = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    for logits in (expected, got):
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    grads = {name: p.grad for name, p in ours.named_parameters()}
    for name, param in hf.named_parameters():
        if name.endswith("qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            mine = torch.cat([grads[f"{prefix}{p}_proj.weight"] for p in "qkv"])
        elif name.endswith("gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            mine = torch.cat([grads[f"{prefix}{p}_proj.weight"] for p in ("gate", "up")])
        else:
            mine = grads[name]
        torch.testing.assert_close(mine, param.grad, rtol=1e-4, atol=1e-5, msg=name)
    whole = load_model(tmp_path)  # the same weights, every dimension turned
    whole.model.rope.long_inv_freq = None
    whole.model.rope.inv_freq = rope_inv_freq(ours.config.replace(partial_rotary_factor=1, rope_scaling=None))
    with torch.no_grad():
        assert (whole(ids, positions) - expected).abs().max() > 1e-2


def test_bf16_file_loads_close_to_transformers(tmp_path):
    """A checkpoint stored in bf16 loads in bf16, and its logits, plain and through the CPU
    inference fast path (the bf16 C rotary kernel), are within bf16 rounding of transformers' bf16
    forward of the same file."""
    _hf_model(tmp_path, 0.75, longrope=True, dtype=torch.bfloat16)
    hf = transformers.Phi3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert ModelConfig.from_pretrained(tmp_path).dtype == "bfloat16"
    ids = torch.randint(3, VOCAB, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(ids).logits.float()
    scale = expected.abs().max().item()
    for fast in (False, True):
        ours = load_model(tmp_path, dtype=torch.bfloat16)
        if fast:
            ours = optimize_for_cpu_inference(ours.eval())
        with torch.inference_mode():
            got = ours(ids, torch.arange(30).expand(2, 30)).float()
        diff = (got - expected).abs().max().item()
        print(f"bf16, fast path {fast}: max |logit diff| {diff:.3g} (logit scale {scale:.3g})")
        assert diff < 0.02 * scale


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_turns_only_the_rotary_dims(dtype):
    """The C rotary kernel equals the module's rotary embedding with tables of fewer dimensions
    than the head (in fp32 to rounding, in bf16 within a bf16 step) and leaves each head's last
    dimensions bit for bit as they were."""
    config = ModelConfig(model_type="phi3", vocab_size=8, hidden_size=HIDDEN, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         partial_rotary_factor=0.75)
    cos, sin = rope_cos_sin(rope_inv_freq(config), torch.tensor([[0, 1, 7, 300, 4095]]), dtype)
    assert cos.shape[-1] == 24
    q, k = torch.randn(1, 5, HEADS, HEAD_DIM).to(dtype), torch.randn(1, 5, KV_HEADS, HEAD_DIM).to(dtype)
    expected = Rotary()(q, k, cos, sin)
    got = KernelRotary()(q.clone(), k.clone(), cos, sin)
    for before, e, g in zip((q, k), expected, got, strict=True):
        assert torch.equal(g[..., 24:], before[..., 24:])
        assert (e.float() - g.float()).abs().max() <= (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("longrope", [False, True])
def test_engine_greedy_tokens_equal_transformers(tmp_path, longrope):
    """The engine's greedy tokens equal transformers' (a full forward per token) on the plain
    PyTorch path and with the C kernels, whose decode steps run in the C decode graph. With
    longrope the context passes the original one and the prompts too, so that transformers uses the
    long factors at every step, as the engine does."""
    hf = _hf_model(tmp_path, 0.75, longrope)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (25, 31, 40)]
    expected = uncached_greedy(hf, prompts, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for fast in (True, False):
        llm = LLM(str(tmp_path), dtype="float32", max_model_len=MAX_POSITIONS, block_size=4,
                  fast_cpu_kernels=fast)
        graph = llm.engine.runner.decode_graph
        assert isinstance(graph, CpuDecodeGraph) == (fast and cpu_kernels.library() is not None)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, f"fast_cpu_kernels={fast}"


@pytest.mark.usefixtures("one_torch_thread")
def test_tensor_parallel_greedy_tokens_equal_transformers(tmp_path):
    """Split over two ranks (one KV head and two query heads each), each rank turns the rotary
    dimensions of its own heads: the greedy tokens equal transformers'."""
    hf = _hf_model(tmp_path, 0.75, longrope=True)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (26, 33)]
    expected = uncached_greedy(hf, prompts, 6)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=MAX_POSITIONS, block_size=4,
              tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert got == expected
