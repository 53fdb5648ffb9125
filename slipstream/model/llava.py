"""LLaVA checkpoints (`model_type` "llava", transformers' LlavaForConditionalGeneration) and Gemma 3's
multimodal ones ("gemma3", Gemma3ForConditionalGeneration): the image half of their config.json
and weights. The language model is read as any text model is
(`config.language_model_dict`, `weights.load_model`, which skips the image encoder's tensors);
this module reads `vision_config`, the image token and the feature settings, and loads the vision
tower and projector (`vision.ImageEncoder`).

The weight layouts read: transformers 5's in memory (`model.vision_tower.*`,
`model.multi_modal_projector.*`), as it saves them (`vision_tower.*`, `multi_modal_projector.*`)
and the Hub's older checkpoints (`vision_tower.vision_model.*`). Tensors the encoder never uses
(the layers past the deepest feature layer, the vision tower's final norm, SigLIP's pooling head,
old CLIP dumps' `position_ids` buffer) are skipped.

Gemma 3's encoder is its SigLIP tower whole, final norm included, and its own projector
(`vision.Gemma3ImageEncoder`); its prompts mark an image by the begin-of-image token
(`boi_token_index`), which the engine expands to the image's `mm_tokens_per_image` image tokens
between begin and end tokens, and its image tokens attend to each other both ways
(`bidirectional_images`).

A Granite language model is refused: transformers multiplies all its input embeddings, the images'
rows too, by `embedding_multiplier` inside the text model, where slipstream scales only the token
embeddings and puts the images' rows in place after.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch

from slipstream.model.vision import (
    ACTIVATIONS,
    VISION_TYPES,
    Gemma3ImageEncoder,
    ImageEncoder,
    VisionConfig,
    resolve_feature_layers,
)

_VISION_DEFAULTS = {
    "clip_vision_model": {},
    "siglip_vision_model": {"patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
}
"""Each vision family's transformers defaults where they differ from VisionConfig's (CLIP's)."""

_LLAVA_VISION_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "image_size": 336, "patch_size": 14}
"""The vision tower transformers' LlavaConfig builds where config.json gives no vision_config
(LLaVA-1.5's CLIP ViT-L/14 at 336 pixels)."""

SELECT_STRATEGIES = ("default", "full")

_UNSCALED_IMAGE_ROWS = ("granite",)
"""Text families whose transformers model scales all its input embeddings, image rows included,
where slipstream's `Decoder.embed` scales only the token embeddings (Gemma scales inside its
embedding table in both, so its image rows stay unscaled in both)."""

_ENCODER_TENSOR = re.compile(r"(?:model\.)?(vision_tower\.|multi_modal_projector\.)(?:vision_model\.)?(.+)")
_UNUSED = re.compile(r"vision_tower\.(?:post_layernorm\..+|head\..+|embeddings\.position_ids)")
"""Stored tensors the encoder has no use for: the final norm, SigLIP's pooling head, and the
`position_ids` buffer that CLIP checkpoints saved before transformers 4.31 hold (0, 1, ... in
order, which the position embedding's rows already are)."""


MODEL_TYPES = ("llava", "gemma3")

