"""Image inputs for the serving engine: prompts' placeholders expanded to the model's image tokens,
images decoded and preprocessed, and the image encoder run for the runner.

A prompt names where each image goes by one placeholder token in its text or token ids (LLaVA's
image token `<image>`, the checkpoint's `image_token_index`; Gemma 3's begin-of-image token
`<start_of_image>`); `ImagePrompts.expand` replaces each by the number of embeddings the encoder
makes per image (vLLM's prompt replacement; Gemma 3's between its begin and end tokens and blank
lines, `ImageWrap`), so that the request's positions [offset, offset + length) are the image's,
and refuses images whose size would make preprocessing
costly (empty, too thin, or resized to many times the tower's input). `ImagePrompts.process`
preprocesses and hashes them (off the engine thread where the async engine serves), and each
becomes an `ImageInput` (placeholder range, preprocessed pixels, a content hash of them). The
runner's `ImageEmbedder` computes an image's embeddings the first time a step's chunk covers any of
its placeholders, once for every request holding the same image, keeps them while the requests'
prefills go on step after step (a chunk may end inside an image), and hands the runner those rows
(`ImageRows`), which replace the token embeddings at the placeholder positions. Under tensor
parallelism the encoder runs whole on the driver, and the rows travel to the workers with the step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import PIL.Image
import torch

from slipstream.model.image_processor import ImageProcessor, pixel_hash, shortest_edge_size
from slipstream.model.llava import LlavaConfig
from slipstream.model.vision import Gemma3ImageEncoder, ImageEncoder
from slipstream.serve.json_config import json_dict
from slipstream.serve.media import MediaConfig, load_image
from slipstream.serve.request import ImageInput
from slipstream.serve.scheduler import ScheduledChunk

MAX_ASPECT_RATIO = 200
"""The longest side of an image over its shortest, at most (Qwen2-VL's processor refuses past 200
too): a tower sees a square, so an image thinner than this carries nearly nothing it can see, and
its aspect-preserving resize grows with the ratio (a 1 x 20000 image to 336 x 6.7M pixels)."""

MAX_RESIZE_PIXELS = 32
"""The resize target of an image (before the center crop) may have at most this many times the
tower input's pixels, so that preprocessing's memory and time stay within that many tower
inputs' worth."""


ITEMS_PER_PROMPT = 999
"""vLLM's limit_mm_per_prompt for a modality it is not given for."""

MODALITIES = ("image", "video", "audio")
"""The modalities limit_mm_per_prompt may name, as vLLM's: slipstream's models take images only, so
a limit on video or audio is taken (a vLLM script may set them) and has nothing to limit."""


def parse_mm_limits(value: Mapping[str, Any] | str) -> dict[str, int]:
    """vLLM's limit_mm_per_prompt (`--limit-mm-per-prompt`): the most items of each modality one
    prompt may hold, as a dict (or its JSON text) from modality to a count >= 0 or {"count": n}.
    A ValueError names what is wrong. vLLM's other per-modality options (width, height,
    num_frames) size the dummy inputs of its memory profiling, which slipstream does not run:
    they are refused, not ignored."""
    limits = {}
    for modality, limit in json_dict(value, "limit_mm_per_prompt").items():
        if modality not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {modality!r} "
                             f"(known: {', '.join(MODALITIES)})")
        if isinstance(limit, Mapping):
            if set(limit) != {"count"}:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}] takes only 'count' here, got "
                                 f"{sorted(limit)} (vLLM's sizes of its profiling's dummy inputs "
                                 "have no use in slipstream)")
            limit = limit["count"]
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be an integer >= 0, got {limit!r}")
        limits[modality] = limit
    return limits


def check_num_images(num_images: int, limit: int) -> None:
    """vLLM's error for a prompt with more images than limit_mm_per_prompt allows."""
    if num_images > limit:
        raise ValueError(f"At most {limit} image(s) may be provided in one prompt, got {num_images}; "
                         "set limit_mm_per_prompt (--limit-mm-per-prompt) to increase this limit")


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessedImage:
    """An image as the encoder takes it, made by `ImagePrompts.process` (on the async engine's
    worker thread, so that the engine thread never resizes or hashes an image)."""

    pixel_values: torch.Tensor
    """A (3, H, W) float32 tensor."""
    content_hash: str
    """Of the pixel values (`pixel_hash`): the encoder cache's key and the prefix cache's."""


