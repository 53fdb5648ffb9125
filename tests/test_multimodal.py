"""Image inputs (LLaVA checkpoints): the image encoder and preprocessing against transformers, and
the engine's greedy tokens for prompts with images against transformers' LlavaForConditionalGeneration."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import http.server
import io
import json
import os
import socket
import threading
import time
import warnings
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import openai
import PIL.Image
import pytest
import torch
import transformers
from serve_fixtures import assert_same_tokens, random_hf
from server_process import API_KEY, MODEL_NAME, ServerProcess, serve_in_process

from slipstream import LLM, SamplingParams
from slipstream.model.create import stdlib_tokenizer
from slipstream.model.image_processor import ImageProcessor
from slipstream.model.llava import LlavaConfig, load_image_encoder
from slipstream.model.tokenizer import Tokenizer
from slipstream.model.weights import load_model
from slipstream.serve.async_engine import AsyncEngine
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.media import MEDIA_THREADS
from slipstream.serve.profiler import FORWARD_PHASE
from slipstream.serve.protocol import APIError, ChatMessage

pytest_plugins = ["serve_fixtures", "server_process"]  # the text model's model_dir, for images refused

IMAGE_TOKEN = "<image>"
PROJECTOR_SCALE = 10.0
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
    """transformers' LLaVA of a tiny CLIP tower and Llama, seeded, norms and biases moved off 1 and 0,
    and the projector's output scaled up so that images steer the greedy tokens (at the default
    initialisation their embeddings are too small to)."""
    config = transformers.LlavaConfig(vision_config=vision or vision_config(), text_config=TEXT,
                                      image_token_index=320, **overrides)
    hf = random_hf(transformers.LlavaForConditionalGeneration, config, names=("norm", "bias"))
    with torch.no_grad():
        hf.model.multi_modal_projector.linear_2.weight.mul_(PROJECTOR_SCALE)
    return hf


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


NUM_IMAGE_TOKENS = 16
MAX_TOKENS = 8
LONG = "USER: Here is a picture for you to look at, with some care please: <image>\nWhat is this? ASSISTANT:"
"""Its image starts past the first 16-token block, which prompts with other images share."""
PROMPTS = [
    (LONG, [random_image(1)]),
    ("USER: <image> and <image>: which one? ASSISTANT:", [random_image(2, (50, 20), "RGBA"),
                                                          random_image(3, (33, 33), "L")]),
    ("USER: just text, no image at all ASSISTANT:", []),
    (LONG, [random_image(4, (64, 48))]),
    ("<image>", [random_image(5)]),
]
"""One and two images of odd sizes and modes, a text-only prompt, the first text with another
image, and a prompt that is one image (which ends where the prompt ends)."""


def as_prompt(text: str, images: list) -> str | dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@torch.no_grad()
def llava_greedy(hf, model_dir: Path, text: str, images: list) -> tuple[list[int], list[int], torch.Tensor]:
    """transformers' LLaVA: the prompt as its processor expands it (each `<image>` repeated
    NUM_IMAGE_TOKENS times, tokenized by AutoTokenizer), greedy tokens from CLIPImageProcessor's
    pixel values, and the top-1/top-2 logit gaps."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    ids = [t for token_id in tokenizer(text)["input_ids"]
           for t in ([token_id] * NUM_IMAGE_TOKENS if token_id == image_id else [token_id])]
    kwargs = {}
    if images:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            processor = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                                        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
            kwargs["pixel_values"] = processor(images, return_tensors="pt")["pixel_values"]
    out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                      pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kwargs)
    top2 = torch.stack(out.scores, 1).float().topk(2, dim=-1).values  # (1, T, 2)
    return ids, out.sequences[0, len(ids):].tolist(), (top2[..., 0] - top2[..., 1])[0]


@pytest.fixture(scope="module")
def reference(llava):
    hf, model_dir = llava
    results = [llava_greedy(hf, model_dir, text, images) for text, images in PROMPTS]
    ids, tokens, gaps = zip(*results, strict=True)
    assert tokens[0] != tokens[3], "the two images of the same text should give different tokens"
    return list(ids), list(tokens), torch.stack(gaps)


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 8, "fast_cpu_kernels": False},
    {"enable_prefix_caching": False},
    {"max_model_len": 128, "kv_cache_memory": 9 * 16 * 512, "max_num_batched_tokens": 16},
    {"tensor_parallel_size": 2, "max_num_batched_tokens": 8},
], ids=["batched", "chunked-eager", "no-prefix-caching", "preempting", "tensor-parallel-chunked"])
def test_greedy_tokens_match_transformers(llava, reference, engine_args):
    """Guards placeholder expansion, the preprocessing, the encoder run and its rows placed at the
    placeholders, batched with a text-only prompt: transformers' LLaVA's greedy tokens (fp32),
    with the CPU fast path and module by module, under an 8-token budget that chunks through every
    image (16 tokens), without prefix caching, with a 9-block KV cache that preempts requests
    in their prefill (whose images are encoded again), and split over two tensor-parallel ranks
    (the encoder on the driver, its rows sent to the worker with each step's batch) under the
    8-token budget."""
    hf, model_dir = llava
    ids, expected, gaps = reference
    llm = LLM(str(model_dir), dtype="float32", **engine_args)
    num_encoded = []
    llm.engine.runner.image_embedder.encoder.register_forward_hook(
        lambda module, args, out: num_encoded.append(out.shape[0]))
    outputs = llm.generate([as_prompt(text, images) for text, images in PROMPTS], greedy(), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == ids
    num_images = sum(len(images) for _, images in PROMPTS)
    print(f"preemptions: {llm.engine.scheduler.num_preemptions}, "
          f"images encoded: {sum(num_encoded)} of {num_images}")
    if "kv_cache_memory" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0 and sum(num_encoded) > num_images
    else:
        assert sum(num_encoded) == num_images  # each once, however many chunks cover it
    assert_same_tokens(expected, gaps, [list(o.outputs[0].token_ids) for o in outputs], str(engine_args))


def test_prefix_cache_keys_hold_the_images(llava, reference):
    """Guards the images' hashes in the prefix-cache keys: after the first prompt, the same text and
    image hits every full block, the same text with another image only the blocks before its image
    (and still gets its own tokens), as transformers computes them."""
    _, model_dir = llava
    ids, expected, gaps = reference
    llm = LLM(str(model_dir), dtype="float32")
    [first] = llm.generate(as_prompt(*PROMPTS[0]), greedy(), use_tqdm=False)
    again, other = llm.generate([as_prompt(*PROMPTS[0]), as_prompt(*PROMPTS[3])], greedy(), use_tqdm=False)
    image_offset = ids[0].index(320)
    print(f"cached tokens: first {first.num_cached_tokens}, same image {again.num_cached_tokens}, "
          f"other image {other.num_cached_tokens} (image at {image_offset})")
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(ids[0]) - 1) // 16 * 16 > image_offset
    assert other.num_cached_tokens == image_offset // 16 * 16 > 0
    got = [list(o.outputs[0].token_ids) for o in (first, again, other)]
    assert_same_tokens([expected[0], expected[0], expected[3]], gaps[[0, 0, 3]], got, "prefix caching")