_GEMMA3_TOKENS = {"image_token_index": 262_144, "boi_token_index": 255_999, "eoi_token_index": 256_000}
"""Gemma 3's special tokens, transformers' Gemma3Config defaults (config.json may spell each
`*_token_id`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlavaConfig:
    """What a llava or gemma3 config.json says about images (its language model is a `ModelConfig`)."""

    vision: VisionConfig
    model_type: str = "llava"
    image_token_index: int = 32000
    vision_feature_layer: tuple[int, ...] = (-2,)
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = True
    mm_tokens_per_image: int = 256
    """Gemma 3's tokens per image (its pooled grid); LLaVA's follow from the tower."""
    boi_token_index: int | None = None
    """Gemma 3's begin-of-image token: a prompt's image placeholder; None for LLaVA (whose
    placeholder is the image token)."""
    eoi_token_index: int | None = None

    @property
    def bidirectional_images(self) -> bool:
        """Whether an image's tokens attend to each other both ways (Gemma 3), so that each image
        must be computed in one chunk (the scheduler's disable_chunked_mm_input)."""
        return self.model_type == "gemma3"

    @property
    def placeholder_token_index(self) -> int:
        """The token that marks an image in a prompt before it is expanded."""
        return self.image_token_index if self.boi_token_index is None else self.boi_token_index

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)}, got {self.model_type!r}")
        for key in ("image_token_index", "boi_token_index", "eoi_token_index"):
            index = getattr(self, key)
            if (index is not None or key == "image_token_index") and (
                    isinstance(index, bool) or not isinstance(index, int) or index < 0):
                raise ValueError(f"{key} must be a non-negative integer, got {index!r}")
        tokens = self.mm_tokens_per_image
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"mm_tokens_per_image must be a positive integer, got {tokens!r}")
        if self.vision_feature_select_strategy not in SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy must be one of {', '.join(SELECT_STRATEGIES)}, "
                             f"got {self.vision_feature_select_strategy!r}")
        if self.projector_hidden_act not in ACTIVATIONS:
            raise ValueError(f"projector_hidden_act must be one of {', '.join(ACTIVATIONS)}, "
                             f"got {self.projector_hidden_act!r}")
        if not isinstance(self.multimodal_projector_bias, bool):
            raise ValueError(f"multimodal_projector_bias must be true or false, got "
                             f"{self.multimodal_projector_bias!r}")
        resolve_feature_layers(self.vision_feature_layer, self.vision.num_hidden_layers)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlavaConfig:
        """Read a parsed llava or gemma3 config.json; a value of the wrong kind is a ValueError
        naming its key."""
        if d.get("model_type") == "gemma3":
            return cls._from_gemma3_dict(d)
        layers = d.get("vision_feature_layer", -2)
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if not isinstance(layers, list) or not layers or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ValueError(f"vision_feature_layer must be an integer or a list of them, got {layers!r}")
        text = d.get("text_config")
        if isinstance(text, dict) and text.get("model_type") in _UNSCALED_IMAGE_ROWS:
            raise ValueError(f"text_config.model_type {text['model_type']!r} is not supported for llava "
                             "checkpoints: transformers scales the image embeddings by its "
                             "embedding_multiplier, which slipstream's image rows would miss")
        index = d.get("image_token_index", d.get("image_token_id", 32000))
        fields = {"vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
                  "multimodal_projector_bias": True}
        return cls(vision=_vision_config(d.get("vision_config")), image_token_index=index,
                   vision_feature_layer=tuple(layers), **{k: d.get(k, v) for k, v in fields.items()})

    @classmethod
    def _from_gemma3_dict(cls, d: dict[str, Any]) -> LlavaConfig:
        """Gemma3Config's image keys: its vision_config is SigLIP's (transformers' defaults for
        what it leaves out), the tower is used whole, and tokens are named *_index or *_id."""
        vision = d.get("vision_config") or {}
        if not isinstance(vision, dict):
            raise ValueError(f"config.json's vision_config must be an object, got {vision!r}")
        vision = _vision_config({"model_type": "siglip_vision_model"} | vision)
        if vision.model_type != "siglip_vision_model":
            raise ValueError(f"a gemma3 checkpoint's vision_config.model_type must be 'siglip_vision_model', "
                             f"got {vision.model_type!r}")
        tokens = {key: d.get(key, d.get(key.replace("_index", "_id"), default))
                  for key, default in _GEMMA3_TOKENS.items()}
        return cls(vision=vision, model_type="gemma3", mm_tokens_per_image=d.get("mm_tokens_per_image", 256),
                   vision_feature_layer=(vision.num_hidden_layers,), **tokens)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> LlavaConfig | None:
        """The image settings of `model_dir/config.json`, None where it is not a llava or gemma3
        checkpoint."""
        d = json.loads((Path(model_dir) / "config.json").read_text())
        return cls.from_hf_dict(d) if isinstance(d, dict) and d.get("model_type") in MODEL_TYPES else None


