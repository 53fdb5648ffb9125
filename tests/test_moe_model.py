"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) against transformers: logits, gradients,
checkpoints both ways, and the config errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MOE_FAMILIES

from slipstream.model import ModelConfig, Transformer, load_model, save_model
from slipstream.model.transformer import SparseMoeBlock, route
from slipstream.model.weights import checkpoint_name, model_name

transformers = pytest.importorskip("transformers")


def _inputs(vocab_size: int, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(seq).expand(batch, seq)


@pytest.mark.parametrize("seq", [1, 13])
def test_hf_checkpoint_loads_with_equal_logits(moe_family, make_hf_model, tmp_path, seq):
    hf = make_hf_model(moe_family)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ids, positions = _inputs(hf.config.vocab_size, 3, seq, seed=seq)
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - ours(ids, positions)).abs().max().item()
    assert diff < 1e-5, f"{moe_family}: max |logit diff| {diff:.3g}"


def test_layers_follow_the_config(moe_family, make_hf_model, tmp_path):
    """Routed and dense layers where transformers puts them (decoder_sparse_step, mlp_only_layers),
    with a shared expert only in qwen2_moe."""
    hf = make_hf_model(moe_family)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == theirs
    assert any(theirs) and (moe_family == "mixtral" or not all(theirs))
    assert all(hasattr(layer.mlp, "shared_expert") == (moe_family == "qwen2_moe")
               for layer in ours.model.layers if isinstance(layer.mlp, SparseMoeBlock))


def test_bf16_close_to_the_fp32_reference(moe_family, make_hf_model, tmp_path):
    hf = make_hf_model(moe_family)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    ids, positions = _inputs(hf.config.vocab_size, 2, 9)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids, positions).float()
    assert (expected - got).abs().max().item() < 0.1 * expected.abs().max().item()


def test_gradients_equal_transformers(moe_family, make_hf_model, tmp_path):
    """The cross-entropy's gradients reach the routers and the chosen experts as in transformers."""
    hf = make_hf_model(moe_family)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path).train()
    hf.train()
    ids, positions = _inputs(hf.config.vocab_size, 2, 11, seed=3)
    hf(input_ids=ids, labels=ids).loss.backward()
    logits = ours(ids, positions)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    theirs = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        if name.endswith("mlp.gate.weight") or "self_attn" in name or "shared_expert" in name:
            reference = theirs[checkpoint_name(ours.config, name).replace("block_sparse_moe", "mlp")]
            torch.testing.assert_close(param.grad, reference.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_slipstream_checkpoint_loads_in_transformers(moe_family, tmp_path):
    config = ModelConfig.from_hf_dict(_hf_dict(moe_family))
    torch.manual_seed(0)
    ours = Transformer(config)
    ours.init_weights(std=0.1)
    save_model(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    ids, positions = _inputs(config.vocab_size, 2, 7)
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - ours.eval()(ids, positions)).abs().max().item()
    assert diff < 1e-5
    assert ModelConfig.from_pretrained(tmp_path) == config


def test_mixtral_checkpoint_names():
    config = ModelConfig.from_hf_dict(_hf_dict("mixtral"))
    moe, ours = "model.layers.1.block_sparse_moe.", "model.layers.1.mlp."
    pairs = {
        f"{moe}experts.3.w1.weight": f"{ours}experts.3.gate_proj.weight",
        f"{moe}experts.3.w3.weight": f"{ours}experts.3.up_proj.weight",
        f"{moe}experts.3.w2.weight": f"{ours}experts.3.down_proj.weight",
        f"{moe}gate.weight": f"{ours}gate.weight",
        "model.layers.0.self_attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
    }
    for stored, ours in pairs.items():
        assert model_name(config, stored) == ours and checkpoint_name(config, ours) == stored
    qwen = config.replace(model_type="qwen3_moe", sliding_window=None)
    assert model_name(qwen, "model.layers.0.mlp.experts.0.gate_proj.weight").endswith("gate_proj.weight")


def test_missing_expert_is_named_as_stored(make_hf_model, tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model("mixtral").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing .*block_sparse_moe\.experts\.2\.w3\.weight"):
        load_model(tmp_path)


def test_route_picks_the_top_k_and_renormalises():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 0.0, 2.5]])
    probs = torch.softmax(logits, dim=-1)
    weights, experts = route(logits, 2, renormalize=False)
    assert experts.tolist() == [[0, 2], [1, 3]]
    torch.testing.assert_close(weights, probs.gather(1, experts))
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def _hf_dict(family: str, **changes) -> dict:
    return transformers.AutoConfig.for_model(**MOE_FAMILIES[family]).to_dict() | changes