def data_url(image: PIL.Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_with_image_parts(llava):
    """Guards LLM.chat's image parts (a data URL and vLLM's image_pil): rendered through the
    template as {"type": "image"} parts, the images in order, transformers' tokens."""
    hf, model_dir = llava
    first, second = random_image(6), random_image(7, (30, 45), "RGBA")
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(first)}},
        {"type": "text", "text": "Compare with "},
        {"type": "image_pil", "image_pil": second},
    ]}]
    text = "USER: <image>\nCompare with <image>\n\nASSISTANT:"
    ids, expected, gaps = llava_greedy(hf, model_dir, text, [first, second])
    [output] = LLM(str(model_dir), dtype="float32").chat(messages, greedy(), use_tqdm=False)
    assert output.prompt == text
    assert output.prompt_token_ids == ids
    assert_same_tokens([expected], gaps[None], [list(output.outputs[0].token_ids)], "chat")


def test_bad_image_inputs_are_value_errors(llava, model_dir):
    """Guards the checks of image inputs: images for a text-only model, more or fewer images than
    placeholders, another modality, an object that is no image, undecodable bytes, a URL of
    another scheme, a file URL without allowed_local_media_path are ValueErrors naming them, and
    nothing stays queued."""
    _, llava_dir = llava
    llm = LLM(str(llava_dir), dtype="float32")
    image = random_image(1)
    garbage = "data:image/png;base64," + base64.b64encode(b"not an image").decode()

    def chat(part):
        return lambda: llm.chat([{"role": "user", "content": [part]}], greedy(), use_tqdm=False)

    cases = [
        (lambda: llm.generate(as_prompt("<image> and <image>", [image]), greedy()), "2 image placeholder"),
        (lambda: llm.generate(as_prompt("no placeholder", [image]), greedy()), "0 image placeholder"),
        (lambda: llm.generate({"prompt": "<image>", "multi_modal_data": {"video": [image]}}, greedy()),
         "only 'image' is supported"),
        (lambda: llm.generate(as_prompt("<image>", ["a.png"]), greedy()), "must be a PIL.Image.Image"),
        (chat({"type": "image_url", "image_url": {"url": garbage}}), "not a decodable image"),
        (chat({"type": "image_url", "image_url": {"url": "ftp://example.com/cat.png"}}),
         "image URLs are data, http, https or file URLs, got 'ftp'"),
        (chat({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}),
         "file URLs are refused unless allowed_local_media_path"),
        (chat({"type": "image_pil", "image_pil": b"png"}), "must be a PIL.Image.Image"),
        (chat({"type": "audio_url", "audio_url": {"url": garbage}}), "content parts are"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
        assert not llm.engine.has_unfinished_requests()
    text_llm = LLM(str(model_dir), dtype="float32")
    with pytest.raises(ValueError, match="takes no images"):
        text_llm.generate(as_prompt("hello", [image]), greedy())
    with pytest.raises(ValueError, match="text-only model"):
        text_llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image}]}], greedy())
    assert not text_llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def llava_server(llava, media_dir, tmp_path_factory):
    """The llava model served, fetching image URLs from 127.0.0.1 and reading files in `media_dir`."""
    _, model_dir = llava
    server = ServerProcess(model_dir, tmp_path_factory.mktemp("llava-server") / "server.log", "--api-key",
                           API_KEY, "--dtype", "float32", "--allowed-media-domains", "127.0.0.1",
                           "--allowed-local-media-path", str(media_dir), "--media-fetch-timeout", "1")
    yield server.wait_ready()
    server.stop()


def test_chat_completions_take_data_url_images(llava, llava_server):
    """Guards /v1/chat/completions' image_url parts through the official openai client on a real
    server: rendered as the template's {"type": "image"} parts (/tokenize's ids), a data URL's image
    reaches the model (transformers' greedy tokens), and an https URL of a host that
    --allowed-media-domains leaves out is a 400 naming `messages`, refused before any connection."""
    hf, model_dir = llava
    image = random_image(8, (45, 29))
    text = "USER: What is this? <image>\n\nASSISTANT:"  # a "string" template would give "this? \n<image>"
    ids, expected, gaps = llava_greedy(hf, model_dir, text, [image])
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def messages(url: str) -> list[dict]:
        parts = [{"type": "text", "text": "What is this? "}, {"type": "image_url", "image_url": {"url": url}}]
        return [{"role": "user", "content": parts}]

    def chat(url: str):
        return client.chat.completions.create(
            model=MODEL_NAME, messages=messages(url), max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

    rendered = httpx.post(llava_server.url + "/tokenize", json={
        "model": MODEL_NAME, "messages": messages(data_url(image)), "add_generation_prompt": True})
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert rendered.json()["tokens"] == tokenizer(text)["input_ids"]
    reply = chat(data_url(image))
    assert reply.usage.prompt_tokens == len(ids)
    got = [int(entry.token.removeprefix("token_id:")) for entry in reply.choices[0].logprobs.content]
    assert_same_tokens([expected], gaps[None], [got], "server")
    with pytest.raises(openai.BadRequestError) as error:
        chat("https://example.com/cat.png")
    assert "'example.com' is not one of the allowed media domains" in str(error.value)
    assert error.value.body["param"] == "messages"
    message = ChatMessage.model_validate({"role": "user", "content": messages(data_url(image))[0]["content"]})
    with pytest.raises(APIError, match="text-only"):  # a text model's server: a 400 naming messages
        message.template_message()


# ---- Checkpoint formats and server accounting (review B's findings) ----------------------------

LLAVA15_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}"
    "{% endif %}{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ part['text'] + ' ' }}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
"""llava-hf/llava-1.5-7b-hf's chat_template.json layout (images first, then the texts), shortened."""


@pytest.mark.parametrize("with_jinja", [False, True])
def test_processor_chat_template_json_is_read(tmp_path, with_jinja):
    """Guards the template llava-hf checkpoints ship as the processor's chat_template.json: read
    before chat_template.jinja and tokenizer_config.json, as transformers' LlavaProcessor reads it
    (and vLLM renders with it), the prompt as the processor renders it."""
    from slipstream.model.tokenizer import Tokenizer

    model_dir = save_llava(random_llava(), tmp_path)
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA15_TEMPLATE}))
    if with_jinja:
        (model_dir / "chat_template.jinja").write_text("{{ 'the tokenizer template' }}")
    processor = json.loads((model_dir / "preprocessor_config.json").read_text())
    (model_dir / "preprocessor_config.json").write_text(
        json.dumps(processor | {"image_processor_type": "CLIPImageProcessor"}))
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is shown?"}, {"type": "image"}]}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.AutoProcessor.from_pretrained(model_dir)
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template == reference.chat_template == LLAVA15_TEMPLATE
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         content_parts=True) == expected
    (model_dir / "additional_chat_templates").mkdir()
    with pytest.raises(ValueError, match="chat_template.json"):  # transformers refuses the mix too
        Tokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("kind", ["SiglipImageProcessor", "SiglipImageProcessorFast"])
