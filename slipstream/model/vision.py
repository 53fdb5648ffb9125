"""Image encoders of LLaVA-style models: a CLIP or SigLIP vision transformer and the projector that
maps its patch features into the language model's embedding space. Math only: configs are read in
`model/llava.py`, and the serving engine decides when to run it.

A vision transformer (ViT, arXiv:2010.11929) cuts the image into patch_size x patch_size patches,
embeds each by one strided convolution, adds a learned position embedding and runs pre-norm
encoder layers (full bidirectional attention, a two-layer MLP). CLIP (arXiv:2103.00020) prepends a
class token and normalises the embeddings once before the first layer (`pre_layrnorm`, as its
checkpoints spell it); SigLIP (arXiv:2303.15343) has neither. LLaVA (arXiv:2304.08485, 1.5:
arXiv:2310.03744) takes the hidden states after layer `vision_feature_layer` (before the final
norm, which it never uses), drops the class token's row under the "default" strategy and projects
every row by linear, activation, linear: one language-model embedding per row.

Parameter names are transformers 5's (`vision_tower.encoder.layers.0.self_attn.q_proj.weight`,
`multi_modal_projector.linear_1.weight`; the Hub's older checkpoints put `vision_model.` after
`vision_tower.`, which `llava.encoder_name` drops). Only the
layers up to the deepest feature layer are built (as vLLM builds them): the rest never reach the
output.

Layout legend: N images, C channels, P patches (plus the class token where there is one), E the
vision hidden size, D the language model's hidden size.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.model.transformer import GemmaRMSNorm

VISION_TYPES = ("clip_vision_model", "siglip_vision_model")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's sigmoid approximation of GELU: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": quick_gelu,
    "silu": F.silu,
    "relu": F.relu,
}
"""Activations by transformers' names (`hidden_act`, `projector_hidden_act`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """A CLIP or SigLIP vision transformer's shape (the keys of a `vision_config`)."""

    model_type: str = "clip_vision_model"
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.model_type not in VISION_TYPES:
            raise ValueError(f"vision_config.model_type must be one of {', '.join(VISION_TYPES)}, "
                             f"got {self.model_type!r}")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_channels", "image_size", "patch_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"vision_config.{key} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vision_config.hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act must be one of {', '.join(ACTIVATIONS)}, "
                             f"got {self.hidden_act!r}")

    @property
    def has_class_token(self) -> bool:
        return self.model_type == "clip_vision_model"

    @property
    def num_patches(self) -> int:
        """Whole patches per image: the strided convolution drops a remainder of fewer than
        patch_size pixels at the right and bottom (SigLIP so400m's 384 / 14 gives 27 x 27)."""
        return (self.image_size // self.patch_size) ** 2


class VisionEmbeddings(nn.Module):
    """Patches to vectors: a strided convolution, CLIP's class token in front, position embeddings."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        clip = config.has_class_token
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, bias=not clip)
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size)) if clip else None
        self.position_embedding = nn.Embedding(config.num_patches + clip, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) -> (N, P, E)
        weight = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)  # (N, P, E)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    """Full (bidirectional) multi-head attention over an image's patches."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        e = config.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(e, e) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, P, E) -> (N, P, E)
        n, p, e = x.shape
        q, k, v = (proj(x).view(n, p, self.num_heads, -1).transpose(1, 2)  # (N, heads, P, E / heads)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, p, e))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-norm: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(num_layers))


class VisionTransformer(nn.Module):
    """Embeddings and the first `num_layers` encoder layers (the checkpoints' `vision_tower`), and
    with `final_norm` the tower's last LayerNorm (`post_layernorm`), which Gemma 3 applies to the
    last layer's output and LLaVA never uses."""

    def __init__(self, config: VisionConfig, num_layers: int, *, final_norm: bool = False) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.pre_layrnorm = (nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
                             if config.has_class_token else None)
        self.encoder = VisionEncoder(config, num_layers)
        self.post_layernorm = (nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
                               if final_norm else None)

    def forward(self, pixel_values: torch.Tensor, layers: tuple[int, ...]) -> list[torch.Tensor]:
        """The hidden states after each of `layers` (0: the embeddings, after CLIP's first norm;
        i: after encoder layer i - 1), each (N, P, E)."""
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in layers]


class Projector(nn.Module):
    """LLaVA's `multi_modal_projector`: linear, activation, linear."""

    def __init__(self, in_features: int, out_features: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, out_features, bias=bias)
        self.act = ACTIVATIONS[act]
        self.linear_2 = nn.Linear(out_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def resolve_feature_layers(layers: tuple[int, ...], num_hidden_layers: int) -> tuple[int, ...]:
    """Feature layer indices into the hidden states (num_hidden_layers + 1 of them: the
    embeddings, then each layer's output) as non-negative ones; a negative index counts from the
    end as Python's does. An index out of range is a ValueError naming the key."""
    num_states = num_hidden_layers + 1
    if any(not -num_states <= layer < num_states for layer in layers):
        raise ValueError(f"vision_feature_layer {list(layers)} is out of range for a vision tower of "
                         f"{num_hidden_layers} layers (indices -{num_states} .. {num_states - 1})")
    return tuple(layer % num_states for layer in layers)


class ImageEncoder(nn.Module):
    """Pixel values to language-model embeddings: `forward((N, C, H, W)) -> (N, tokens, D)`.

    `feature_layers`: the hidden states whose rows are concatenated feature-wise (LLaVA's
    `vision_feature_layer`, one index or several), as non-negative indices; `drop_class_token`:
    the "default" select strategy, which drops each state's first row."""

    def __init__(
        self, config: VisionConfig, *, text_hidden_size: int, feature_layers: tuple[int, ...],
        drop_class_token: bool, projector_act: str, projector_bias: bool,
    ) -> None:
        super().__init__()
        self.config = config
        self.feature_layers = feature_layers
        self.drop_class_token = drop_class_token
        self.vision_tower = VisionTransformer(config, max(feature_layers))
        self.multi_modal_projector = Projector(config.hidden_size * len(feature_layers), text_hidden_size,
                                               projector_act, projector_bias)

    @property
    def num_image_tokens(self) -> int:
        """Embeddings per image: one per patch, plus CLIP's class token unless it is dropped."""
        return self.config.num_patches + self.config.has_class_token - self.drop_class_token

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) -> (N, tokens, D)
        states = self.vision_tower(pixel_values, self.feature_layers)
        if self.drop_class_token:
            states = [state[:, 1:] for state in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))



class Gemma3Projector(nn.Module):
    """Gemma 3's `multi_modal_projector`: the patches' grid average-pooled to `tokens_per_side`
    squared rows (4 x 4 patches each for the released 896-pixel, 14-pixel-patch towers: 256
    tokens), then Gemma's RMS norm (`mm_soft_emb_norm`, weights as offsets from 1) and one matmul
    into the language model's width (`mm_input_projection_weight`, stored (E, D), no bias)."""

    def __init__(self, config: VisionConfig, *, text_hidden_size: int, tokens_per_side: int) -> None:
        super().__init__()
        self.patches_per_side = config.image_size // config.patch_size
        self.pool = self.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(config.hidden_size, text_hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, P, E) -> (N, tokens, D)
        n, _, e = x.shape
        grid = x.transpose(1, 2).reshape(n, e, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.pool, stride=self.pool).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(x.dtype)


class Gemma3ImageEncoder(nn.Module):
    """Gemma 3's image encoder: a SigLIP tower, every layer and its final norm (the tower's
    `last_hidden_state`), then `Gemma3Projector`: `forward((N, C, H, W)) -> (N, tokens, D)`."""

    def __init__(self, config: VisionConfig, *, text_hidden_size: int, tokens_per_image: int) -> None:
        super().__init__()
        tokens_per_side = round(tokens_per_image**0.5)
        patches_per_side = config.image_size // config.patch_size
        if tokens_per_side**2 != tokens_per_image or patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image ({tokens_per_image}) must be the square of a divisor "
                             f"of the patches per side ({config.image_size} // {config.patch_size} = "
                             f"{patches_per_side})")
        self.config = config
        self.num_image_tokens = tokens_per_image
        self.vision_tower = VisionTransformer(config, config.num_hidden_layers, final_norm=True)
        self.multi_modal_projector = Gemma3Projector(config, text_hidden_size=text_hidden_size,
                                                     tokens_per_side=tokens_per_side)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) -> (N, tokens, D)
        (last,) = self.vision_tower(pixel_values, (self.config.num_hidden_layers,))
        return self.multi_modal_projector(self.vision_tower.post_layernorm(last))