@dataclasses.dataclass(frozen=True)
class ImageWrap:
    """Which token an image's tokens are and what surrounds them where they replace its
    placeholder. LLaVA's are the placeholder repeated, with nothing around (`repeat`). Gemma 3's
    processor (transformers' Gemma3Processor) writes "\n\n<start_of_image>", the image tokens,
    "<end_of_image>\n\n" in the text and tokenizes the result, which writes each run of newlines
    (its blank lines and the prompt's newlines beside them) as the tokenizer writes that run
    alone: `join` does so at the seams (vLLM's Gemma 3 processor joins "\n" + "\n\n",
    "\n\n" + "\n" and "\n\n" + "\n\n" into one token each, which this gives where the
    vocabulary has tokens for those runs, as Gemma 3's has)."""

    image_token_id: int
    before: tuple[int, ...]
    after: tuple[int, ...]
    newline_runs: Mapping[int, int]
    """The tokens that are a run of newlines: id -> how many."""
    newlines: Callable[[int], tuple[int, ...]]
    """n -> the tokens of a run of n newlines."""

    @classmethod
    def repeat(cls, image_token_id: int) -> ImageWrap:
        return cls(image_token_id, before=(), after=(), newline_runs={}, newlines=lambda n: ())

    @classmethod
    def gemma3(cls, config: LlavaConfig, encode: Callable[[str], list[int]]) -> ImageWrap:
        """Gemma 3's, its newlines as `encode` (the tokenizer's, without special tokens) writes
        them; the tokens of up to MAX_NEWLINE_RUN newlines are known as runs."""
        runs = {}
        for length in range(1, MAX_NEWLINE_RUN + 1):
            ids = encode("\n" * length)
            if len(ids) == 1:
                runs[ids[0]] = length
        blank = tuple(encode("\n\n"))
        newlines = functools.lru_cache(maxsize=64)(lambda n: tuple(encode("\n" * n)))
        return cls(config.image_token_index, before=(*blank, config.boi_token_index),
                   after=(config.eoi_token_index, *blank), newline_runs=runs, newlines=newlines)

    def join(self, tokens: list[int], token_id: int) -> None:
        """Append `token_id` to `tokens`; where both it and the end of `tokens` are newlines, the
        whole run of them is written again as the tokenizer writes it."""
        runs = self.newline_runs
        if token_id not in runs or not tokens or tokens[-1] not in runs:
            tokens.append(token_id)
            return
        count = runs[token_id]
        while tokens and tokens[-1] in runs:
            count += runs[tokens.pop()]
        tokens += self.newlines(count)


MAX_NEWLINE_RUN = 32
"""The longest run of newlines `ImageWrap` asks the tokenizer for one token of (Gemma 3's vocabulary
has them up to 31)."""