def test_siglip_preprocessing_matches_siglip_image_processor(kind):
    """Guards the defaults by image_processor_type: a SigLIP preprocessor_config.json (as
    transformers saves it, unset keys null) is a plain bicubic resize to 384 x 384, mean and std
    0.5, no crop: the pixels of transformers' SiglipImageProcessor, not CLIP's resize and crop."""
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 500, 3), dtype=np.uint8))
    reference = SiglipImageProcessorPil(size={"height": 384, "width": 384})
    saved = reference.to_dict() | {"image_processor_type": kind, "do_center_crop": None, "crop_size": None}
    expected = reference(image, return_tensors="np")["pixel_values"][0]
    for config in (saved, {"image_processor_type": kind, "size": {"height": 384, "width": 384}}):
        got = ImageProcessor.from_dict(json.loads(json.dumps(config)))(image)
        print(f"max |difference| {np.abs(got - expected).max():.3g}")
        assert got.shape == expected.shape == (3, 384, 384)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="image_processor_type"):
        ImageProcessor.from_dict({"image_processor_type": "LlavaNextImageProcessor"})


@pytest.mark.parametrize("setting", [
    {"do_resize": False, "crop_size": {"height": 28, "width": 28}},
    {"do_resize": False, "crop_size": {"height": 12, "width": 40}},
    {"size": {"shortest_edge": 20}, "crop_size": {"height": 28, "width": 25}},
])
def test_crop_larger_than_the_image_pads_as_transformers(setting):
    """Guards a center crop larger than the (resized) image: zero-padded around it as transformers'
    center_crop pads, the same pixels as CLIPImageProcessor, never an error or a short array."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.CLIPImageProcessor(**setting)
    ours = ImageProcessor.from_dict(setting)
    for image in (random_image(1, (17, 9)), random_image(2, (21, 30), "RGBA")):
        expected = reference(image, return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(ours(image), expected, rtol=0, atol=1e-6)


def test_bad_preprocessor_values_are_value_errors():
    """Guards preprocessor_config.json's values: a scalar mean and std broadcast to the three
    channels as in transformers; a value of the wrong kind is a ValueError naming its key, at load
    rather than as a TypeError at the first request."""
    image = random_image(3, (40, 30))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.CLIPImageProcessor(image_mean=0.5, image_std=0.25)
    expected = reference(image, return_tensors="np")["pixel_values"][0]
    got = ImageProcessor.from_dict({"image_mean": 0.5, "image_std": 0.25})(image)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    bad = [({"size": {"shortest_edge": "336"}}, "size.shortest_edge"), ({"size": [336]}, "size"),
           ({"crop_size": {"height": 0, "width": 4}}, "crop_size.height"),
           ({"rescale_factor": "x"}, "rescale_factor"),
           ({"image_mean": [0.5, 0.5]}, "image_mean"), ({"image_std": "0.5"}, "image_std"),
           ({"do_resize": "yes"}, "do_resize"), ({"resample": 9}, "resample"),
           ({"do_center_crop": True, "crop_size": None, "image_processor_type": "SiglipImageProcessor"},
            "crop_size")]
    for config, key in bad:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            ImageProcessor.from_dict(config)


def test_image_size_need_not_be_a_multiple_of_patch_size(tmp_path):
    """Guards towers like SigLIP so400m-patch14-384 (384 / 14 = 27.4): transformers' convolution
    keeps the whole patches, floor(30 / 7)^2 = 16 here, and so does ours: the same features."""
    hf = random_llava(vision_config("siglip_vision_model") | {"image_size": 30},
                      vision_feature_select_strategy="full", vision_feature_layer=-1)
    hf.save_pretrained(tmp_path)
    encoder = load_image_encoder(tmp_path, LlavaConfig.from_pretrained(tmp_path), TEXT["hidden_size"],
                                 dtype=torch.float32, device="cpu")
    pixels = torch.randn(2, 3, 30, 30)
    with torch.no_grad():
        expected = torch.stack(hf.model.get_image_features(pixels).pooler_output)
        got = encoder(pixels)
    assert got.shape == expected.shape == (2, 16, TEXT["hidden_size"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_legacy_position_ids_buffer_is_skipped(tmp_path, llava):
    """Guards CLIP dumps from transformers < 4.31, which hold the `embeddings.position_ids` buffer:
    the checkpoint loads (as in transformers) and the model serves transformers' greedy tokens."""
    from safetensors.torch import load_file, save_file

    hf, model_dir = llava
    tensors = load_file(model_dir / "model.safetensors")
    [name] = [n for n in tensors if n.endswith("embeddings.position_embedding.weight")]
    tensors[name.replace("position_embedding.weight", "position_ids")] = torch.arange(17)[None]
    for path in model_dir.iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    text, images = PROMPTS[0]
    _, expected, gaps = llava_greedy(hf, model_dir, text, images)
    [output] = LLM(str(tmp_path), dtype="float32").generate(as_prompt(text, images), greedy(), use_tqdm=False)
    assert_same_tokens([expected], gaps[None], [list(output.outputs[0].token_ids)], "position_ids")


def test_granite_text_model_is_refused():
    """Guards llava with a Granite language model: transformers multiplies the image rows by
    embedding_multiplier too, which the engine's image rows would miss, so it is a ValueError
    naming text_config.model_type rather than wrong tokens."""
    granite = TEXT | {"model_type": "granite", "embedding_multiplier": 12.0}
    config = transformers.LlavaConfig(vision_config=vision_config(), text_config=granite).to_dict()
    with pytest.raises(ValueError, match="text_config.model_type 'granite'"):
        LlavaConfig.from_hf_dict(config)
    assert LlavaConfig.from_hf_dict(config | {"text_config": TEXT}).image_token_index == 32000


