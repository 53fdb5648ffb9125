"""Image inputs for the serving engine: prompts' placeholders expanded to the model's image tokens,
images decoded and preprocessed, and the image encoder run for the runner.

A prompt names where each image goes by one image token (`<image>`, the checkpoint's
`image_token_index`) in its text or token ids; `ImagePrompts.expand` repeats each to the number of
embeddings the encoder makes per image (vLLM's prompt replacement), so that the request's positions
[offset, offset + length) are the image's, and records each image as an `ImageInput` (placeholder
range, preprocessed pixels, a content hash of them). The runner's `ImageEmbedder` computes an
image's embeddings the first time a step's chunk covers any of its placeholders, keeps them while
the request's prefill goes on step after step (a chunk may end inside an image), and hands the
language model those rows as its input embeddings at the placeholder positions.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import PIL.Image
import torch

from slipstream.model.image_processor import ImageProcessor, decode_image, pixel_hash
from slipstream.model.llava import LlavaConfig
from slipstream.model.vision import ImageEncoder
from slipstream.serve.request import ImageInput
from slipstream.serve.scheduler import ScheduledChunk


class ImagePrompts:
    """A multimodal checkpoint's prompt side: its image token, the processor, tokens per image."""

    def __init__(self, processor: ImageProcessor, image_token_id: int, num_image_tokens: int) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.num_image_tokens = num_image_tokens

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, config: LlavaConfig, num_image_tokens: int
    ) -> ImagePrompts:
        return cls(ImageProcessor.from_pretrained(model_dir, config.vision), config.image_token_index,
                   num_image_tokens)

    def expand(
        self, token_ids: Sequence[int], images: Sequence[PIL.Image.Image]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt with each image token repeated `num_image_tokens` times, and its images in
        prompt order. As many images as image tokens, else a ValueError naming both counts."""
        num_placeholders = sum(1 for token_id in token_ids if token_id == self.image_token_id)
        if num_placeholders != len(images):
            raise ValueError(f"multi_modal_data: the prompt has {num_placeholders} image placeholder(s) "
                             f"(token id {self.image_token_id}) but {len(images)} image(s) were given")
        expanded: list[int] = []
        offsets = []
        for token_id in token_ids:
            if token_id == self.image_token_id:
                offsets.append(len(expanded))
                expanded += [token_id] * self.num_image_tokens
            else:
                expanded.append(token_id)
        inputs = []
        for offset, image in zip(offsets, images, strict=True):
            pixels = self.processor(image)
            inputs.append(ImageInput(offset=offset, length=self.num_image_tokens,
                                     content_hash=pixel_hash(pixels), pixel_values=torch.from_numpy(pixels)))
        return expanded, tuple(inputs)


def as_images(value: Any, where: str = "multi_modal_data['image']") -> list[PIL.Image.Image]:
    """A prompt's images: one PIL image or a list of them, else a ValueError naming `where`."""
    images = list(value) if isinstance(value, (list, tuple)) else [value]
    for i, image in enumerate(images):
        if not isinstance(image, PIL.Image.Image):
            raise ValueError(f"{where}{f'[{i}]' if isinstance(value, (list, tuple)) else ''} must be a "
                             f"PIL.Image.Image, got {type(image).__name__}")
    return images


def image_from_url(url: Any, where: str) -> PIL.Image.Image:
    """The image of a data URL (`data:image/png;base64,...`). Other URLs (http, https, file) are a
    ValueError naming `where`: slipstream fetches nothing."""
    if not isinstance(url, str):
        raise ValueError(f"{where} must be a string (a data URL), got {url!r}")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:20]
        raise ValueError(f"{where}: only data URLs (data:image/...;base64,...) are supported; slipstream "
                         f"does not fetch images from URLs (got a {scheme!r} URL)")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"{where}: a data URL must be base64-encoded (data:image/...;base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: invalid base64 in the data URL ({e})") from None
    return decode_image(data, where)


