"""ModelConfig: reading and writing Hugging Face config.json, and rejecting what we cannot run."""

from __future__ import annotations

import json

import pytest

from slipstream.model import ModelConfig, RopeScaling
from slipstream.model.config import MOE_FAMILY

BASE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4)


def test_round_trip_through_config_json(family_config, tmp_path):
    """save_pretrained then from_pretrained gives back an equal config."""
    family_config.save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path) == family_config


def test_transformers_reads_our_config_json(family_config, tmp_path):
    """transformers reads the same shape, RoPE theta and scaling from the config.json we write."""
    transformers = pytest.importorskip("transformers")
    family_config.save_pretrained(tmp_path)
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.model_type == family_config.model_type
    assert hf.num_key_value_heads == family_config.num_key_value_heads
    assert hf.head_dim == family_config.head_dim
    params = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert params["rope_theta"] == family_config.rope_theta
    assert ModelConfig.from_hf_dict(hf.to_dict()) == family_config


def test_reads_transformers_4_spelling():
    """rope_theta / rope_scaling / torch_dtype (transformers 4) read like rope_parameters / dtype."""
    v4 = BASE | {"rope_theta": 500000.0, "torch_dtype": "bfloat16", "max_position_embeddings": 131072,
                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    v5 = BASE | {"dtype": "bfloat16", "max_position_embeddings": 131072,
                 "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}}
    a, b = ModelConfig.from_hf_dict(v4), ModelConfig.from_hf_dict(v5)
    assert a == b
    assert a.rope_theta == 500000.0 and a.dtype == "bfloat16"
    assert a.rope_scaling == RopeScaling(rope_type="llama3", factor=8.0)


def test_defaults_derived():
    """num_key_value_heads defaults to the head count and head_dim to hidden/heads."""
    config = ModelConfig(**BASE)
    assert config.num_key_value_heads == 4 and config.head_dim == 16


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": -5}, "vocab_size"),
        ({"head_dim": 15}, "head_dim"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -1.0}}, "factor"),
        ({"torch_dtype": "int8"}, "dtype 'int8'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1}, "use_sliding_window"),
        ({"num_attention_heads": 5}, "hidden_size"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
    ],
)
def test_unsupported_values_name_the_field(change, match):
    """Each unsupported model_type or field value is a ValueError that names it."""
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(BASE | change)


def test_missing_or_corrupt_config_json(tmp_path):
    """A missing config.json is FileNotFoundError; a corrupt one a ValueError naming the file."""
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_frozen():
    """Configs are immutable; replace() makes a validated copy."""
    config = ModelConfig(**BASE)
    with pytest.raises(AttributeError):
        config.hidden_size = 128  # type: ignore[misc]
    with pytest.raises(ValueError, match="hidden_size"):
        config.replace(hidden_size=-1)


def test_unknown_keys_are_logged(caplog):
    """Keys slipstream does not use are named in a warning rather than silently dropped."""
    ModelConfig.from_hf_dict(BASE | {"some_future_field": 1})
    assert "some_future_field" in caplog.text


def test_json_written_is_plain(tmp_path):
    """config.json is plain JSON with HF's keys (transformers 4 and 5 both load it)."""
    ModelConfig(**BASE).save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["architectures"] == ["LlamaForCausalLM"] and d["rope_theta"] == 10000.0


ALL_TYPES = ["llama", "mistral", "phi3", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]
WINDOWED = ("mistral", "mixtral", "phi3")


@pytest.mark.parametrize("model_type", ALL_TYPES)
@pytest.mark.parametrize("left_out", [("num_key_value_heads",), ("head_dim",), ("max_position_embeddings",),
                                      ("sliding_window",), ("sliding_window", "max_position_embeddings"),
                                      ("num_key_value_heads", "head_dim"), ("vocab_size",), ("hidden_size",),
                                      ("intermediate_size",), ("num_hidden_layers",),
                                      ("num_attention_heads",), ("num_experts", "num_local_experts"),
                                      ("num_experts_per_tok",), ("moe_intermediate_size",),
                                      ("shared_expert_intermediate_size",), ("norm_topk_prob",)])