def test_server_counts_the_image_tokens(llava, llava_server):
    """Guards the server's accounting of images: the context check counts each image's expanded
    tokens (a 400 with OpenAI's context code, as vLLM checks the processed prompt, not a cut-short
    reply), every streamed chunk's usage counts them as the reply's does, the plain-string image_url form is
    taken (as vLLM takes it), and an image token typed as text is a 400 naming the field it is in."""
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    url = data_url(random_image(9))
    content = [{"type": "text", "text": "What? "}, {"type": "image_url", "image_url": url}]
    messages = [{"role": "user", "content": content}]
    rendered = httpx.post(llava_server.url + "/tokenize", json={
        "model": MODEL_NAME, "messages": messages, "add_generation_prompt": True}).json()
    num_prompt_tokens = rendered["count"] + NUM_IMAGE_TOKENS - 1
    room = rendered["max_model_len"] - num_prompt_tokens
    with pytest.raises(openai.BadRequestError) as error:  # fits unexpanded, not expanded
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=room + 1)
    assert error.value.code == "context_length_exceeded"
    assert f"{num_prompt_tokens} in the prompt" in str(error.value)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0)
    stream = client.chat.completions.create(  # vLLM's continuous_usage_stats: usage in every chunk
        model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    usages = {chunk.usage.prompt_tokens for chunk in stream}
    assert reply.usage.prompt_tokens == num_prompt_tokens and usages == {num_prompt_tokens}
    typed = [{"role": "user", "content": [{"type": "text", "text": "look: <image>"},
                                          {"type": "image_url", "image_url": url}]}]
    calls = [
        ("messages", lambda: client.chat.completions.create(model=MODEL_NAME, messages=typed, max_tokens=2)),
        ("prompt", lambda: client.completions.create(model=MODEL_NAME, prompt="a <image>", max_tokens=2)),
        ("input", lambda: client.responses.create(model=MODEL_NAME, input="a <image>", max_output_tokens=2)),
    ]
    for param, call in calls:
        with pytest.raises(openai.BadRequestError) as error:
            call()
        assert error.value.body["param"] == param and "image placeholder" in str(error.value)


# ---- Engine: image sizes, the shared encoder cache, off-thread preprocessing (review A's findings) --


def test_costly_images_and_truncated_placeholders_are_value_errors(llava, monkeypatch):
    """Guards the size checks before preprocessing: an empty image, one thinner than 200:1 (a 1 x
    20000 one would resize to 28 x 560000 here) and one of 1:40 (under 200:1 but resized to 28 x
    1120, past 32 tower inputs) are ValueErrors naming the image and its size, while 1:30 passes;
    a prompt whose placeholder truncate_prompt_tokens cut says so; an image past Pillow's
    MAX_IMAGE_PIXELS is refused from its header (Pillow only warns up to twice that)."""
    hf, model_dir = llava
    llm = LLM(str(model_dir), dtype="float32")
    cases = [((0, 5), "image 1 \\(0x5\\) is empty"), ((1, 20000), "image 1 \\(1x20000\\): its aspect ratio"),
             ((40, 1), "image 1 \\(40x1\\)"), ((1, 40), "image 1 \\(1x40\\) would be resized to 28x1120")]
    for size, match in cases:
        images = [random_image(1), PIL.Image.new("RGB", size)]
        with pytest.raises(ValueError, match=match):
            llm.generate(as_prompt("<image> and <image>", images), greedy(), use_tqdm=False)
    [output] = llm.generate(as_prompt("<image>", [random_image(2, (1, 30))]), greedy(1), use_tqdm=False)
    assert output.outputs[0].token_ids
    truncated = SamplingParams(max_tokens=1, truncate_prompt_tokens=3)
    with pytest.raises(ValueError, match="0 image placeholder.*truncate_prompt_tokens cuts the prompt"):
        llm.generate(as_prompt("<image> is what I mean", [random_image(1)]), truncated, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        with pytest.raises(ValueError, match="the image is 40x40, more than 1000 pixels"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {
                "url": data_url(random_image(1, (40, 40)))}}]}], greedy(), use_tqdm=False)


def test_images_are_encoded_once_per_content_in_bounded_batches(llava, reference):
    """Guards the encoder cache keyed by content: n=3 completions of a prompt, and another prompt
    with the same image, encode it once; a step's images go to the encoder at most
    `max_batch_images` at a time; every completion has transformers' tokens; nothing stays cached."""
    hf, model_dir = llava
    ids, expected, gaps = reference
    llm = LLM(str(model_dir), dtype="float32")
    embedder = llm.engine.runner.image_embedder
    embedder.max_batch_images = 2
    batches = []
    embedder.encoder.register_forward_hook(lambda module, args, out: batches.append(out.shape[0]))
    prompts = [as_prompt(*PROMPTS[0]), as_prompt(*PROMPTS[1]), as_prompt(*PROMPTS[4]), as_prompt(*PROMPTS[0])]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)] + [greedy()] * 3
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print(f"encoder batches: {batches}")
    assert sum(batches) == 4 and max(batches) == 2  # the 2 + 1 + 1 distinct images
    got = [list(c.token_ids) for o in outputs for c in o.outputs]
    rows = [0, 0, 0, 1, 4, 0]
    assert_same_tokens([expected[i] for i in rows], gaps[rows], got, "shared images")
    assert embedder.num_cached == 0


def test_aborting_mid_image_frees_its_encoder_cache_entry(llava):
    """Guards the release on abort: a request whose 8-token chunk ended inside its image holds the
    image's embeddings, and its abort frees them at once (not at a later step)."""
    _, model_dir = llava
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_batched_tokens=8))
    engine.add_request("a", "<image> hello", greedy(), images=[random_image(1)])
    engine.step()
    assert engine.runner.image_embedder.num_cached == 1
    engine.abort_request("a")
    assert engine.runner.image_embedder.num_cached == 0


def test_async_engine_preprocesses_images_off_the_engine_thread(llava, reference):
    """Guards the async engine's preprocessing in a worker thread: a prompt too long once its
    placeholders are expanded is refused before its images are preprocessed, the engine thread
    never runs the image processor, and the tokens are transformers'."""
    hf, model_dir = llava
    ids, expected, gaps = reference
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32"))
    threads = []

    class ThreadRecordingProcessor(ImageProcessor):
        def __call__(self, image):
            threads.append(threading.current_thread().name)
            return super().__call__(image)

    prompts = engine.image_prompts
    prompts.processor = ThreadRecordingProcessor(**dataclasses.asdict(prompts.processor))
    text, images = PROMPTS[1]

    async def main():
        loop_engine = AsyncEngine(engine, max_waiting=4)
        loop_engine.start()
        too_long = engine.tokenize(text) + [5] * (engine.limits.max_model_len - 20)
        with pytest.raises(ValueError, match="context length"):
            await loop_engine.add({"long": too_long}, greedy(), images=images,
                                  arrival_time_s=time.monotonic())
        assert not threads
        stream = await loop_engine.add({"r": engine.tokenize(text)}, greedy(), images=images,
                                       arrival_time_s=time.monotonic())
        while not stream.finished:
            [output] = await stream.get()
        await loop_engine.stop()
        return output

    output = asyncio.run(main())
    assert len(threads) == 2 and "slipstream-engine" not in threads, threads
    assert_same_tokens([expected[1]], gaps[[1]], [list(output.outputs[0].token_ids)], "async engine")


@pytest.mark.parametrize("engine_args", [
    {"num_scheduler_steps": 4},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                            "prompt_lookup_min": 1}},
], ids=["multi-step", "speculative"])
def test_last_prompt_token_is_an_image_placeholder_after_a_hit(llava, engine_args):
    """Guards Engine._num_greedy_steps' images_end check: a 17-token prompt ending in its image, run
    twice, leaves one image placeholder to compute after the prefix-cache hit; neither the
    multi-step nor the speculative path (which take token ids only) may take that chunk."""
    hf, model_dir = llava
    text, images = "x<image>", [random_image(1)]
    ids, expected, gaps = llava_greedy(hf, model_dir, text, images)
    llm = LLM(str(model_dir), dtype="float32", **engine_args)
    llm.generate(as_prompt(text, images), greedy(), use_tqdm=False)
    [again] = llm.generate(as_prompt(text, images), greedy(), use_tqdm=False)
    assert len(ids) == 17 and again.num_cached_tokens == 16
    assert_same_tokens([expected], gaps[None], [list(again.outputs[0].token_ids)], str(engine_args))


