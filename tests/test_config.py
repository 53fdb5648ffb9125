"""ModelConfig: reading and writing Hugging Face config.json, and rejecting what we cannot run."""

from __future__ import annotations

import json

import pytest

from slipstream.model import ModelConfig, RopeScaling

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
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -1.0}}, "factor"),
        ({"torch_dtype": "int8"}, "dtype 'int8'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
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


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("left_out", [("num_key_value_heads",), ("head_dim",), ("max_position_embeddings",),
                                      ("sliding_window",), ("sliding_window", "max_position_embeddings"),
                                      ("num_key_value_heads", "head_dim")])
def test_keys_left_out_mean_what_transformers_assumes(model_type, left_out):
    """A key config.json leaves out takes the default of the family's config class in transformers
    (Mistral's 4,096-token window and 8 kv heads, Qwen3's head_dim of 128, ...), as vLLM, which
    reads configs through transformers, runs it; a key given as null keeps null's meaning."""
    transformers = pytest.importorskip("transformers")
    full = {"model_type": model_type, "vocab_size": 100, "hidden_size": 256, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 16,
            "max_position_embeddings": 512, "sliding_window": 64 if model_type == "mistral" else None}
    d = {k: v for k, v in full.items() if k not in left_out}
    hf = transformers.AutoConfig.for_model(**d)
    ours = ModelConfig.from_hf_dict(d)
    assert ours.num_key_value_heads == hf.num_key_value_heads
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    window = hf.sliding_window if model_type == "mistral" else None
    # A window as long as the context is plain causal attention, which ours holds as None.
    assert ours.sliding_window == (window if window and window < hf.max_position_embeddings else None)
    if model_type == "mistral":
        assert ModelConfig.from_hf_dict(full | {"sliding_window": None}).sliding_window is None
