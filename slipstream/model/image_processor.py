"""Image preprocessing for CLIP-style vision towers, with Pillow and NumPy (no torchvision).

The steps and their arithmetic are those of transformers' CLIPImageProcessor (its Pillow
backend), driven by the checkpoint's `preprocessor_config.json`: convert to RGB (transparency
composited onto white), resize (the shortest edge to `size.shortest_edge`, the other in proportion
and truncated, or to `size.height` x `size.width`) with the configured Pillow filter (bicubic for
CLIP), center-crop to `crop_size`, rescale (`rescale_factor`, 1/255, computed in float64 and
rounded to float32) and normalize by `image_mean` and `image_std` in float32. The result is one
(3, H, W) float32 array per image, which must match the vision tower's `image_size` (the
position embeddings are not interpolated).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image

from slipstream.model.vision import VisionConfig

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""OpenAI CLIP's normalisation, transformers' default for CLIPImageProcessor."""

PREPROCESSOR_CONFIG = "preprocessor_config.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageProcessor:
    """One checkpoint's preprocessing: `processor(image) -> (3, H, W) float32 array`."""

    shortest_edge: int | None = 224
    """Resize so the shorter side has this length; None: resize to `size` exactly."""
    size: tuple[int, int] | None = None
    """(height, width) to resize to where `shortest_edge` is None; None with it: no resize."""
    crop_size: tuple[int, int] | None = (224, 224)
    """(height, width) of the center crop; None: no crop."""
    resample: int = PIL.Image.Resampling.BICUBIC
    rescale_factor: float | None = 1 / 255
    image_mean: tuple[float, ...] | None = CLIP_MEAN
    image_std: tuple[float, ...] | None = CLIP_STD

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, vision: VisionConfig) -> ImageProcessor:
        """The processor of `model_dir/preprocessor_config.json`; without one, CLIP's defaults at
        the vision tower's image size. Its output must be the tower's image size: another is a
        ValueError naming the file's keys."""
        path = Path(model_dir) / PREPROCESSOR_CONFIG
        if not path.is_file():
            side = vision.image_size
            return cls(shortest_edge=side, crop_size=(side, side))
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        processor = cls.from_dict(d)
        out = processor.output_size
        if out is not None and out != (vision.image_size, vision.image_size):
            raise ValueError(f"{path}: size and crop_size give {out[0]}x{out[1]} images, but the vision "
                             f"tower takes {vision.image_size}x{vision.image_size}")
        return processor

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageProcessor:
        """Read a preprocessor_config.json's keys (the `do_*` flags switch steps off)."""
        size = d.get("size", {"shortest_edge": 224})
        size = {"shortest_edge": size} if isinstance(size, int) else size
        crop = d.get("crop_size", {"height": 224, "width": 224})
        crop = {"height": crop, "width": crop} if isinstance(crop, int) else crop
        if not isinstance(size, dict) or not (
                "shortest_edge" in size or {"height", "width"} <= set(size)):
            raise ValueError(f"preprocessor_config.json's size must give shortest_edge, or height and width; "
                             f"got {size!r}")
        if not isinstance(crop, dict) or not {"height", "width"} <= set(crop):
            raise ValueError(f"preprocessor_config.json's crop_size must give height and width; got {crop!r}")
        resize = d.get("do_resize", True)
        normalize = d.get("do_normalize", True)
        return cls(
            shortest_edge=size.get("shortest_edge") if resize else None,
            size=(size["height"], size["width"]) if resize and "shortest_edge" not in size else None,
            crop_size=(crop["height"], crop["width"]) if d.get("do_center_crop", True) else None,
            resample=d.get("resample", PIL.Image.Resampling.BICUBIC),
            rescale_factor=d.get("rescale_factor", 1 / 255) if d.get("do_rescale", True) else None,
            image_mean=tuple(d.get("image_mean", CLIP_MEAN)) if normalize else None,
            image_std=tuple(d.get("image_std", CLIP_STD)) if normalize else None,
        )

    def __post_init__(self) -> None:
        if self.shortest_edge is not None and self.crop_size is not None and \
                max(self.crop_size) > self.shortest_edge:
            raise ValueError(f"preprocessor_config.json's crop_size {self.crop_size} is larger than its "
                             f"size.shortest_edge ({self.shortest_edge}): padding crops are not supported")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if value is not None and len(value) != 3:
                raise ValueError(f"preprocessor_config.json's {name} must have 3 values (RGB), got {value!r}")

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, None where it follows the input (no crop, no fixed size)."""
        return self.crop_size or self.size

    def __call__(self, image: PIL.Image.Image) -> np.ndarray:  # -> (3, H, W) float32
        image = to_rgb(image)
        if self.shortest_edge is not None:
            image = image.resize(_shortest_edge_size(image.size, self.shortest_edge), resample=self.resample)
        elif self.size is not None:
            image = image.resize((self.size[1], self.size[0]), resample=self.resample)
        pixels = np.asarray(image)  # (H, W, 3) uint8
        if self.crop_size is not None:
            pixels = _center_crop(pixels, self.crop_size)
        x = pixels.transpose(2, 0, 1)  # (3, H, W)
        if self.rescale_factor is not None:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            x = x.astype(np.float32)
        if self.image_mean is not None:
            mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.array(self.image_std, dtype=np.float32)[:, None, None]
            x = (x - mean) / std
        return np.ascontiguousarray(x)


def to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """`image` in RGB, any transparency (an alpha band, a palette's transparent entry) composited
    onto white, as transformers converts it."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _shortest_edge_size(size: tuple[int, int], shortest_edge: int) -> tuple[int, int]:
    """(width, height) with the shorter side `shortest_edge` and the longer one in proportion,
    truncated (transformers' `get_resize_output_image_size`)."""
    width, height = size
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest_edge * long / short)
    return (shortest_edge, new_long) if width <= height else (new_long, shortest_edge)


def _center_crop(pixels: np.ndarray, crop_size: tuple[int, int]) -> np.ndarray:  # (H, W, C)
    height, width = crop_size
    top, left = (pixels.shape[0] - height) // 2, (pixels.shape[1] - width) // 2
    return pixels[top:top + height, left:left + width]


def decode_image(data: bytes, where: str) -> PIL.Image.Image:
    """An encoded image (PNG, JPEG, ...) decoded in full; undecodable bytes are a ValueError naming
    `where`."""
    try:
        image = PIL.Image.open(io.BytesIO(data))
        image.load()
    except (OSError, ValueError, PIL.Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: not a decodable image ({e})") from None
    return image


def pixel_hash(pixels: np.ndarray) -> str:
    """A content hash of preprocessed pixel values (their shape and float32 bytes): equal for
    images the model sees as the same, which is what the prefix cache must tell apart."""
    digest = hashlib.sha256(repr(pixels.shape).encode())
    digest.update(np.ascontiguousarray(pixels, dtype=np.float32).tobytes())
    return digest.hexdigest()