def test_preemption_frees_the_encoder_cache_entries_it_held(llava):
    """Guards the release on preemption: under an 8-block KV cache and a 12-token budget requests
    are preempted inside their images; after every step the encoder cache holds exactly the images
    that running requests are part-way through (none of a preempted one's), and at the end none."""
    _, model_dir = llava
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=128,
                                 kv_cache_memory=8 * 16 * 512, max_num_batched_tokens=12))
    for index, (text, images) in enumerate(PROMPTS):
        engine.add_request(str(index), text, greedy(), images=images)
    embedder = engine.runner.image_embedder
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler._running  # the scheduler's running requests, in their present state
        inside = {image.content_hash for request in running for image in request.images
                  if image.offset < request.num_computed_tokens < image.end}
        assert embedder.num_cached == len(inside)
        checked += bool(inside)
    print(f"preemptions: {engine.scheduler.num_preemptions}, steps inside an image: {checked}")
    assert engine.scheduler.num_preemptions > 0 and checked > 0 and embedder.num_cached == 0


def test_image_encoder_runs_in_the_forward_phase(llava):
    """Guards the encoder's time in the step's `runner: forward` profiler phase: every convolution
    (the tower's patch embedding; the language model has none) lies inside one of its ranges."""
    _, model_dir = llava
    llm = LLM(str(model_dir), dtype="float32")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        llm.generate(as_prompt(*PROMPTS[1]), greedy(1), use_tqdm=False)
    events = profile.events()
    forwards = [e.time_range for e in events if e.name == FORWARD_PHASE]
    convolutions = [e.time_range for e in events if e.name == "aten::convolution"]
    assert forwards and convolutions
    for conv in convolutions:
        assert any(f.start <= conv.start and conv.end <= f.end for f in forwards)


# ---- Image URLs: http(s) fetched, file read, as vLLM's MediaConnector does (serve/media.py) ------