def test_keys_left_out_mean_what_transformers_assumes(model_type, left_out):
    """A key config.json leaves out takes the default of the family's config class in transformers
    (Mistral's 4,096-token window and 8 kv heads, Qwen3's head_dim of 128, ...), as vLLM, which
    reads configs through transformers, runs it; a key given as null keeps null's meaning."""
    transformers = pytest.importorskip("transformers")
    full = {"model_type": model_type, "vocab_size": 100, "hidden_size": 256, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 16,
            "max_position_embeddings": 512,
            "sliding_window": 64 if model_type in WINDOWED else None}
    if model_type in MOE_FAMILY:
        full |= {"num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                 "norm_topk_prob": True}
        if model_type == "qwen2_moe":
            full["shared_expert_intermediate_size"] = 80
        if model_type == "mixtral":
            full = {k: v for k, v in full.items() if k not in ("moe_intermediate_size", "norm_topk_prob")}
    d = {k: v for k, v in full.items() if k not in left_out}
    hf = transformers.AutoConfig.for_model(**d)
    ours = ModelConfig.from_hf_dict(d)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert getattr(ours, key) == getattr(hf, key), key
    assert ours.num_key_value_heads == hf.num_key_value_heads
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    window = hf.sliding_window if model_type in WINDOWED else None
    # A window as long as the context is plain causal attention, which ours holds as None.
    assert ours.sliding_window == (window if window and window < hf.max_position_embeddings else None)
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    if model_type in MOE_FAMILY:
        assert ours.num_experts == hf.num_experts and ours.num_experts_per_tok == hf.num_experts_per_tok
        assert ours.moe_intermediate_size == getattr(hf, "moe_intermediate_size", hf.intermediate_size)
        assert ours.norm_topk_prob == getattr(hf, "norm_topk_prob", True)
        assert ours.shared_expert_intermediate_size == getattr(hf, "shared_expert_intermediate_size", None)
    if model_type in ("mistral", "phi3"):
        assert ModelConfig.from_hf_dict(full | {"sliding_window": None}).sliding_window is None


# config.json keys whose null transformers 5 refuses for some family and accepts for another, or
# accepts (null meaning "derived" or "none"); rope_theta's null is in WRONG_TYPES below.
NULL_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
             "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "sliding_window",
             "use_sliding_window", "max_window_layers", "layer_types", "rope_scaling", "rope_parameters",
             "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "attention_dropout",
             "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
             "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size",
             "router_aux_loss_coef", "output_router_logits", "resid_pdrop", "embd_pdrop",
             "original_max_position_embeddings"]


NULL_THAT_BREAKS_THE_MODEL = {("mixtral", "num_experts"), ("qwen2_moe", "num_key_value_heads")}
"""Nulls transformers' config class keeps but its model cannot be built with."""


@pytest.mark.parametrize("model_type", ALL_TYPES)
@pytest.mark.parametrize("key", NULL_KEYS)
def test_null_refused_where_transformers_refuses_it(model_type, key):
    """A null transformers 5 refuses (rms_norm_eps, max_position_embeddings, tie_word_embeddings,
    the sizes; Mistral's num_key_value_heads, Qwen3's head_dim, ...) is a ValueError naming the key,
    not silently slipstream's default nor a TypeError; a null it accepts means what it means there."""
    transformers = pytest.importorskip("transformers")
    d = {"model_type": model_type, "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         key: None}
    try:
        hf = transformers.AutoConfig.for_model(**json.loads(json.dumps(d)))
    except Exception:  # noqa: BLE001 (its error types vary by key)
        with pytest.raises(ValueError, match=f"null for {key}"):
            ModelConfig.from_hf_dict(d)
        return
    if (model_type, key) in NULL_THAT_BREAKS_THE_MODEL:
        with pytest.raises(TypeError):
            transformers.AutoModelForCausalLM.from_config(hf)
        with pytest.raises(ValueError, match=f"null for {key}"):
            ModelConfig.from_hf_dict(d)
        return
    ours = ModelConfig.from_hf_dict(d)
    assert ours.num_key_value_heads == hf.num_key_value_heads
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)




_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LINEAR = {"type": "linear", "factor": 4.0}
_DEFAULT_1E6 = {"rope_type": "default", "rope_theta": 1e6}


