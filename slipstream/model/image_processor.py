"""Image preprocessing for CLIP- and SigLIP-style vision towers, with Pillow and NumPy (no torchvision).

The steps and their arithmetic are those of transformers' image processors (their Pillow backend),
driven by the checkpoint's `preprocessor_config.json`: convert to RGB (transparency composited onto
white), resize (the shortest edge to `size.shortest_edge`, the other in proportion and truncated, or
to `size.height` x `size.width`) with the configured Pillow filter, center-crop to `crop_size`
(zero-padding an image smaller than the crop, as transformers' `center_crop` does), rescale
(`rescale_factor`, 1/255, computed in float64 and rounded to float32) and normalize by `image_mean`
and `image_std` in float32. The keys a file leaves out take the defaults of its
`image_processor_type`: CLIPImageProcessor's (shortest edge 224, a 224 x 224 crop, OpenAI CLIP's
mean and std; also where the file names no type) or SiglipImageProcessor's (a plain 224 x 224
resize, no crop, mean and std 0.5); both resize bicubic. The result is one (3, H, W) float32 array
per image, which must match the vision tower's `image_size` (the position embeddings are not
interpolated).
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

_CLIP_DEFAULTS = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224},
                  "do_center_crop": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}
_SIGLIP_DEFAULTS = {"size": {"height": 224, "width": 224}, "crop_size": None, "do_center_crop": False,
                    "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5)}
_GEMMA3_DEFAULTS = _SIGLIP_DEFAULTS | {"resample": PIL.Image.Resampling.BILINEAR}
PROCESSOR_DEFAULTS = {"CLIPImageProcessor": _CLIP_DEFAULTS, "CLIPImageProcessorFast": _CLIP_DEFAULTS,
                      "SiglipImageProcessor": _SIGLIP_DEFAULTS, "SiglipImageProcessorFast": _SIGLIP_DEFAULTS,
                      "Gemma3ImageProcessor": _GEMMA3_DEFAULTS, "Gemma3ImageProcessorFast": _GEMMA3_DEFAULTS}
"""The defaults of each `image_processor_type` read (transformers 5's class attributes), for the keys
a preprocessor_config.json leaves out; every type rescales by 1/255 and resizes bicubic but
Gemma 3's (bilinear, SigLIP's otherwise; its pan-and-scan crops are not supported)."""

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
    def from_pretrained(cls, model_dir: str | Path, vision: VisionConfig,
                        default_type: str = "CLIPImageProcessor") -> ImageProcessor:
        """The processor of `model_dir/preprocessor_config.json`; without one, `default_type`'s
        defaults at the vision tower's image size (LLaVA's CLIP, Gemma 3's own). Its output must be
        the tower's image size: another is a ValueError naming the file's keys."""
        path = Path(model_dir) / PREPROCESSOR_CONFIG
        if not path.is_file():
            side = vision.image_size
            if default_type != "CLIPImageProcessor":
                return cls.from_dict({"image_processor_type": default_type,
                                      "size": {"height": side, "width": side}})
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
        """Read a preprocessor_config.json's keys (the `do_*` flags switch steps off), with its
        `image_processor_type`'s defaults (for the keys it leaves out or sets to null, as transformers
        saves unset ones). A value of the wrong kind is a ValueError naming its key; a scalar mean or
        std stands for all three channels, as in transformers."""
        kind = d.get("image_processor_type", "CLIPImageProcessor")
        if kind not in PROCESSOR_DEFAULTS:
            raise ValueError(f"preprocessor_config.json's image_processor_type must be one of "
                             f"{', '.join(PROCESSOR_DEFAULTS)}, got {kind!r}")
        d = PROCESSOR_DEFAULTS[kind] | {key: value for key, value in d.items() if value is not None}
        if d.get("do_pan_and_scan"):
            raise ValueError("preprocessor_config.json's do_pan_and_scan (Gemma 3's crops of an image) is "
                             "not supported: set it to false")
        size = _size_dict(d["size"], "size", square=False)
        crop = None if d["crop_size"] is None else _size_dict(d["crop_size"], "crop_size", square=True)
        resize, center_crop, rescale, normalize = (
            _flag(d, name) for name in ("do_resize", "do_center_crop", "do_rescale", "do_normalize"))
        if center_crop and crop is None:
            raise ValueError("preprocessor_config.json's do_center_crop needs a crop_size")
        return cls(
            shortest_edge=size.get("shortest_edge") if resize else None,
            size=(size["height"], size["width"]) if resize and "shortest_edge" not in size else None,
            crop_size=(crop["height"], crop["width"]) if center_crop else None,
            resample=_resample(d.get("resample", PIL.Image.Resampling.BICUBIC)),
            rescale_factor=_positive_number(d.get("rescale_factor", 1 / 255), "rescale_factor") if rescale
            else None,
            image_mean=_per_channel(d["image_mean"], "image_mean") if normalize else None,
            image_std=_per_channel(d["image_std"], "image_std") if normalize else None,
        )

    def __post_init__(self) -> None:
        if self.image_std is not None and 0 in self.image_std:
            raise ValueError(f"preprocessor_config.json's image_std must not be 0, got {self.image_std!r}")

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, None where it follows the input (no crop, no fixed size)."""
        return self.crop_size or self.size

    def __call__(self, image: PIL.Image.Image) -> np.ndarray:  # -> (3, H, W) float32
        image = to_rgb(image)
        if self.shortest_edge is not None:
            image = image.resize(shortest_edge_size(image.size, self.shortest_edge), resample=self.resample)
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