def encoded(image: PIL.Image.Image, format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return buffer.getvalue()


IMAGE_FILES = {"cat.png": encoded(random_image(10, (45, 29)), "PNG"),
               "dog.jpg": encoded(random_image(11, (37, 52)), "JPEG")}
"""What the test host serves and `media_dir` holds: real PNG and JPEG bytes."""
URL_TIMEOUT_S = 0.5
"""The tests' --media-fetch-timeout (media.FETCH_TIMEOUT_S is the default)."""


@pytest.fixture(scope="module", autouse=True)
def no_proxy_for_local_hosts():
    """The image host, and the servers started here, reached directly where the environment names
    a proxy (urllib uses HTTP(S)_PROXY, as vLLM's clients do)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("NO_PROXY", "no_proxy"):
            patch.setenv(name, "127.0.0.1,localhost")
        yield


class ImageHost:
    """A real HTTP server on 127.0.0.1, in a thread: IMAGE_FILES at /NAME (/NAME?unsized: without
    a Content-Length, the body ended by closing the connection), /missing (404), /text (no
    image), /redirect?to=URL (302), /loop (redirects to itself), /stall (headers, then nothing
    for 10 s), /trickle (a byte of the body every 0.1 s for 5 s), /slowheaders (a byte of a
    header every 0.1 s for 5 s) and /slow/NAME (IMAGE_FILES[NAME] after SLOW_S). `paths` records
    every request's path, `started` each one's path and when it came (time.monotonic())."""

    SLOW_S = 0.6

    def __init__(self) -> None:
        host = self
        self.paths: list[str] = []
        self.started: list[tuple[str, float]] = []
        self.stop = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                host.started.append((self.path, time.monotonic()))
                host.paths.append(self.path)
                url = urlsplit(self.path)
                name = url.path.lstrip("/")
                if name.startswith("slow/") and name.removeprefix("slow/") in IMAGE_FILES:
                    time.sleep(host.SLOW_S)
                    self._answer(200, IMAGE_FILES[name.removeprefix("slow/")])
                elif name in IMAGE_FILES:
                    self._answer(200, IMAGE_FILES[name], sized=url.query != "unsized")
                elif name in ("redirect", "loop"):
                    target = parse_qs(url.query)["to"][0] if name == "redirect" else "/loop"
                    self.send_response(302)
                    self.send_header("Location", target)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif name == "text":
                    self._answer(200, b"hello, I am no image")
                elif name in ("stall", "trickle", "slowheaders"):
                    if name == "slowheaders":
                        self.wfile.write(b"HTTP/1.0 200 OK\r\nX-Slow: ")
                    else:
                        self.send_response(200)
                        self.end_headers()
                    with contextlib.suppress(ConnectionError):  # the client hung up at its timeout
                        for _ in range(50):  # 5 s of a byte every 0.1 s, or one byte after 10 s
                            if host.stop.wait(10 if name == "stall" else 0.1):
                                break
                            self.wfile.write(b"x")
                            self.wfile.flush()
                else:
                    self._answer(404, b"not found")

            def _answer(self, status: int, body: bytes, sized: bool = True) -> None:
                self.send_response(status)
                if sized:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def image_host():
    host = ImageHost()
    yield host
    host.close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    """A directory holding IMAGE_FILES, a subdirectory and a symlink loop, with `outside.png` (an
    image too) beside it, not in it."""
    root = tmp_path_factory.mktemp("media")
    for name, data in IMAGE_FILES.items():
        (root / "images" / name).parent.mkdir(exist_ok=True)
        (root / "images" / name).write_bytes(data)
    (root / "outside.png").write_bytes(IMAGE_FILES["cat.png"])
    (root / "images" / "link.png").symlink_to(root / "outside.png")
    (root / "images" / "folder").mkdir()
    (root / "images" / "loop.png").symlink_to(root / "images" / "loop.png")
    return root / "images"


def image_chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]


IMAGE_CHAT_TEXT = "USER: <image>\nWhat is this?\nASSISTANT:"


def test_image_urls_give_the_tokens_of_their_images(llava, image_host, media_dir):
    """Guards loading image URLs in LLM.chat: an http URL (PNG and JPEG), one without a
    Content-Length, one redirected within the allowed host, and a file URL give transformers'
    greedy tokens for the decoded image, as its data URL does."""
    hf, model_dir = llava
    llm = LLM(str(model_dir), dtype="float32", allowed_media_domains=["127.0.0.1"],
              allowed_local_media_path=media_dir)
    for name, data in IMAGE_FILES.items():
        _, expected, gaps = llava_greedy(hf, model_dir, IMAGE_CHAT_TEXT, [PIL.Image.open(io.BytesIO(data))])
        kind = "png" if name.endswith("png") else "jpeg"
        urls = [f"data:image/{kind};base64,{base64.b64encode(data).decode()}", f"{image_host.url}/{name}",
                f"{image_host.url}/{name}?unsized", f"{image_host.url}/redirect?to=/{name}",
                (media_dir / name).as_uri()]
        outputs = llm.chat([image_chat(url) for url in urls], greedy(), use_tqdm=False)
        assert {o.prompt for o in outputs} == {IMAGE_CHAT_TEXT}
        got = [list(o.outputs[0].token_ids) for o in outputs]
        assert_same_tokens([expected] * len(urls), gaps.expand(len(urls), -1), got, name)


def test_image_urls_that_cannot_be_loaded_are_value_errors(llava, image_host, media_dir):
    """Guards every refusal of an image URL in LLM.chat, each a ValueError naming the content part
    and the problem, nothing left queued: HTTP 404, a body that is no image, a host not allowed
    (never contacted), a redirect to one (not followed), to a file URL or to no URL, a redirect
    loop, a server that stalls and ones that trickle the body or the headers past the timeout (cut
    off at it), URLs with a user, a bad port or a non-ASCII path (sent percent-encoded), a port
    nobody listens on, and file URLs outside the allowed directory (by path, `..` or symlink), of a
    directory, of a symlink loop or with a NUL byte."""
    _, model_dir = llava
    llm = LLM(str(model_dir), dtype="float32", allowed_media_domains=["127.0.0.1"],
              allowed_local_media_path=media_dir, media_fetch_timeout_s=URL_TIMEOUT_S)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    other_host = image_host.url.replace("127.0.0.1", "localhost")
    outside = media_dir.parent / "outside.png"
    num_requests = len(image_host.paths)
    cases = [
        (f"{image_host.url}/missing", "gave HTTP 404"),
        (f"{image_host.url}/text", "not a decodable image"),
        (f"{other_host}/cat.png", "the host 'localhost' is not one of the allowed media domains"),
        (f"{image_host.url}/redirect?to={other_host}/cat.png", "'localhost' is not one of the allowed"),
        (f"{image_host.url}/redirect?to={outside.as_uri()}", "a redirect's target, is not an http"),
        (f"{image_host.url}/loop", "more than 5 redirects"),
        (f"{image_host.url}/stall", "longer than the 0.5 s media fetch timeout"),
        (f"{image_host.url}/trickle", "longer than the 0.5 s media fetch timeout"),
        (f"{image_host.url}/slowheaders", "longer than the 0.5 s media fetch timeout"),
        (f"{image_host.url}/redirect?to=http://[zz/x", r"redirected to 'http://\[zz/x', which is not a"),
        (f"http://user:secret@{image_host.url[len('http://'):]}/cat.png", "names a user or password"),
        ("http://127.0.0.1:99999/cat.png", r"is not a valid URL \(Port out of range"),
        (f"{image_host.url}/caté.png", "fetching .*/cat%C3%A9.png gave HTTP 404"),
        (f"http://127.0.0.1:{closed_port}/cat.png", "fetching .* failed \\(ConnectionRefusedError"),
        (outside.as_uri(), "is not under the allowed local media path"),
        (f"file://{media_dir}/../outside.png", "is not under the allowed local media path"),
        ((media_dir / "link.png").as_uri(), "outside.png is not under the allowed local media path"),
        ((media_dir / "nothing.png").as_uri(), "cannot read"),
        ((media_dir / "folder").as_uri(), "folder is not a regular file"),
        ((media_dir / "loop.png").as_uri(), "cannot resolve .*loop.png"),
        (f"{media_dir.as_uri()}/cat%00.png", "cannot resolve .*embedded null byte"),
    ]
    for url, match in cases:
        start_s = time.monotonic()
        with pytest.raises(ValueError, match=r"a message's content\[0\]\['image_url'\]\['url'\]: .*" + match):
            llm.chat(image_chat(url), greedy(), use_tqdm=False)
        assert time.monotonic() - start_s < URL_TIMEOUT_S + 2, url  # a trickle would take 5 s
        assert not llm.engine.has_unfinished_requests()
    assert "/cat.png" not in image_host.paths[num_requests:]  # neither the other host nor the redirect's


def test_llm_chat_loads_its_image_urls_at_once(llava, image_host):
    """Guards that LLM.chat fetches the image URLs of all its conversations together, as the
    server does: five images that each take ImageHost.SLOW_S to arrive, in two conversations, are
    all requested before the first has arrived, and each prompt and reply is that of the same
    images given as PIL images; a
    conversation whose second image is missing and third no image is a ValueError naming the
    second, the first failure in the messages, and nothing is left queued."""
    _, model_dir = llava
    llm = LLM(str(model_dir), dtype="float32", allowed_media_domains=["127.0.0.1"])
    slow = {"type": "image_url", "image_url": {"url": f"{image_host.url}/slow/dog.jpg"}}
    first = len(image_host.started)

    def conversations(part: dict) -> list[list[dict]]:  # three images, then two
        return [[{"role": "user", "content": [part] * n + [{"type": "text", "text": "?"}]}] for n in (3, 2)]

    outputs = llm.chat(conversations(slow), greedy(1), use_tqdm=False)
    starts = [t for path, t in image_host.started[first:] if path == "/slow/dog.jpg"]
    assert len(starts) == 5
    print(f"5 fetches of {image_host.SLOW_S} s each started within {max(starts) - min(starts):.3f} s")
    assert max(starts) - min(starts) < image_host.SLOW_S  # one after another: >= 4 x SLOW_S
    dog = {"type": "image_pil", "image_pil": PIL.Image.open(io.BytesIO(IMAGE_FILES["dog.jpg"]))}
    given = llm.chat(conversations(dog), greedy(1), use_tqdm=False)
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs] == [
        (o.prompt_token_ids, o.outputs[0].token_ids) for o in given]
    missing = {"type": "image_url", "image_url": {"url": f"{image_host.url}/missing"}}
    not_an_image = {"type": "image_url", "image_url": {"url": f"{image_host.url}/text"}}
    with pytest.raises(ValueError, match=r"a message's content\[1\]\['image_url'\]\['url'\]: fetching "
                                         r".*/missing gave HTTP 404"):
        llm.chat([{"role": "user", "content": [slow, missing, not_an_image]}], greedy(1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_host_name_that_resolves_slowly_is_cut_off_at_the_timeout(monkeypatch):
    """Resolving an image URL's host name counts toward the fetch's timeout: with the resolver
    hanging (patched here), the fetch fails at the deadline naming the timeout, not when the
    resolver answers."""
    from slipstream.serve.media import MediaConfig, load_image

    release, resolve = threading.Event(), socket.getaddrinfo

    def hanging(host, *args, **kwargs):
        if host == "slow.invalid":
            release.wait(30)
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    start_s = time.monotonic()
    try:
        with pytest.raises(ValueError, match=r"w: fetching http://slow.invalid/cat.png took longer than the "
                                             r"0.3 s media fetch timeout"):
            load_image("http://slow.invalid/cat.png", "w", MediaConfig(fetch_timeout_s=0.3))
    finally:
        release.set()
    assert time.monotonic() - start_s < 2


def test_image_byte_limit_and_settings_are_checked(image_host, media_dir, capsys):
    """Guards MediaConfig: an image of exactly max_image_bytes loads, one byte more is refused
    whether the server sends a Content-Length or not, and from a file (its host `localhost` in any
    case); a file URL without an allowed directory, or with vLLM's default "" for it, is refused
    naming the setting; allowed hosts compare lower-cased and without a trailing dot; bad settings
    (a host with a port, path, user or space) are ValueErrors naming them before a model loads (a
    misspelt one a TypeError suggesting it), and the CLI's flags one-line errors naming the flag."""
    from slipstream.cli import build_parser
    from slipstream.serve.media import MediaConfig, load_image

    size = len(IMAGE_FILES["cat.png"])
    urls = [f"{image_host.url}/cat.png", f"{image_host.url}/cat.png?unsized",
            (media_dir / "cat.png").as_uri(), f"file://LocalHost{media_dir}/cat.png"]
    for url in urls:
        fits = MediaConfig(allowed_local_media_path=str(media_dir), max_image_bytes=size)
        assert load_image(url, "w", fits).size == (45, 29)
        with pytest.raises(ValueError, match=f"w: .* more than the {size - 1} bytes an image may have"):
            load_image(url, "w", dataclasses.replace(fits, max_image_bytes=size - 1))
    cli_default = build_parser().parse_args(["serve", "model", "--allowed-local-media-path", ""])
    for media in [MediaConfig(), MediaConfig.from_args(allowed_local_media_path=""),
                  MediaConfig.from_args(allowed_local_media_path=cli_default.allowed_local_media_path)]:
        with pytest.raises(ValueError, match="file URLs are refused unless allowed_local_media_path"):
            load_image(urls[2], "w", media)
    hosts = MediaConfig.from_args([" 127.0.0.1. ", "Example.COM"])
    assert hosts.allowed_media_domains == ("127.0.0.1", "example.com")
    assert load_image(urls[0], "w", hosts).size == (45, 29)
    with pytest.raises(ValueError, match="the host 'localhost' is not one of the allowed media domains"):
        load_image(urls[0].replace("127.0.0.1", "LOCALHOST."), "w", hosts)
    bad = [({"media_fetch_timeout_s": 0}, "media_fetch_timeout_s"),
           ({"media_fetch_timeout_s": float("nan")}, "media_fetch_timeout_s"),
           ({"allowed_local_media_path": media_dir / "nothing"}, "allowed_local_media_path"),
           ({"allowed_local_media_path": media_dir / "cat.png"}, "allowed_local_media_path"),
           ({"allowed_media_domains": "127.0.0.1"}, "allowed_media_domains"),
           ({"allowed_media_domains": []}, "allowed_media_domains"),
           ({"allowed_media_domains": [" "]}, "allowed_media_domains")]
    bad += [({"allowed_media_domains": ["127.0.0.1", host]}, "allowed_media_domains")
            for host in ["127.0.0.1:8000", "example.com/images", "user@example.com", "example .com"]]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            LLM("no-such-model", **args)
    with pytest.raises(TypeError, match="did you mean 'allowed_media_domains'"):
        LLM("no-such-model", allowed_media_domain=["127.0.0.1"])
    flags = [["--allowed-local-media-path", str(media_dir / "nothing")], ["--media-fetch-timeout", "0"],
             ["--allowed-media-domains"]]
    for flag in flags:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "model", *flag])
        assert flag[0] in capsys.readouterr().err


