"""Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration): slipstream reads and serves
their language model, checked against transformers' multimodal model on text-only inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from serve_fixtures import (
    assert_logits_match,
    assert_same_tokens,
    engine_greedy,
    positioned_logits,
    random_hf,
    save_with_tokenizer,
    transformers_greedy,
)
from test_gemma_model import GEMMA3, SHAPE

from slipstream import LLM
from slipstream.model.config import ModelConfig
from slipstream.model.weights import load_model
from slipstream.perf.shapes import resolve_model

VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)
"""A SigLIP image encoder small enough to build in milliseconds (2 x 2 patches)."""


def random_multimodal(**overrides) -> torch.nn.Module:
    """transformers' Gemma 3 image-text model, seeded, in eval mode, with its norm weights moved off
    0 (the text part is test_gemma_model's Gemma 3)."""
    text = {k: v for k, v in (SHAPE | GEMMA3).items() if k != "attn_implementation"}
    config = transformers.Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4,
                                       **overrides)
    config._attn_implementation = "eager"
    return random_hf(transformers.Gemma3ForConditionalGeneration, config)


def _save(hf: torch.nn.Module, path: Path) -> tuple[torch.nn.Module, Path]:
    return hf, save_with_tokenizer(hf, path)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def saved(request, tmp_path_factory):
    return _save(random_multimodal(tie_word_embeddings=request.param), tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return _save(random_multimodal(), tmp_path_factory.mktemp("gemma3"))


def test_the_language_model_matches_transformers_multimodal_model(saved):
    """Guards the reading of the language model: config from text_config (tying from the top level,
    as transformers ties), weights from `model.language_model.*`, the image encoder skipped; the
    logits equal transformers' on text-only ids."""
    hf, path = saved
    model = load_model(path)
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    token_ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))
    assert_logits_match(model, hf, token_ids)


def test_checkpoints_with_transformers_4_names_load_alike(saved, tmp_path):
    """Guards the older layout of the Hub's Gemma 3 checkpoints (`language_model.model.*`,
    `language_model.lm_head`, `vision_tower.*`, `multi_modal_projector.*`): same weights, same logits."""
    _, path = saved
    tensors = load_file(path / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith("model.language_model."):
            name = "language_model.model." + name.removeprefix("model.language_model.")
        elif name == "lm_head.weight":
            name = "language_model.lm_head.weight"
        else:
            name = name.removeprefix("model.")
        renamed[name] = tensor
    assert any(name.startswith("vision_tower.") for name in renamed)
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    token_ids = torch.randint(0, 320, (1, 11), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(positioned_logits(load_model(tmp_path), token_ids),
                               positioned_logits(load_model(path), token_ids), rtol=0, atol=0)


HUB_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
          "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
          "image_token_index": 262144, "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
          "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                          "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                          "sliding_window": 1024},
          "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                            "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                            "patch_size": 14, "vision_use_head": False}}
"""A config.json laid out as google/gemma-3-4b-it's: a text_config of a few keys (transformers'
defaults fill the rest), the dtype and the end-of-turn ids at the top level."""


def test_a_sparse_config_reads_as_transformers_reads_it():
    """Guards the defaults: a config.json laid out as the Hub's gemma-3-4b-it's reads as
    transformers' Gemma3Config reads it."""
    text = transformers.Gemma3Config(**HUB_4B).text_config
    config = ModelConfig.from_hf_dict(HUB_4B)
    assert config.model_type == "gemma3_text" and config.dtype == "bfloat16"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "sliding_window", "query_pre_attn_scalar", "rms_norm_eps"):
        assert getattr(config, field) == getattr(text, field), field
    assert list(config.layer_types) == text.layer_types
    assert config.rope_theta == text.rope_parameters["full_attention"]["rope_theta"]
    assert config.rope_local_theta == text.rope_parameters["sliding_attention"]["rope_theta"]
    assert config.rope_scaling.factor == 8.0 and config.tie_word_embeddings
    assert config.eos_token_ids == (1, 106)


def test_the_performance_model_prices_the_language_model(tmp_path):
    """Guards `--model config.json` of the perf commands on a multimodal checkpoint: its parameters
    are those of transformers' Gemma 3 text model built from the same text config (tied, once)."""
    (tmp_path / "config.json").write_text(json.dumps(HUB_4B))
    with torch.device("meta"):
        hf = transformers.Gemma3ForCausalLM(transformers.Gemma3Config(**HUB_4B).text_config)
    expected = sum(p.numel() for p in hf.parameters())
    assert resolve_model(str(tmp_path)).num_params() == expected


def test_the_top_level_keys_for_the_whole_model_win():
    """Guards the top level: its end-of-turn ids win over the text_config's defaults that
    transformers 5 writes (transformers' generation config takes them), and a quantization there
    is refused as in a text model's config.json."""
    written_by_transformers_5 = HUB_4B | {"text_config": HUB_4B["text_config"] | {"eos_token_id": 1}}
    assert ModelConfig.from_hf_dict(written_by_transformers_5).eos_token_ids == (1, 106)
    with pytest.raises(ValueError, match="unsupported config.json field quantization_config"):
        ModelConfig.from_hf_dict(HUB_4B | {"quantization_config": {"quant_method": "fp8"}})


def test_a_text_config_of_another_type_is_refused():
    """Guards the error: a gemma3 config.json whose text_config is not Gemma 3's text model."""
    with pytest.raises(ValueError, match="text_config has model_type 'llama'"):
        ModelConfig.from_hf_dict({"model_type": "gemma3", "text_config": {"model_type": "llama"}})


def test_the_pooling_runner_reads_the_language_model(tied):
    """Guards the pooling runner on a multimodal directory: embeddings of the language model's
    width, as its last hidden state (not a KeyError on the top level's missing hidden_size)."""
    _, path = tied
    (embedding,) = LLM(str(path), dtype="float32", runner="pooling").embed([{"prompt_token_ids": [3, 4, 5]}])
    assert len(embedding.outputs.embedding) == SHAPE["hidden_size"]


def test_the_engine_serves_the_language_model_as_transformers_generates(tied):
    """Guards serving: LLM on the multimodal directory gives transformers' greedy tokens for
    text-only prompts, under batching and chunked prefill."""
    hf, path = tied
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 320, (n,), generator=generator).tolist() for n in (3, 9, 14, 21)]
    expected, gaps = transformers_greedy(hf, prompts, 12)
    got = engine_greedy(path, prompts, 12, max_num_batched_tokens=16, max_num_seqs=4)
    assert_same_tokens(expected, gaps, got, "gemma3 multimodal")
    json.loads((path / "config.json").read_text())["vision_config"]  # the directory was left as it was