class ImageEmbedder:
    """The runner's image encoder and its cache: image embeddings by request and image index,
    computed when a step first covers an image's placeholders and kept while the request's prefill
    runs on; a request's entry is dropped once a step covers its last image, and so are the
    entries of requests a step leaves out (preempted, finished or aborted ones), which compute
    their images again should they return to them."""

    def __init__(self, encoder: ImageEncoder, device: torch.device) -> None:
        self.encoder = encoder
        self.device = device
        self._cache: dict[str, dict[int, torch.Tensor]] = {}

    def inputs_embeds(
        self, chunks: Sequence[ScheduledChunk], token_ids: torch.Tensor, embed: Any
    ) -> torch.Tensor | None:  # (N,) -> (1, N, D)
        """The input embeddings of the step's flat batch of `token_ids` (`embed`: the language
        model's embedding) with the rows of image placeholders replaced by the images'; None when
        no chunk covers a placeholder."""
        spans = [(row, chunk, index, image) for row, chunk in _rows(chunks)
                 for index, image in enumerate(chunk.request.images)
                 if image.offset < chunk.start + chunk.num_tokens and chunk.start < image.end]
        in_step = {chunk.request.request_id for chunk in chunks}
        self._cache = {request_id: cached for request_id, cached in self._cache.items()
                       if request_id in in_step}
        if not spans:
            return None
        self._encode([(chunk.request.request_id, index, image) for _, chunk, index, image in spans])
        x = embed(token_ids[None])  # (1, N, D)
        for row, chunk, index, image in spans:
            lo, hi = max(chunk.start, image.offset), min(chunk.start + chunk.num_tokens, image.end)
            rows = self._cache[chunk.request.request_id][index][lo - image.offset:hi - image.offset]
            x[0, row + lo - chunk.start:row + hi - chunk.start] = rows.to(x.dtype)
        for chunk in chunks:
            if chunk.start + chunk.num_tokens >= chunk.request.images_end:
                self._cache.pop(chunk.request.request_id, None)
        return x

    def _encode(self, wanted: list[tuple[str, int, ImageInput]]) -> None:
        """Run the encoder once over the images of `wanted` not cached yet."""
        missing = [(request_id, index, image) for request_id, index, image in wanted
                   if index not in self._cache.get(request_id, {})]
        if not missing:
            return
        pixels = torch.stack([image.pixel_values for _, _, image in missing]).to(self.device)
        embeddings = self.encoder(pixels)  # (images, tokens, D)
        for (request_id, index, _), rows in zip(missing, embeddings, strict=True):
            self._cache.setdefault(request_id, {})[index] = rows


def _rows(chunks: Sequence[ScheduledChunk]) -> list[tuple[int, ScheduledChunk]]:
    """Each chunk with the row of the flat batch at which its tokens start."""
    rows, row = [], 0
    for chunk in chunks:
        rows.append((row, chunk))
        row += chunk.num_tokens
    return rows



def content_part(part: Any, where: str, takes_images: bool) -> str | PIL.Image.Image:
    """A chat message's content part: its text, or (`takes_images`: a multimodal model) its image,
    from OpenAI's {"type": "image_url", "image_url": {"url": data URL}} or vLLM's {"type":
    "image_pil", "image_pil": image}. Anything else is a ValueError naming `where`."""
    is_text = isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
    if is_text:
        return part["text"]
    if not takes_images:
        raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}, the text a string) are "
                         f"supported by this text-only model, got {part!r} at {where}")
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, PIL.Image.Image):
            raise ValueError(f"{where}['image_pil'] must be a PIL.Image.Image, got {type(image).__name__}")
        return image
    if kind == "image_url":
        url = part.get("image_url")
        return image_from_url(url.get("url") if isinstance(url, Mapping) else url,
                              f"{where}['image_url']['url']")
    raise ValueError(f"{where}: content parts are {{'type': 'text', 'text': str}}, {{'type': 'image_url', "
                     f"'image_url': {{'url': data URL}}}} or {{'type': 'image_pil', 'image_pil': image}}; "
                     f"got {part!r}")