def test_server_fetches_image_urls(llava, llava_server, image_host, media_dir):
    """Guards the server's image URLs through the official openai client: an http URL and a file
    URL give transformers' tokens for the image; a 404, a host not allowed, a file outside the
    allowed directory and a stall past --media-fetch-timeout are 400s naming `messages` and the
    problem; while fetches stall, in more requests than asyncio's default executor has threads, a
    text request still answers at once (image URLs load in threads of their own); more images than
    the context holds are refused before any is fetched; and the server answers the next request."""
    hf, model_dir = llava
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    data = IMAGE_FILES["dog.jpg"]
    _, expected, gaps = llava_greedy(hf, model_dir, IMAGE_CHAT_TEXT, [PIL.Image.open(io.BytesIO(data))])

    def tokens(url: str) -> list[int]:
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=image_chat(url), max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        return [int(entry.token.removeprefix("token_id:")) for entry in reply.choices[0].logprobs.content]

    urls = [f"{image_host.url}/dog.jpg", (media_dir / "dog.jpg").as_uri()]
    assert_same_tokens([expected] * 2, gaps.expand(2, -1), [tokens(url) for url in urls], "server")
    other_host = image_host.url.replace("127.0.0.1", "localhost")
    cases = [(f"{image_host.url}/missing", "HTTP 404"), (f"{other_host}/dog.jpg", "'localhost' is not one"),
             ((media_dir.parent / "outside.png").as_uri(), "is not under the allowed local media path"),
             (f"{image_host.url}/stall", "longer than the 1 s media fetch timeout")]
    for url, match in cases:
        with pytest.raises(openai.BadRequestError) as error:
            tokens(url)
        assert match in str(error.value) and error.value.body["param"] == "messages", str(error.value)
    num_stalls = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's threads
    stalled = {"model": MODEL_NAME, "messages": image_chat(f"{image_host.url}/stall"), "max_tokens": 1}
    started = image_host.paths.count("/stall")
    with concurrent.futures.ThreadPoolExecutor(num_stalls) as threads:
        replies = [threads.submit(httpx.post, f"{llava_server.url}/v1/chat/completions", json=stalled,
                                  headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
                   for _ in range(num_stalls)]
        give_up_s = time.monotonic() + 10
        while image_host.paths.count("/stall") < started + min(num_stalls, MEDIA_THREADS):
            assert time.monotonic() < give_up_s, "the stalled fetches never reached the image host"
            time.sleep(0.01)
        start_s = time.monotonic()
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=1)
        assert time.monotonic() - start_s < 0.5  # not after a stall's 1 s timeout
        assert [reply.result().status_code for reply in replies] == [400] * num_stalls
    num_fetched = len(image_host.paths)
    many = [{"type": "image_url", "image_url": {"url": f"{image_host.url}/dog.jpg"}}] * 16  # 16 x 16 tokens
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": many}],
                                       max_tokens=1)
    assert error.value.code == "context_length_exceeded" and len(image_host.paths) == num_fetched
    assert_same_tokens([expected], gaps[None], [tokens(urls[0])], "server, after the refusals")


def test_server_loads_a_requests_image_urls_at_once(llava, llava_server, image_host):
    """Guards that the server fetches the image URLs of one request together, not one after
    another: five images that each take ImageHost.SLOW_S to arrive are all requested before the
    first has arrived, and the reply has the tokens of five images; a request whose second
    image is missing is a 400 naming it, the first failure in the messages."""
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    slow = {"type": "image_url", "image_url": {"url": f"{image_host.url}/slow/dog.jpg"}}
    first = len(image_host.started)
    content = [slow] * 5 + [{"type": "text", "text": "?"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                                           max_tokens=1)
    starts = [t for path, t in image_host.started[first:] if path == "/slow/dog.jpg"]
    assert len(starts) == 5
    print(f"5 fetches of {image_host.SLOW_S} s each started within {max(starts) - min(starts):.3f} s")
    assert max(starts) - min(starts) < image_host.SLOW_S  # one after another: >= 4 x SLOW_S
    assert reply.usage.prompt_tokens > 5 * NUM_IMAGE_TOKENS
    missing = {"type": "image_url", "image_url": {"url": f"{image_host.url}/missing"}}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": [
            slow, missing, {"type": "image_url", "image_url": {"url": f"{image_host.url}/text"}}]}],
            max_tokens=1)
    assert "image_url 1" in str(error.value) and "HTTP 404" in str(error.value), str(error.value)