def shortest_edge_size(size: tuple[int, int], shortest_edge: int) -> tuple[int, int]:
    """(width, height) with the shorter side `shortest_edge` and the longer one in proportion,
    truncated (transformers' `get_resize_output_image_size`)."""
    width, height = size
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest_edge * long / short)
    return (shortest_edge, new_long) if width <= height else (new_long, shortest_edge)


def _center_crop(pixels: np.ndarray, crop_size: tuple[int, int]) -> np.ndarray:  # (H, W, C)
    """The centered `crop_size` window of `pixels`; a side shorter than the crop is first padded
    with zeros, the odd pixel of padding on top or left (transformers' `center_crop`)."""
    height, width = crop_size
    pad_height, pad_width = max(height - pixels.shape[0], 0), max(width - pixels.shape[1], 0)
    if pad_height or pad_width:
        top, left = -(-pad_height // 2), -(-pad_width // 2)  # ceil
        pixels = np.pad(pixels, ((top, pad_height - top), (left, pad_width - left), (0, 0)))
    top, left = (pixels.shape[0] - height) // 2, (pixels.shape[1] - width) // 2
    return pixels[top:top + height, left:left + width]


def _size_dict(value: Any, key: str, *, square: bool) -> dict[str, int]:
    """A size as transformers' `get_size_dict` reads it: {"shortest_edge": n} or {"height": h,
    "width": w}; an integer is a shortest edge (or, `square`, a square), a pair is (height, width)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"height": value, "width": value} if square else {"shortest_edge": value}
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        value = {"height": value[0], "width": value[1]}
    names = ("shortest_edge",) if isinstance(value, dict) and "shortest_edge" in value and not square \
        else ("height", "width")
    if not isinstance(value, dict) or not set(names) <= set(value):
        wanted = "height and width" if square else "shortest_edge, or height and width"
        raise ValueError(f"preprocessor_config.json's {key} must give {wanted}; got {value!r}")
    for name in names:
        number = value[name]
        if isinstance(number, bool) or not isinstance(number, int) or number <= 0:
            raise ValueError(f"preprocessor_config.json's {key}.{name} must be a positive integer, "
                             f"got {number!r}")
    return {name: value[name] for name in names}


def _flag(d: dict[str, Any], key: str) -> bool:
    value = d.get(key, True)
    if not isinstance(value, bool):
        raise ValueError(f"preprocessor_config.json's {key} must be true or false, got {value!r}")
    return value


def _resample(value: Any) -> int:
    """A Pillow resampling filter's number (0 nearest ... 5 Hamming, 3 bicubic)."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in set(PIL.Image.Resampling):
        raise ValueError(f"preprocessor_config.json's resample must be a Pillow filter number (0 to 5), "
                         f"got {value!r}")
    return value


def _positive_number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"preprocessor_config.json's {key} must be a positive number, got {value!r}")
    return float(value)


def _per_channel(value: Any, key: str) -> tuple[float, ...]:
    """Three (RGB) numbers from a list of three or one number for all (transformers broadcasts it)."""
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3
    if len(values) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"preprocessor_config.json's {key} must be a number or a list of 3 (RGB), "
                         f"got {value!r}")
    return tuple(float(v) for v in values)


def decode_image(data: bytes, where: str) -> PIL.Image.Image:
    """An encoded image (PNG, JPEG, ...) decoded in full; undecodable bytes are a ValueError naming
    `where`, and so is an image of more than Pillow's MAX_IMAGE_PIXELS pixels, refused from its
    header before it is decoded (Pillow itself only warns up to twice that)."""
    limit = PIL.Image.MAX_IMAGE_PIXELS
    try:
        image = PIL.Image.open(io.BytesIO(data))
        too_large = limit is not None and image.width * image.height > limit
        if not too_large:
            image.load()
    except (OSError, ValueError, PIL.Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: not a decodable image ({e})") from None
    if too_large:
        raise ValueError(f"{where}: the image is {image.width}x{image.height}, more than {limit} pixels "
                         "(PIL.Image.MAX_IMAGE_PIXELS)")
    return image


def pixel_hash(pixels: np.ndarray) -> str:
    """A content hash of preprocessed pixel values (their shape and float32 bytes): equal for
    images the model sees as the same, which is what the prefix cache must tell apart."""
    digest = hashlib.sha256(repr(pixels.shape).encode())
    digest.update(np.ascontiguousarray(pixels, dtype=np.float32).tobytes())
    return digest.hexdigest()
