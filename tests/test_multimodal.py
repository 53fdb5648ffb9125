"""Image inputs (LLaVA checkpoints): the image encoder and preprocessing against transformers, and
the engine's greedy tokens for prompts with images against transformers' LlavaForConditionalGeneration."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
import transformers
from serve_fixtures import random_hf

from slipstream.model.create import stdlib_tokenizer
from slipstream.model.image_processor import ImageProcessor
from slipstream.model.llava import LlavaConfig, load_image_encoder
from slipstream.model.weights import load_model

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 28, 7
"""4 x 4 patches: 16 image tokens under the "default" strategy (CLIP's class token dropped)."""
TEXT = dict(model_type="llama", vocab_size=336, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
"""LLaVA-1.5's layout (an image part renders as `<image>` and a newline), written for these tests."""


def vision_config(model_type: str = "clip_vision_model") -> dict:
    return dict(model_type=model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)


def random_llava(vision: dict | None = None, **overrides) -> torch.nn.Module:
    """transformers' LLaVA of a tiny CLIP tower and Llama, seeded, norms and biases moved off 1 and 0."""
    config = transformers.LlavaConfig(vision_config=vision or vision_config(), text_config=TEXT,
                                      image_token_index=320, **overrides)
    return random_hf(transformers.LlavaForConditionalGeneration, config, names=("norm", "bias"))


def save_llava(hf: torch.nn.Module, path: Path) -> Path:
    """A model directory: `hf` and a stdlib tokenizer with `<image>` (id 320), a chat template and
    CLIP's preprocessing at the tower's size."""
    hf.save_pretrained(path)
    tokenizer = stdlib_tokenizer(320)
    tokenizer.backend.add_special_tokens([IMAGE_TOKEN])
    assert tokenizer.token_to_id(IMAGE_TOKEN) == 320
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    processor = {"size": {"shortest_edge": IMAGE_SIZE},
                 "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}}
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


def random_image(seed: int, size: tuple[int, int] = (40, 31), mode: str = "RGB") -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels).convert(mode)


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    hf = random_llava()
    return hf, save_llava(hf, tmp_path_factory.mktemp("llava"))


@pytest.mark.parametrize("vision", ["clip_vision_model", "siglip_vision_model"])
@pytest.mark.parametrize("strategy, layer", [("default", -2), ("full", [0, -1])])
def test_image_encoder_matches_transformers(tmp_path, vision, strategy, layer):
    """Guards the vision tower (CLIP and SigLIP), the feature layer(s) and strategy, the projector and
    the weight names transformers saves: image features equal LlavaModel.get_image_features in fp32."""
    hf = random_llava(vision_config(vision), vision_feature_select_strategy=strategy,
                      vision_feature_layer=layer)
    hf.save_pretrained(tmp_path)
    config = LlavaConfig.from_pretrained(tmp_path)
    encoder = load_image_encoder(tmp_path, config, TEXT["hidden_size"], dtype=torch.float32, device="cpu")
    pixels = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.no_grad():
        expected = torch.stack(hf.model.get_image_features(
            pixels, vision_feature_layer=layer, vision_feature_select_strategy=strategy).pooler_output)
        got = encoder(pixels)
    print(f"max |difference| {(got - expected).abs().max().item():.3g}")
    assert got.shape == expected.shape == (2, encoder.num_image_tokens, TEXT["hidden_size"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_hub_layout_loads(tmp_path, llava):
    """Guards the Hub's older names (`vision_tower.vision_model.*`, `language_model.model.*`), which
    transformers 5 renames on load: both halves load from them."""
    from safetensors.torch import load_file, save_file

    hf, model_dir = llava
    tensors = load_file(model_dir / "model.safetensors")
    renamed = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor
               for name, tensor in tensors.items()}
    assert any(name.startswith("vision_tower.vision_model.") for name in renamed)
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    config = LlavaConfig.from_pretrained(tmp_path)
    encoder = load_image_encoder(tmp_path, config, TEXT["hidden_size"], dtype=torch.float32, device="cpu")
    pixels = torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE)
    ids = torch.randint(0, 320, (1, 12))
    with torch.no_grad():
        expected = hf.model.get_image_features(pixels).pooler_output[0]
        torch.testing.assert_close(encoder(pixels)[0], expected, rtol=1e-5, atol=1e-5)
        logits = load_model(tmp_path)(ids, torch.arange(12)[None])
        torch.testing.assert_close(logits, hf(ids).logits, rtol=1e-5, atol=2e-5)


def test_preprocessing_matches_clip_image_processor():
    """Guards the Pillow + NumPy preprocessing: equal to transformers' CLIPImageProcessor on odd
    sizes and modes (RGBA and palette transparency composited onto white, L, P), for shortest-edge
    resize and crop, and for a fixed-size resize without a crop."""
    rng = np.random.default_rng(0)
    transparent = random_image(3, (70, 45), "P")
    transparent.info["transparency"] = 3
    images = [random_image(1, (53, 37)), random_image(2, (29, 61), "RGBA"), random_image(4, (30, 30), "L"),
              transparent, random_image(5, (300, 200), "P"),
              PIL.Image.fromarray(rng.integers(0, 256, (61, 29, 4), dtype=np.uint8), "RGBA")]
    settings = [{"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}}, {},
                {"size": {"height": 32, "width": 24}, "do_center_crop": False, "image_mean": [0.5] * 3,
                 "image_std": [0.5] * 3}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for setting in settings:
            reference = transformers.CLIPImageProcessor(**setting)
            ours = ImageProcessor.from_dict(reference.to_dict())
            for image in images:
                expected = reference(image, return_tensors="np")["pixel_values"][0]
                np.testing.assert_allclose(ours(image), expected, rtol=0, atol=1e-6)