@pytest.mark.parametrize("rope", [
    # a rope_scaling block (model cards tell users to add one) replaces rope_parameters whole
    {"rope_parameters": _DEFAULT_1E6, "rope_scaling": _LINEAR},
    {"rope_parameters": _DEFAULT_1E6, "rope_scaling": _LINEAR, "rope_theta": 5e5},
    # the theta inside the block read wins over a top-level one
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_theta": 5e5},
    {"rope_parameters": {"rope_type": "default"}, "rope_theta": 5e5},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, "rope_theta": 5e5},
    {"rope_theta": 500000},
    # a null or empty rope_scaling leaves rope_parameters in force
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, "rope_scaling": None},
    {"rope_parameters": {"rope_type": "linear", "factor": 2, "rope_theta": 1e6}, "rope_scaling": {}},
    {"rope_parameters": None, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    # keys a linear block does not use are ignored, as transformers ignores them
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": None}},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 2048.0,
                      "low_freq_factor": "x"}},
    # a whole number written as a float (8192.0) is that integer
    {"rope_scaling": _LLAMA3 | {"original_max_position_embeddings": 8192.0}},
    # llama3 without original_max_position_embeddings: max_position_embeddings, not 8192
    {"rope_scaling": _LLAMA3, "rope_theta": 5e5},
    {"rope_parameters": _LLAMA3 | {"rope_theta": 5e5}, "max_position_embeddings": 65536},
    {"rope_parameters": _LLAMA3 | {"rope_theta": 5e5, "original_max_position_embeddings": 1024}},
])
def test_rope_read_as_transformers_reads_it(rope):
    """Whichever RoPE keys a config.json holds, in whatever combination, slipstream's inverse
    frequencies are transformers 5's (whose reading vLLM inherits)."""
    transformers = pytest.importorskip("transformers")
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from slipstream.model.transformer import rope_inv_freq

    d = BASE | {"max_position_embeddings": 16384} | rope
    hf = transformers.LlamaConfig.from_dict(json.loads(json.dumps(d)))  # it edits the dicts it reads
    ours = ModelConfig.from_hf_dict(json.loads(json.dumps(d)))
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    rope_type = ours.rope_scaling.rope_type if ours.rope_scaling else "default"
    assert rope_type == hf.rope_parameters["rope_type"]
    torch.testing.assert_close(rope_inv_freq(ours), LlamaRotaryEmbedding(hf).inv_freq, rtol=1e-6, atol=0)


def test_rope_scaling_next_to_rope_parameters_is_not_ignored():
    """A rope_scaling block added to a transformers 5 config.json is read, as transformers reads it:
    the YaRN block is served, not silently dropped for rope_parameters' default RoPE."""
    transformers = pytest.importorskip("transformers")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    d = BASE | {"rope_parameters": _DEFAULT_1E6, "rope_scaling": yarn}
    hf = transformers.LlamaConfig.from_dict(json.loads(json.dumps(d)))
    assert hf.rope_parameters["rope_type"] == "yarn"
    ours = ModelConfig.from_hf_dict(d)
    assert ours.rope_scaling.rope_type == "yarn" and ours.rope_scaling.factor == 4.0
    assert ours.rope_scaling.original_max_position_embeddings == 64


@pytest.mark.parametrize("rope, missing", [
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "high_freq_factor"),
    ({"type": "linear"}, "factor"),
])
def test_rope_keys_transformers_requires_are_required(rope, missing):
    """A RoPE block lacking a key transformers requires is a ValueError naming it (transformers: a
    KeyError), not a default slipstream makes up."""
    transformers = pytest.importorskip("transformers")
    d = BASE | {"rope_scaling": rope}
    with pytest.raises(KeyError, match=missing):
        transformers.LlamaConfig.from_dict(json.loads(json.dumps(d)))
    with pytest.raises(ValueError, match=f"rope_scaling of rope_type '.*' lacks {missing}"):
        ModelConfig.from_hf_dict(d)