@pytest.mark.parametrize("family, changes, message", [
    ("qwen3_moe", {"num_experts_per_tok": 7}, "num_experts_per_tok"),
    ("qwen3_moe", {"num_experts": 0}, "num_experts"),
    ("qwen3_moe", {"mlp_only_layers": ["1"]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen3_moe", {"router_aux_loss_coef": -1.0}, "router_aux_loss_coef"),
    ("qwen3_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ("qwen3_moe", {"num_experts": 6, "num_local_experts": 8}, "num_local_experts"),
    ("mixtral", {"router_jitter_noise": -0.1}, "router_jitter_noise"),
    ("qwen2_moe", {"qkv_bias": False}, "qkv_bias"),
    ("qwen2_moe", {"shared_expert_intermediate_size": None}, "shared_expert_intermediate_size"),
])
def test_bad_expert_config_is_a_value_error(family, changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(_hf_dict(family, **changes))


def test_experts_on_a_dense_family_are_refused():
    dense = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
             "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="num_local_experts"):
        ModelConfig.from_hf_dict(dense | {"num_local_experts": 8})
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig(**{k: v for k, v in dense.items()}, num_experts=4)
    with pytest.raises(ValueError, match="needs num_experts"):
        ModelConfig(**(dense | {"model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig(**dense, mlp_only_layers=(5, 7))
    # In a dense family's config.json, expert settings without a count mean nothing (transformers
    # ignores them too) and are not kept.
    read = ModelConfig.from_hf_dict(dense | {"num_experts_per_tok": 4, "decoder_sparse_step": 2,
                                             "output_router_logits": True})
    assert read == ModelConfig.from_hf_dict(dense)


def test_layers_past_the_model_in_mlp_only_layers_name_none():
    """transformers builds a model whose mlp_only_layers name layers it does not have."""
    d = _hf_dict("qwen3_moe", mlp_only_layers=[0, 7], decoder_sparse_step=1)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**d))
    assert ModelConfig.from_hf_dict(d).moe_layers == (1, 2)


def test_block_sums_in_the_input_dtype_under_autocast(moe_family, make_hf_model, tmp_path):
    """Under bf16 autocast the experts compute in bf16 and their weighted rows are summed in the
    block's fp32 input dtype, as transformers sums them."""
    hf = make_hf_model(moe_family)
    hf.save_pretrained(tmp_path)
    block = next(m for m in load_model(tmp_path).modules() if isinstance(m, SparseMoeBlock))
    theirs = next(layer.mlp for layer in hf.model.layers
                  if type(layer.mlp).__name__.endswith("SparseMoeBlock"))
    x = torch.randn(1, 5, hf.config.hidden_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = block(x), theirs(x)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_config_round_trips_through_transformers(moe_family):
    """to_hf_dict is read by transformers' config class as the same model: every MoE key it writes
    lands where transformers looks for it."""
    config = ModelConfig.from_hf_dict(_hf_dict(moe_family))
    hf = transformers.AutoConfig.for_model(**config.to_hf_dict())
    assert ModelConfig.from_hf_dict(hf.to_dict()) == config
    assert hf.num_experts_per_tok == config.num_experts_per_tok
    assert hf.num_experts == config.num_experts


@pytest.mark.parametrize("family, window_keys", [
    ("qwen3_moe", {}), ("qwen2_moe", {"max_window_layers": 0}), ("qwen2_moe", {"max_window_layers": 1}),
    ("qwen2_moe", {"max_window_layers": 3}),
    ("qwen2_moe", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
])
def test_qwen_moe_windows_as_transformers_derives_them(family, window_keys):
    """`use_sliding_window` windows qwen3_moe's every layer and qwen2_moe's even layers below
    max_window_layers (or those layer_types names): a config with a windowed layer is refused,
    one without any is plain attention, as transformers builds it."""
    d = _hf_dict(family) | {"use_sliding_window": True, "sliding_window": 4} | window_keys
    if "layer_types" not in window_keys:
        d.pop("layer_types", None)  # transformers derives them from max_window_layers
    hf = transformers.AutoConfig.for_model(**d)
    if family == "qwen3_moe":
        windowed = hf.sliding_window is not None
    else:
        windowed = "sliding_attention" in hf.layer_types
    if windowed:
        with pytest.raises(ValueError, match="use_sliding_window"):
            ModelConfig.from_hf_dict(d)
    else:
        assert ModelConfig.from_hf_dict(d).sliding_window is None


def test_replace_rederives_mixtral_expert_width():
    config = ModelConfig.from_hf_dict(_hf_dict("mixtral"))
    wider = config.replace(intermediate_size=128)
    assert wider.moe_intermediate_size == 128
    assert config.replace(model_type="qwen3_moe", sliding_window=None).moe_intermediate_size == 96


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts"])
@pytest.mark.parametrize("value", [[4], {"n": 4}, "4", 2.5, True])
def test_expert_count_of_a_wrong_type_is_a_value_error(key, value):
    d = {k: v for k, v in _hf_dict("qwen3_moe").items() if k not in ("num_experts", "num_local_experts")}
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict(d | {key: value})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, 37, 300])
def test_block_sums_as_the_loop_over_experts(moe_family, make_hf_model, tmp_path, dtype, num_rows):
    """On a CPU the block adds all routed rows with one index_add_; its output equals, bit for bit,
    the loop over experts of transformers' eager implementation (each expert on its tokens, its
    output times the routing weight, added in increasing expert order), also where some experts get
    no token (few rows)."""
    make_hf_model(moe_family).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=dtype)
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    x = torch.randn(num_rows, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        weights, experts = route(block.gate(x), block.top_k, block.renormalize)
        if not block.fp32_weights:
            weights = weights.to(dtype)
        expected = torch.zeros_like(x)
        for e in range(block.num_experts):
            tokens, choice = torch.where(experts == e)
            if len(tokens):
                rows = block.experts[e](x[tokens]) * weights[tokens, choice, None]
                expected.index_add_(0, tokens, rows.to(dtype))
        if hasattr(block, "shared_expert"):
            expected = expected + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        assert torch.equal(block(x), expected)


def test_mixtral_router_jitter_in_training_only(make_hf_model, tmp_path):
    """Mixtral's router_jitter_noise (a config field of fine-tunes trained with it) leaves inference
    alone and, in training, multiplies the routed input by transformers' noise: the same seed gives
    transformers' training-mode logits."""
    hf = make_hf_model("mixtral", router_jitter_noise=0.2)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.router_jitter_noise == 0.2
    ids, positions = _inputs(hf.config.vocab_size, 2, 9)
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ours(ids, positions)).abs().max().item() < 1e-5
        hf.train(), ours.train()
        torch.manual_seed(7)
        expected = hf(input_ids=ids).logits
        torch.manual_seed(7)
        got = ours(ids, positions)
        torch.manual_seed(8)
        other = ours(ids, positions)
    assert (expected - got).abs().max().item() < 1e-5
    assert (got - other).abs().max().item() > 1e-3