class ImagePrompts:
    """A multimodal checkpoint's prompt side: its image placeholder token (`image_token_id`), the
    processor, tokens per image, which they are and what surrounds them (`wrap`; default: the
    placeholder repeated), and the tower's input side (`image_size`), which bounds what an image
    may resize to."""

    def __init__(self, processor: ImageProcessor, image_token_id: int, num_image_tokens: int,
                 image_size: int, wrap: ImageWrap | None = None) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.num_image_tokens = num_image_tokens
        self.image_size = image_size
        self.wrap = wrap or ImageWrap.repeat(image_token_id)

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, config: LlavaConfig, num_image_tokens: int,
        encode: Callable[[str], list[int]],
    ) -> ImagePrompts:
        """`encode`: the tokenizer's, without special tokens (for Gemma 3's newlines)."""
        wrap = ImageWrap.gemma3(config, encode) if config.model_type == "gemma3" else None
        default_type = "Gemma3ImageProcessor" if config.model_type == "gemma3" else "CLIPImageProcessor"
        return cls(ImageProcessor.from_pretrained(model_dir, config.vision, default_type),
                   config.placeholder_token_index,
                   num_image_tokens, config.vision.image_size, wrap)

    def expand(
        self, token_ids: Sequence[int], images: Sequence[PIL.Image.Image | ProcessedImage], *,
        truncated: bool = False,
    ) -> tuple[list[int], list[int]]:
        """The prompt with each image placeholder replaced by `num_image_tokens` image tokens and
        what surrounds them (`wrap`), and the offset of each image's tokens in it, in prompt
        order; cheap (no image is processed), so that a prompt is refused before its images are.
        As many images as placeholders, else a ValueError naming both counts (`truncated`: the
        prompt was cut by truncate_prompt_tokens, which the error says); an image of a size
        `check_size` refuses is a ValueError too, and so is a prompt that holds image tokens other
        than its placeholders itself (Gemma 3's `<image_soft_token>`: an expanded prompt, or the
        token written as text), which would stand for no image."""
        wrap = self.wrap
        if wrap.image_token_id != self.image_token_id and wrap.image_token_id in token_ids:
            raise ValueError(f"the prompt holds the image token (id {wrap.image_token_id}) itself: an image "
                             f"goes where its placeholder (token id {self.image_token_id}) is, with the "
                             "image in multi_modal_data, and the engine expands it")
        num_placeholders = sum(1 for token_id in token_ids if token_id == self.image_token_id)
        if num_placeholders != len(images):
            note = (" (truncate_prompt_tokens cuts the prompt before its image placeholders are expanded, "
                    "so it may cut placeholders off)") if truncated else ""
            raise ValueError(f"multi_modal_data: the prompt has {num_placeholders} image placeholder(s) "
                             f"(token id {self.image_token_id}) but {len(images)} image(s) were given{note}")
        for index, image in enumerate(images):
            if isinstance(image, PIL.Image.Image):
                self.check_size(image, index)
        return self.expand_ids(token_ids)

    def expand_ids(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """`expand`'s result without its checks: the prompt with every placeholder replaced, and
        the offset of each image's tokens."""
        wrap = self.wrap
        expanded: list[int] = []
        offsets = []
        for token_id in token_ids:
            if token_id != self.image_token_id:
                wrap.join(expanded, token_id)
                continue
            for wrapping in wrap.before:
                wrap.join(expanded, wrapping)
            offsets.append(len(expanded))
            expanded += [wrap.image_token_id] * self.num_image_tokens
            expanded += wrap.after
        return expanded, offsets

    def check_size(self, image: PIL.Image.Image, index: int) -> None:
        """A ValueError naming image `index` and its size where it is empty, thinner than
        MAX_ASPECT_RATIO allows, or resizes to more than MAX_RESIZE_PIXELS tower inputs."""
        width, height = image.size
        where = f"multi_modal_data: image {index} ({width}x{height})"
        if width < 1 or height < 1:
            raise ValueError(f"{where} is empty")
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise ValueError(f"{where}: its aspect ratio is past {MAX_ASPECT_RATIO}")
        target_width, target_height = self._resize_target(width, height)
        if target_width * target_height > MAX_RESIZE_PIXELS * self.image_size**2:
            side = self.image_size
            raise ValueError(f"{where} would be resized to {target_width}x{target_height}, more than "
                             f"{MAX_RESIZE_PIXELS} times the vision tower's {side}x{side} input: its "
                             "aspect ratio is too far from the tower's square")

    def _resize_target(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the processor resizes an image of this size to (before the crop)."""
        processor = self.processor
        if processor.shortest_edge is not None:
            return shortest_edge_size((width, height), processor.shortest_edge)
        if processor.size is not None:
            return processor.size[1], processor.size[0]
        return width, height

    def process(self, images: Sequence[PIL.Image.Image | ProcessedImage]) -> tuple[ProcessedImage, ...]:
        """The images preprocessed and hashed (sizes checked first; processed ones as they are)."""
        for index, image in enumerate(images):
            if isinstance(image, PIL.Image.Image):
                self.check_size(image, index)
        return tuple(image if isinstance(image, ProcessedImage) else self._process(image) for image in images)

    def _process(self, image: PIL.Image.Image) -> ProcessedImage:
        pixels = self.processor(image)
        return ProcessedImage(torch.from_numpy(pixels), pixel_hash(pixels))

    def inputs(self, offsets: Sequence[int], images: Sequence[PIL.Image.Image | ProcessedImage]
               ) -> tuple[ImageInput, ...]:
        """The request's images at `offsets` (`expand`'s), processed where they are not yet."""
        return tuple(ImageInput(offset=offset, length=self.num_image_tokens, content_hash=image.content_hash,
                                pixel_values=image.pixel_values)
                     for offset, image in zip(offsets, self.process(images), strict=True))


def as_images(value: Any, where: str = "multi_modal_data['image']") -> list[PIL.Image.Image]:
    """A prompt's images: one PIL image or a list of them, else a ValueError naming `where`."""
    images = list(value) if isinstance(value, (list, tuple)) else [value]
    for i, image in enumerate(images):
        if not isinstance(image, PIL.Image.Image):
            raise ValueError(f"{where}{f'[{i}]' if isinstance(value, (list, tuple)) else ''} must be a "
                             f"PIL.Image.Image, got {type(image).__name__}")
    return images


MAX_ENCODER_BATCH = 8
"""Images the encoder runs at once: a step whose chunks start more images encodes them in several
calls, so that the encoder's activations stay bounded whatever the step holds."""


@dataclasses.dataclass(frozen=True, slots=True)
class ImageRows:
    """A step's image embeddings (`ImageEmbedder.image_rows`): which rows of its flat batch are
    image placeholders, and the embeddings that replace those rows' token embeddings."""

    rows: torch.Tensor
    """(M,) int64 rows of the flat batch."""
    embeds: torch.Tensor
    """(M, D), row i's at rows[i]."""

    def inputs_embeds(self, embed: Callable[[torch.Tensor], torch.Tensor],
                      token_ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (1, N, D)
        """The flat batch's input embeddings: `embed` (the language model's; under tensor
        parallelism a collective, which every rank runs) of `token_ids`, the image rows replaced."""
        x = embed(token_ids[None])
        x[0, self.rows] = self.embeds.to(x.dtype)
        return x


class ImageEmbedder:
    """The runner's image encoder and its cache of image embeddings, keyed by the images' content
    hashes (vLLM's encoder cache): an image is encoded the first time a step covers any of its
    placeholders, once however many requests hold it (the n completions of a prompt, other prompts
    with the same image), in batches of at most `max_batch_images`, and kept while a request holds
    it. A request holds an image from the first step that covers it until its prefill passes the
    image's last placeholder (a chunk may end inside an image), or until it is preempted or aborted
    (`release`, which the engine calls then); a request's prefill passes its images before it
    samples, so a finished one holds none. An image nobody holds is dropped, and encoded again
    should a request (a preempted one, back) cover it later."""

    def __init__(self, encoder: ImageEncoder | Gemma3ImageEncoder, device: torch.device,
                 max_batch_images: int = MAX_ENCODER_BATCH, *, dtype: torch.dtype | None = None,
                 bidirectional: bool = False) -> None:
        self.encoder = encoder
        self.dtype = dtype
        """The embeddings' dtype (the language model's), where the encoder computes in another;
        None: the encoder's."""
        self.bidirectional = bidirectional
        """Whether an image's tokens attend to each other both ways (Gemma 3's): the runner lays
        each chunk's images out as spans of its `PagedBatch` (`PrefillChunk.bidirectional`)."""
        self.device = device
        self.max_batch_images = max_batch_images
        self._cache: dict[str, torch.Tensor] = {}
        """Embeddings, (tokens, D), by content hash."""
        self._holders: dict[str, set[str]] = {}
        """The ids of the requests holding each cached image."""
        self._held: dict[str, set[str]] = {}
        """The content hashes each request holds."""

    def image_rows(self, chunks: Sequence[ScheduledChunk]) -> ImageRows | None:
        """The rows of the step's flat batch (its `chunks` laid end to end) that are image
        placeholders, with the images' embeddings for them, encoding the images not cached yet;
        None when no chunk covers a placeholder."""
        spans = [(row, chunk, image) for row, chunk in _rows(chunks) for image in chunk.request.images
                 if image.offset < chunk.start + chunk.num_tokens and chunk.start < image.end]
        if not spans:
            return None
        self._encode({image.content_hash: image for _, _, image in spans
                      if image.content_hash not in self._cache})
        for _, chunk, image in spans:
            self._holders.setdefault(image.content_hash, set()).add(chunk.request.request_id)
            self._held.setdefault(chunk.request.request_id, set()).add(image.content_hash)
        rows, embeds = [], []
        for row, chunk, image in spans:
            lo, hi = max(chunk.start, image.offset), min(chunk.start + chunk.num_tokens, image.end)
            rows.append(torch.arange(row + lo - chunk.start, row + hi - chunk.start))
            embeds.append(self._cache[image.content_hash][lo - image.offset:hi - image.offset])
        for chunk in {chunk.request.request_id: chunk for _, chunk, _ in spans}.values():
            end = chunk.start + chunk.num_tokens
            ahead = {image.content_hash for image in chunk.request.images if image.end > end}
            self._drop(chunk.request.request_id, self._held[chunk.request.request_id] - ahead)
        return ImageRows(torch.cat(rows).to(self.device), torch.cat(embeds))

    def release(self, request_ids: Iterable[str]) -> None:
        """The requests hold no image any more (preempted or aborted ones)."""
        for request_id in request_ids:
            if request_id in self._held:
                self._drop(request_id, set(self._held[request_id]))

    @property
    def num_cached(self) -> int:
        """Images whose embeddings are kept."""
        return len(self._cache)

    def _drop(self, request_id: str, content_hashes: set[str]) -> None:
        """`request_id` no longer holds `content_hashes`; those nobody holds leave the cache."""
        held = self._held[request_id]
        for content_hash in content_hashes:
            held.discard(content_hash)
            holders = self._holders[content_hash]
            holders.discard(request_id)
            if not holders:
                del self._holders[content_hash], self._cache[content_hash]
        if not held:
            del self._held[request_id]

    def _encode(self, missing: dict[str, ImageInput]) -> None:
        """Encode the images of `missing` (by content hash), `max_batch_images` at a time."""
        todo = list(missing.items())
        for first in range(0, len(todo), self.max_batch_images):
            batch = todo[first:first + self.max_batch_images]
            pixels = torch.stack([image.pixel_values for _, image in batch]).to(self.device)
            embeddings = self.encoder(pixels)
            if self.dtype is not None:
                embeddings = embeddings.to(self.dtype)
            for (content_hash, _), rows in zip(batch, embeddings, strict=True):  # (tokens, D) each
                self._cache[content_hash] = rows


def _rows(chunks: Sequence[ScheduledChunk]) -> list[tuple[int, ScheduledChunk]]:
    """Each chunk with the row of the flat batch at which its tokens start."""
    rows, row = [], 0
    for chunk in chunks:
        rows.append((row, chunk))
        row += chunk.num_tokens
    return rows



def content_part(part: Any, where: str, takes_images: bool, media: MediaConfig,
                 load: Callable[[Any, str, MediaConfig], Any] = load_image) -> Any:
    """A chat message's content part: its text, or (`takes_images`: a multimodal model) its image,
    from OpenAI's {"type": "image_url", "image_url": {"url": URL}} (a data, http(s) or file URL,
    loaded as `media` allows, by `load`: `load_image`, or what stands for the image it will
    load, such as a future) or vLLM's {"type": "image_pil", "image_pil": image}. Anything else is
    a ValueError naming `where`."""
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
        return load(url.get("url") if isinstance(url, Mapping) else url, f"{where}['image_url']['url']",
                    media)
    raise ValueError(f"{where}: content parts are {{'type': 'text', 'text': str}}, {{'type': 'image_url', "
                     f"'image_url': {{'url': URL}}}} or {{'type': 'image_pil', 'image_pil': image}}; "
                     f"got {part!r}")