# (config.json change, the ValueError's message, whether transformers 5 refuses the config too: the
# rest it accepts, then fails building the model)
WRONG_TYPES = [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'", True),
    ({"attention_bias": "false"}, "attention_bias must be true or false, got 'false'", True),
    ({"mlp_bias": 0}, "mlp_bias must be true or false, got 0", True),
    ({"eos_token_id": "0"}, "eos_token_id must be .*, got '0'", True),
    ({"eos_token_id": [1, "2"]}, r"eos_token_id must be .*, got \[1, '2'\]", True),
    ({"eos_token_id": True}, "eos_token_id must be .*, got True", True),
    ({"bos_token_id": 1.0}, "bos_token_id must be a token id .*, got 1.0", True),
    ({"pad_token_id": "0"}, "pad_token_id must be a token id .*, got '0'", False),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number, got '1e-6'", True),
    ({"rms_norm_eps": True}, "rms_norm_eps must be a positive number, got True", True),
    ({"vocab_size": 100.0}, "vocab_size must be a positive integer, got 100.0", True),
    ({"rope_theta": "5e5"}, "rope_theta must be a positive number, got '5e5'", False),
    ({"rope_theta": None}, "rope_theta must be a positive number, got None", False),
    ({"rope_scaling": {"rope_type": "linear", "factor": None}}, "factor must be a positive number, got None",
     False),
    ({"rope_parameters": {"rope_type": "linear", "factor": "2"}}, "factor must be a positive number, got '2'",
     False),
    ({"rope_scaling": _LLAMA3 | {"low_freq_factor": "1"}}, "low_freq_factor must be a positive", False),
    ({"rope_scaling": _LLAMA3 | {"original_max_position_embeddings": None}},
     "original_max_position_embeddings must be a positive integer, got None", True),
    ({"rope_scaling": _LLAMA3 | {"original_max_position_embeddings": 8192.5}},
     "original_max_position_embeddings must be a positive integer, got 8192.5", False),
    ({"rope_scaling": ["linear", 2.0]}, r"rope_scaling must be an object or null, got \['linear', 2", True),
    ({"model_type": "mistral", "sliding_window": "4096"}, "sliding_window must be a positive integer", True),
    ({"model_type": "qwen2", "use_sliding_window": "false"}, "use_sliding_window must be true or", True),
]


@pytest.mark.parametrize("change, match, transformers_refuses", WRONG_TYPES)
def test_wrong_json_types_are_named(change, match, transformers_refuses):
    """A config.json value of the wrong JSON type is a ValueError naming the key and the value, not
    read by truthiness ("false" would tie the embeddings and drop the stored lm_head) nor a bare
    TypeError naming nothing."""
    transformers = pytest.importorskip("transformers")
    d = BASE | change
    if transformers_refuses:
        with pytest.raises(Exception):  # noqa: B017 (its error types vary by key)
            transformers.AutoConfig.for_model(**json.loads(json.dumps(d)))
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(d)


def test_json_ints_read_where_floats_are_expected():
    """JSON does not tell 1 from 1.0: an int is read where a float is expected (a bool is not)."""
    linear = {"rope_type": "linear", "factor": 2}
    as_ints = BASE | {"rms_norm_eps": 1, "rope_theta": 500000, "rope_scaling": linear}
    as_floats = BASE | {"rms_norm_eps": 1.0, "rope_theta": 500000.0, "rope_scaling": linear | {"factor": 2.0}}
    config = ModelConfig.from_hf_dict(as_ints)
    assert config == ModelConfig.from_hf_dict(as_floats)
    assert isinstance(config.rms_norm_eps, float) and isinstance(config.rope_scaling.factor, float)


def test_whole_number_float_is_read_as_an_int():
    """llama3's original_max_position_embeddings of 8192.0 is the int 8192 (transformers runs it)."""
    d = BASE | {"rope_scaling": _LLAMA3 | {"original_max_position_embeddings": 8192.0}}
    original = ModelConfig.from_hf_dict(d).rope_scaling.original_max_position_embeddings
    assert original == 8192 and isinstance(original, int)


@pytest.mark.parametrize("window, rope_scaling, kept", [
    (32768, {"rope_type": "linear", "factor": 2.0}, True),
    (40000, {"rope_type": "linear", "factor": 2.0}, True),
    (65536, {"rope_type": "linear", "factor": 2.0}, False),
    (32768, None, False),
    (16384, None, True),
    (32768, _LLAMA3 | {"original_max_position_embeddings": 8192}, False),  # llama3 keeps the range
])
def test_mistral_window_compared_with_the_scaled_context(window, rope_scaling, kept):
    """A Mistral window is dropped only where it covers the whole context the engine serves,
    max_position_embeddings times a linear RoPE factor: with linear x2 a window of
    max_position_embeddings still limits attention, as in transformers."""
    transformers = pytest.importorskip("transformers")
    from types import SimpleNamespace

    from slipstream.serve.engine import _model_max_len

    d = BASE | {"model_type": "mistral", "num_key_value_heads": 4, "max_position_embeddings": 32768,
                "sliding_window": window, "rope_scaling": rope_scaling}
    hf = transformers.AutoConfig.for_model(**json.loads(json.dumps(d)))
    assert hf.sliding_window == window
    ours = ModelConfig.from_hf_dict(d)
    context = _model_max_len(ours, SimpleNamespace(model_max_length=None))
    assert ours.sliding_window == (window if kept else None)
    assert kept == (window < context)


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_rope_block_per_layer_type_is_refused(key):
    """transformers 5's per-layer-type RoPE blocks are refused by name: transformers' Llama reads
    such a block as default RoPE with theta 10000, dropping the thetas it holds."""
    transformers = pytest.importorskip("transformers")
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    d = BASE | {key: nested}
    hf = transformers.LlamaConfig.from_dict(json.loads(json.dumps(d)))
    assert hf.rope_parameters["rope_type"] == "default" and hf.rope_parameters["rope_theta"] == 10000.0
    with pytest.raises(ValueError, match=rf"{key} holds a block per layer type \(full_attention, sliding"):
        ModelConfig.from_hf_dict(d)