def _vision_config(d: Any) -> VisionConfig:
    """`vision_config` with its family's transformers defaults for the keys it leaves out (LLaVA's
    own CLIP tower where there is none); keys that do not change the features are ignored."""
    if d is None:
        return VisionConfig(**_LLAVA_VISION_DEFAULTS)
    if not isinstance(d, dict):
        raise ValueError(f"config.json's vision_config must be an object, got {d!r}")
    model_type = d.get("model_type", "clip_vision_model")
    if model_type not in VISION_TYPES:
        raise ValueError(f"vision_config.model_type must be one of {', '.join(VISION_TYPES)}, "
                         f"got {model_type!r}")
    known = {f.name for f in dataclasses.fields(VisionConfig)}
    return VisionConfig(**_VISION_DEFAULTS[model_type] | {k: v for k, v in d.items() if k in known})


def build_image_encoder(config: LlavaConfig, text_hidden_size: int) -> ImageEncoder | Gemma3ImageEncoder:
    """The encoder of `config`, its parameters uninitialised (on the default device)."""
    if config.model_type == "gemma3":
        return Gemma3ImageEncoder(config.vision, text_hidden_size=text_hidden_size,
                                  tokens_per_image=config.mm_tokens_per_image)
    return ImageEncoder(
        config.vision, text_hidden_size=text_hidden_size,
        feature_layers=resolve_feature_layers(config.vision_feature_layer, config.vision.num_hidden_layers),
        drop_class_token=config.vision_feature_select_strategy == "default",
        projector_act=config.projector_hidden_act, projector_bias=config.multimodal_projector_bias)


def encoder_name(name: str, num_layers: int, *, final_norm: bool = False) -> str | None:
    """The `ImageEncoder` parameter that checkpoint tensor `name` fills; None for a tensor of the
    language model or one the encoder does not use (see the module docstring; the tower's final
    norm is used where `final_norm`, Gemma 3's)."""
    match = _ENCODER_TENSOR.fullmatch(name)
    if match is None:
        return None
    name = "".join(match.groups())
    if _UNUSED.fullmatch(name) and not (final_norm and name.startswith("vision_tower.post_layernorm.")):
        return None
    layer = re.match(r"vision_tower\.encoder\.layers\.(\d+)\.", name)
    return None if layer and int(layer.group(1)) >= num_layers else name


def load_image_encoder(
    model_dir: str | Path, config: LlavaConfig, text_hidden_size: int, *,
    dtype: torch.dtype, device: torch.device | str,
) -> ImageEncoder | Gemma3ImageEncoder:
    """The image encoder of a llava or gemma3 checkpoint, in `dtype` on `device`. Missing or wrongly shaped
    tensors are a ValueError naming them."""
    from slipstream.model.weights import iter_tensors  # weights imports the model, which imports vision

    with torch.device("meta"):
        encoder = build_image_encoder(config, text_hidden_size)
    expected = dict(encoder.named_parameters())
    num_layers = len(encoder.vision_tower.encoder.layers)
    final_norm = encoder.vision_tower.post_layernorm is not None
    state = {}
    for stored_name, tensor in iter_tensors(model_dir):
        name = encoder_name(stored_name, num_layers, final_norm=final_norm)
        if name is None:
            continue
        if name not in expected:
            raise ValueError(f"unexpected image-encoder weight {stored_name} in {model_dir}")
        if tensor.shape != expected[name].shape:
            raise ValueError(f"weight {stored_name} has shape {tuple(tensor.shape)} in {model_dir}, but the "
                             f"config implies {tuple(expected[name].shape)}")
        state[name] = tensor.to(device=device, dtype=dtype)
    if missing := sorted(set(expected) - set(state)):
        raise ValueError(f"image-encoder weights missing from {model_dir}: {', '.join(missing)}")
    encoder.load_state_dict(state, assign=True)
    return encoder.eval()