def test_limit_mm_per_prompt_refuses_more_images_before_loading_them(llava, reference, image_host):
    """Guards vLLM's limit_mm_per_prompt: with {"image": 1} a prompt of two images is the
    ValueError vLLM raises (generate, and chat with two image URLs, none fetched), one image still
    gives transformers' tokens; {"image": 0} serves the checkpoint as a text model, its encoder not
    loaded, a text prompt with transformers' tokens and any image refused by the limit."""
    hf, model_dir = llava
    ids, expected, gaps = reference
    llm = LLM(str(model_dir), dtype="float32", limit_mm_per_prompt={"image": 1},
              allowed_media_domains=["127.0.0.1"])
    with pytest.raises(ValueError, match=r"At most 1 image\(s\) may be provided in one prompt, got 2"):
        llm.generate(as_prompt(*PROMPTS[1]), greedy(), use_tqdm=False)
    url = {"type": "image_url", "image_url": {"url": f"{image_host.url}/slow/dog.jpg"}}
    fetched = len(image_host.paths)
    with pytest.raises(ValueError, match=r"At most 1 image\(s\) .* got 2"):
        llm.chat([{"role": "user", "content": [url, url]}], greedy(1), use_tqdm=False)
    assert len(image_host.paths) == fetched
    [output] = llm.generate(as_prompt(*PROMPTS[0]), greedy(), use_tqdm=False)
    assert output.prompt_token_ids == ids[0]
    assert_same_tokens(expected[:1], gaps[:1], [list(output.outputs[0].token_ids)], "limit 1")

    text_only = LLM(str(model_dir), dtype="float32", limit_mm_per_prompt='{"image": 0}')
    assert text_only.engine.runner.image_embedder is None and text_only.engine.image_prompts is None
    [output] = text_only.generate(PROMPTS[2][0], greedy(), use_tqdm=False)
    assert_same_tokens(expected[2:3], gaps[2:3], [list(output.outputs[0].token_ids)], "limit 0")
    with pytest.raises(ValueError, match=r"At most 0 image\(s\) .* got 1"):
        text_only.generate(as_prompt(*PROMPTS[0]), greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"At most 0 image\(s\) .* got 1"):
        text_only.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": random_image(1)}]}],
                       greedy(1), use_tqdm=False)


@pytest.mark.parametrize("value, message", [
    ({"image": -1}, r"limit_mm_per_prompt\['image'\] must be an integer >= 0, got -1"),
    ({"image": True}, r"must be an integer >= 0, got True"),
    ({"image": "2"}, r"must be an integer >= 0, got '2'"),
    ({"images": 2}, r"unknown modality 'images' \(known: image, video, audio\)"),
    ({"image": {"count": 2, "width": 512}}, r"takes only 'count' here, got \['count', 'width'\]"),
    ('{"image": 2', r"limit_mm_per_prompt is not valid JSON"),
    ([2], r"limit_mm_per_prompt must be a dict, got \[2\]"),
])
def test_bad_limit_mm_per_prompt_is_a_value_error(model_dir, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(model_dir), limit_mm_per_prompt=value)


def test_limit_mm_per_prompt_parses_vllms_forms(model_dir):
    """vLLM's count and {"count": n} forms, and limits on modalities no model here takes."""
    config = EngineConfig(model=str(model_dir), limit_mm_per_prompt={"image": {"count": 3}, "video": 0})
    assert config.limit_mm_per_prompt == {"image": 3, "video": 0}
    assert EngineConfig(model=str(model_dir), limit_mm_per_prompt='{"audio": 1}').limit_mm_per_prompt == {
        "audio": 1}


def test_server_refuses_more_images_than_the_limit_before_fetching(llava, image_host):
    """Guards --limit-mm-per-prompt at the server: a chat of two image URLs is a 400 naming
    `messages` with vLLM's message, and neither URL is fetched; one image is served."""
    _, model_dir = llava
    url = {"type": "image_url", "image_url": {"url": f"{image_host.url}/dog.jpg"}}
    with serve_in_process(model_dir, "--dtype", "float32", "--limit-mm-per-prompt", '{"image": 1}',
                          "--allowed-media-domains", "127.0.0.1") as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        fetched = len(image_host.paths)
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL_NAME, max_tokens=1,
                                           messages=[{"role": "user", "content": [url, url]}])
        assert "At most 1 image(s) may be provided in one prompt, got 2" in str(error.value)
        assert error.value.body["param"] == "messages"
        assert len(image_host.paths) == fetched
        reply = client.chat.completions.create(model=MODEL_NAME, max_tokens=1,
                                               messages=[{"role": "user", "content": [url]}])
        assert reply.usage.prompt_tokens > NUM_IMAGE_TOKENS


def test_responses_take_input_image_parts(llava, llava_server, image_host):
    """Guards /v1/responses' input_image parts through the openai client: a data URL's image and
    an http URL's give transformers' greedy tokens (the chat's rendering of the same parts),
    usage counting the expanded image tokens; a file_id, an image in an assistant message and a
    URL that cannot be loaded are 400s naming `input`; truncation "auto" counts a message's
    images as the tokens they expand to, drops the old message they would overflow, and fetches
    none of its images."""
    hf, model_dir = llava
    image = random_image(10, (45, 29))  # IMAGE_FILES["cat.png"]
    text = "USER: What is this? <image>\n\nASSISTANT:"
    ids, expected, gaps = llava_greedy(hf, model_dir, text, [image])
    assert gaps.min() > 1e-3  # no near tie: the spelled tokens must match exactly
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    spelled = Tokenizer.from_pretrained(model_dir).tokens_bytes(expected)
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def respond(*parts: dict, role: str = "user", **kwargs):
        content = [{"type": "input_text", "text": "What is this? "}, *parts]
        return client.responses.create(
            model=MODEL_NAME, input=[{"role": role, "content": content}],
            max_output_tokens=MAX_TOKENS, temperature=0.0, include=["message.output_text.logprobs"],
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kwargs)

    for url in (data_url(image), f"{image_host.url}/cat.png"):
        reply = respond({"type": "input_image", "image_url": url, "detail": "auto"})
        assert reply.usage.input_tokens == len(ids)
        # Responses' logprobs name tokens by their text and bytes: transformers' tokens, spelled.
        assert [bytes(entry.bytes) for entry in reply.output[0].content[0].logprobs] == spelled
        assert reply.output_text == tokenizer.decode(expected, skip_special_tokens=True)

    def refused(*parts: dict, role: str = "user") -> str:
        with pytest.raises(openai.BadRequestError) as error:
            respond(*parts, role=role)
        assert error.value.body["param"] == "input", error.value.body
        return error.value.body["message"]

    assert "no Files API" in refused({"type": "input_image", "file_id": "file-123"})
    assert "content part of type 'input_image'" in refused(
        {"type": "input_image", "image_url": data_url(image)}, role="assistant")
    message = refused({"type": "input_image", "image_url": f"{image_host.url}/missing"})
    assert "input's image 0" in message and "HTTP 404" in message, message

    fetched = len(image_host.paths)
    old = [{"type": "input_image", "image_url": f"{image_host.url}/slow/dog.jpg"}] * 12  # 192 image tokens
    reply = client.responses.create(model=MODEL_NAME, max_output_tokens=100, truncation="auto", input=[
        {"role": "user", "content": [*old, {"type": "input_text", "text": "and these?"}]},
        {"role": "assistant", "content": "Dogs."},
        {"role": "user", "content": "What is this?"}])
    assert reply.status in ("completed", "incomplete")
    assert len(image_host.paths) == fetched