def test_swish_is_silu():
    """hidden_act "swish" is SiLU in transformers (ACT2FN), so it is read as "silu"."""
    pytest.importorskip("transformers")
    import torch
    from transformers.activations import ACT2FN

    x = torch.randn(64)
    torch.testing.assert_close(ACT2FN["swish"](x), torch.nn.functional.silu(x), rtol=0, atol=0)
    assert ModelConfig.from_hf_dict(BASE | {"hidden_act": "swish"}) == ModelConfig.from_hf_dict(BASE)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("change", [
    {}, {"max_window_layers": 2}, {"max_window_layers": 1}, {"max_window_layers": 0},
    {"max_window_layers": 1, "sliding_window": None},
    {"max_window_layers": 0, "layer_types": ["full_attention", "full_attention"]},
    {"max_window_layers": 2, "layer_types": ["full_attention", "sliding_attention"]},
])
def test_qwen_window_refused_only_where_a_layer_uses_it(model_type, change):
    """Qwen's use_sliding_window windows only the layers transformers' layer_types mark (by default
    those at or past max_window_layers, 28): with none such it is plain attention and is read; a
    windowed layer is refused by name."""
    transformers = pytest.importorskip("transformers")
    d = BASE | {"model_type": model_type, "num_key_value_heads": 4, "head_dim": 16,
                "use_sliding_window": True} | change
    hf = transformers.AutoConfig.for_model(**json.loads(json.dumps(d)))
    if hf.sliding_window is not None and "sliding_attention" in hf.layer_types:
        with pytest.raises(ValueError, match="use_sliding_window=True with windowed layers"):
            ModelConfig.from_hf_dict(d)
    else:
        assert ModelConfig.from_hf_dict(d).sliding_window is None


PHI3_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096,
    "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.2",
    "use_cache": True, "vocab_size": 32064,
}
"""microsoft/Phi-3-mini-4k-instruct's config.json (https://huggingface.co/microsoft/Phi-3-mini-4k-instruct),
less its `auto_map` of remote code."""


def test_phi3_mini_config_reads_as_transformers_reads_it(caplog):
    """Phi-3-mini's config.json: every field as transformers' Phi3Config holds it, its 2,047-token
    window kept (shorter than the 4,096 positions), and no key logged as ignored."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.for_model(**PHI3_MINI_4K)
    with caplog.at_level("WARNING"):
        ours = ModelConfig.from_hf_dict(PHI3_MINI_4K)
    assert not caplog.records
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "sliding_window",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, key) == getattr(hf, key), key
    assert (ours.head_dim, ours.rope_theta, ours.rope_scaling) == (96, hf.rope_parameters["rope_theta"], None)
    assert ours.dtype == "bfloat16" and ours.to_hf_dict()["architectures"] == ["Phi3ForCausalLM"]


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 47, "long_factor": [2.0] * 48}},
     "short_factor must have head_dim / 2 = 48 factors, got 47"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}}, "lacks long_factor"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [0.0] * 48}},
     "long_factor must be a positive number, got 0.0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_type 'linear' for model_type 'phi3'; supported: default, longrope"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.01}},
     "partial_rotary_factor=0.01 turns int\\(96 \\* 0.01\\) = 0 dimensions"),
    ({"partial_rotary_factor": 0.0}, "partial_rotary_factor must be a number in"),
])
def test_phi3_rope_it_cannot_run_is_refused(change, match):
    """A longrope block with too few, missing or non-positive factors, RoPE types transformers'
    Phi-3 refuses, and a partial rotary factor that turns none of each head's dimensions
    (tests/test_partial_rotary.py has the ones it can run) are ValueErrors, not wrong logits."""
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(PHI3_MINI_4K | change)
