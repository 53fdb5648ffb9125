"""Image inputs (LLaVA checkpoints): the image encoder and preprocessing against transformers, and
the engine's greedy tokens for prompts with images against transformers' LlavaForConditionalGeneration."""

from __future__ import annotations

import base64
import io
import json
import warnings
from pathlib import Path

import httpx
import numpy as np
import openai
import PIL.Image
import pytest
import torch
import transformers
from serve_fixtures import assert_same_tokens, random_hf
from server_process import API_KEY, MODEL_NAME, ServerProcess

from slipstream import LLM, SamplingParams
from slipstream.model.create import stdlib_tokenizer
from slipstream.model.image_processor import ImageProcessor
from slipstream.model.llava import LlavaConfig, load_image_encoder
from slipstream.model.weights import load_model
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
], ids=["batched", "chunked-eager", "no-prefix-caching", "preempting"])
def test_greedy_tokens_match_transformers(llava, reference, engine_args):
    """Guards placeholder expansion, the preprocessing, the encoder run and its rows placed at the
    placeholders, batched with a text-only prompt: transformers' LLaVA's greedy tokens (fp32),
    with the CPU fast path and module by module, under an 8-token budget that chunks through every
    image (16 tokens), without prefix caching, and with a 9-block KV cache that preempts requests
    in their prefill (whose images are encoded again)."""
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
    placeholders, another modality, an object that is no image, undecodable bytes, a URL that is
    not a data URL (nothing is fetched) are ValueErrors naming them, and nothing stays queued."""
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
        (chat({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}),
         "does not fetch images"),
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
def llava_server(llava, tmp_path_factory):
    _, model_dir = llava
    server = ServerProcess(model_dir, tmp_path_factory.mktemp("llava-server") / "server.log", "--api-key",
                           API_KEY, "--dtype", "float32")
    yield server.wait_ready()
    server.stop()


def test_chat_completions_take_data_url_images(llava, llava_server):
    """Guards /v1/chat/completions' image_url parts through the official openai client on a real
    server: rendered as the template's {"type": "image"} parts (/tokenize's ids), a data URL's image
    reaches the model (transformers' greedy tokens), and an https URL is a 400 naming `messages`."""
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
    assert "does not fetch" in str(error.value) and error.value.body["param"] == "messages"
    message = ChatMessage.model_validate({"role": "user", "content": messages(data_url(image))[0]["content"]})
    with pytest.raises(APIError, match="text-only"):  # a text model's server: a 400 naming messages
        message.template_message()
