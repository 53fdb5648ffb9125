"""Gemma 3's images (Gemma3ForConditionalGeneration): the SigLIP tower and Gemma 3's projector, the
placeholder's expansion, and the engine's greedy tokens for prompts with images, whose tokens attend
to each other both ways, against transformers."""

from __future__ import annotations

import base64
import io
import json
import warnings
from pathlib import Path

import numpy as np
import openai
import PIL.Image
import pytest
import torch
import transformers
from serve_fixtures import assert_same_tokens, random_hf
from server_process import MODEL_NAME, serve_in_process
from test_gemma_model import GEMMA3, SHAPE

from slipstream import LLM, SamplingParams
from slipstream.model.create import stdlib_tokenizer
from slipstream.model.image_processor import ImageProcessor
from slipstream.model.llava import LlavaConfig, load_image_encoder
from slipstream.ops.linear import onednn_multiplies

NEWLINE_RUNS = ["\n\n", "\n\n\n", "\n\n\n\n"]
"""Tokens of the tokenizer below besides the stdlib one's "\n" (Gemma 3's has runs up to 31)."""
BOI, EOI, IMAGE = 323, 324, 325
SPECIAL = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
           "image_token": "<image_soft_token>"}
VOCAB = 336
NUM_IMAGE_TOKENS = 16
"""A 4 x 4 grid pooled from 8 x 8 patches: longer than the text model's 5-token window."""
IMAGE_SIZE = 56
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=IMAGE_SIZE, patch_size=7)
MAX_TOKENS = 8
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
"""Gemma 3's chat template's layout (an image part renders as `<start_of_image>`), shortened."""


def random_gemma3() -> torch.nn.Module:
    """transformers' Gemma 3 image-text model (test_gemma_model's text part), seeded, with its
    projection drawn large enough that images steer the greedy tokens."""
    text = {k: v for k, v in (SHAPE | GEMMA3).items() if k != "attn_implementation"} | {"vocab_size": VOCAB}
    config = transformers.Gemma3Config(text_config=text, vision_config=VISION,
                                       mm_tokens_per_image=NUM_IMAGE_TOKENS, boi_token_index=BOI,
                                       eoi_token_index=EOI, image_token_index=IMAGE)
    config._attn_implementation = "eager"
    hf = random_hf(transformers.Gemma3ForConditionalGeneration, config)
    with torch.no_grad():
        hf.model.multi_modal_projector.mm_input_projection_weight.normal_(std=2.0)
    return hf


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """`random_gemma3()` and its model directory: a stdlib tokenizer with tokens for newline runs,
    Gemma 3's three image tokens (named in tokenizer_config.json, as Gemma3Processor reads them) and
    CHAT_TEMPLATE, and Gemma 3's preprocessing at the tower's size."""
    hf = random_gemma3()
    path = tmp_path_factory.mktemp("gemma3-images")
    hf.save_pretrained(path)
    tokenizer = stdlib_tokenizer(320)
    tokenizer.backend.add_tokens(NEWLINE_RUNS)
    tokenizer.backend.add_special_tokens(list(SPECIAL.values()))
    tokenizer.chat_template = CHAT_TEMPLATE
    assert [tokenizer.token_to_id(token) for token in SPECIAL.values()] == [BOI, EOI, IMAGE]
    tokenizer.save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"extra_special_tokens": SPECIAL}))
    processor = {"image_processor_type": "Gemma3ImageProcessor",
                 "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}}
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return hf, path


def random_image(seed: int, size: tuple[int, int]) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


def engine_prompt(ids: list[int], images: list[tuple[int, tuple[int, int]]]) -> dict:
    """A token-id prompt with its images (random_image's arguments) in multi_modal_data."""
    if not images:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": [random_image(*i) for i in images]}}


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True} | overrides)


def hf_image_processor():
    return transformers.Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def test_image_encoder_matches_transformers(gemma3):
    """Guards the tower used whole with its final norm, the pooling, Gemma's norm and the
    projection, and the weight names transformers saves: Gemma3Model.get_image_features in fp32."""
    hf, model_dir = gemma3
    config = LlavaConfig.from_pretrained(model_dir)
    assert (config.model_type, config.placeholder_token_index, config.bidirectional_images) == (
        "gemma3", BOI, True)
    encoder = load_image_encoder(model_dir, config, SHAPE["hidden_size"], dtype=torch.float32, device="cpu")
    pixels = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.no_grad():
        expected = hf.model.get_image_features(pixels).pooler_output
        got = encoder(pixels)
    assert got.shape == (2, NUM_IMAGE_TOKENS, SHAPE["hidden_size"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("text", [
    "def f():\n<start_of_image>\nreturn 1",
    "x<start_of_image>y",
    "a\n\n<start_of_image>\n\n\nb<start_of_image><start_of_image>",
    "\n\n\n\n\n<start_of_image>\n\n\n\n\n\n\nz",
])
def test_text_prompts_expand_as_gemma3_processor(gemma3, text):
    """Guards the placeholder's expansion and the joining of its blank lines with the newlines
    beside them: the prompt token ids equal those of transformers' Gemma3Processor, which expands
    the text, then tokenizes it (here with tokens for runs of up to four newlines, so that runs
    of up to eleven are written as several)."""
    _, model_dir = gemma3
    processor = gemma3_processor(model_dir)
    images = [random_image(seed, (30, 20)) for seed in range(text.count("<start_of_image>"))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = processor(text=text, images=images)["input_ids"][0]
    llm = LLM(str(model_dir), dtype="float32")
    output = llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                          SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert output.prompt_token_ids == list(expected)


def gemma3_processor(model_dir: Path):
    return transformers.Gemma3Processor(
        image_processor=hf_image_processor(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir), image_seq_length=NUM_IMAGE_TOKENS)


def data_url(image: PIL.Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_and_the_server_take_images(gemma3):
    """Guards the chat path: an image part renders as `<start_of_image>` through the template, and
    LLM.chat and /v1/chat/completions (the official openai client on a real server, a data URL)
    give transformers' prompt ids (Gemma3Processor on the rendered text) and greedy tokens; Gemma
    3's image token typed in a message is a 400."""
    hf, model_dir = gemma3
    image = random_image(5, (36, 48))
    parts = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": data_url(image)}}]
    text = "<start_of_turn>user\nWhat is this?<start_of_image><end_of_turn>\n<start_of_turn>model\n"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = gemma3_processor(model_dir)(text=text, images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    expected = out.sequences[0, len(ids):].tolist()
    top2 = torch.stack(out.scores, 1).float().topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1])
    params = greedy()
    [output] = LLM(str(model_dir), dtype="float32").chat([{"role": "user", "content": parts}], params,
                                                         use_tqdm=False)
    assert output.prompt == text and output.prompt_token_ids == ids
    assert_same_tokens([expected], gaps, [list(output.outputs[0].token_ids)], "chat")
    with serve_in_process(model_dir, "--dtype", "float32") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": parts}], max_tokens=MAX_TOKENS,
            temperature=0.0, logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        with pytest.raises(openai.BadRequestError, match=f"image token \\(id {IMAGE}\\) itself"):
            client.chat.completions.create(model=MODEL_NAME, max_tokens=1, messages=[
                {"role": "user", "content": [*parts, {"type": "text", "text": "<image_soft_token>"}]}])
    assert reply.usage.prompt_tokens == len(ids)
    got = [int(entry.token.removeprefix("token_id:")) for entry in reply.choices[0].logprobs.content]
    assert_same_tokens([expected], gaps, [got], "server")


def hf_inputs(ids: list[int], blank: list[int]) -> list[int]:
    """The prompt as transformers' Gemma3Processor expands it (its text's placeholders replaced by
    "\\n\\n", begin, the image tokens, end, "\\n\\n"; no newline beside one in these prompts)."""
    out = []
    for token_id in ids:
        out += [*blank, BOI, *[IMAGE] * NUM_IMAGE_TOKENS, EOI, *blank] if token_id == BOI else [token_id]
    return out


@torch.no_grad()
def hf_greedy(hf, ids: list[int], images: list[PIL.Image.Image]
              ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy tokens, the top-1/top-2 logit gaps and the first token's log-probabilities."""
    kwargs = {}
    if images:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            processor = hf_image_processor()
            kwargs["pixel_values"] = processor(images, return_tensors="pt")["pixel_values"]
    input_ids = torch.tensor([ids])
    out = hf.generate(input_ids, token_type_ids=(input_ids == IMAGE).long(), max_new_tokens=MAX_TOKENS,
                      do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                      return_dict_in_generate=True, **kwargs)
    top2 = torch.stack(out.scores, 1).float().topk(2, dim=-1).values
    return (out.sequences[0, len(ids):].tolist(), (top2[..., 0] - top2[..., 1])[0],
            torch.log_softmax(out.scores[0][0].double(), -1))


PROMPTS = [
    ([5, 6, 7, BOI, 40], [(0, (40, 31))]),
    ([5, 6, BOI, 41, BOI, 43], [(1, (20, 60)), (2, (56, 56))]),
    ([5, 6, 7, 8, 9, 10, 11], []),
    ([5, 6, 7, BOI, 40], [(3, (33, 33))]),
    ([50, BOI, 60], [(0, (40, 31))]),
]
"""One image, two, none, the first text with another image, and a short prompt with the first image."""


@pytest.fixture(scope="module")
def reference(gemma3):
    hf, model_dir = gemma3
    blank = transformers.AutoTokenizer.from_pretrained(model_dir).encode("\n\n", add_special_tokens=False)
    results = [hf_greedy(hf, hf_inputs(ids, blank), [random_image(*image) for image in images])
               for ids, images in PROMPTS]
    tokens, gaps, first = zip(*results, strict=True)
    assert tokens[0] != tokens[3], "the two images of the same text should give different tokens"
    return [hf_inputs(ids, blank) for ids, _ in PROMPTS], list(tokens), torch.stack(gaps), first


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 20, "fast_cpu_kernels": False},
    {"max_num_batched_tokens": 20, "enable_prefix_caching": False},
    {"max_model_len": 64, "kv_cache_memory": 10 * 6144, "max_num_batched_tokens": 24},
    {"tensor_parallel_size": 2, "max_num_batched_tokens": 20},
], ids=["batched", "chunked-eager", "chunked-no-prefix-caching", "preempting", "tensor-parallel-chunked"])
def test_greedy_tokens_match_transformers(gemma3, reference, engine_args):
    """Guards the expansion, the preprocessing, the encoder's rows at the image tokens and their
    attention both ways (within the window on the sliding layers): transformers' greedy tokens
    (fp32) for prompts with images, batched with a text-only one, with the CPU fast path and
    module by module, under a 20-token budget that must roll chunks back to before each 16-token
    image (transformers computes an image whole), with and without prefix caching, with a KV
    cache small enough to preempt requests, and over two tensor-parallel ranks (the images' spans
    travel to the worker in each step's batch)."""
    hf, model_dir = gemma3
    expected_ids, expected, gaps, _ = reference
    llm = LLM(str(model_dir), dtype="float32", **engine_args)
    prompts = [engine_prompt(ids, images) for ids, images in PROMPTS]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == expected_ids
    print(f"preemptions: {llm.engine.scheduler.num_preemptions}")
    if "kv_cache_memory" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_same_tokens(expected, gaps, [list(o.outputs[0].token_ids) for o in outputs], str(engine_args))


@pytest.mark.parametrize("both_ways", [True, False], ids=["bidirectional", "causal"])
def test_first_token_logprob_matches_transformers_only_both_ways(gemma3, reference, monkeypatch, both_ways):
    """The first token's log-probability equals transformers' (fp32) with the images' tokens
    attending both ways, and leaves it by far more with them attending causally, as LLaVA's do:
    the greedy tokens above alone could miss the mask (these random models' choices rarely turn
    on it)."""
    _, model_dir = gemma3
    _, expected, _, first = reference
    llm = LLM(str(model_dir), dtype="float32")
    monkeypatch.setattr(llm.engine.runner.image_embedder, "bidirectional", both_ways)
    prompts = [engine_prompt(ids, images) for ids, images in PROMPTS]
    outputs = llm.generate(prompts, greedy(max_tokens=1, logprobs=0), use_tqdm=False)
    diffs = []
    for output, reference_logprobs, (_, images) in zip(outputs, first, PROMPTS, strict=True):
        token_id = output.outputs[0].token_ids[0]
        got = output.outputs[0].logprobs[0][token_id].logprob
        if images:
            diffs.append(abs(got - reference_logprobs[token_id].item()))
    print(f"both ways: {both_ways}, |logprob difference| per prompt with images: {diffs}")
    if both_ways:
        assert max(diffs) < 1e-4
    else:
        assert max(diffs) > 1e-3


def test_a_budget_under_one_image_is_raised_to_it(gemma3, reference):
    """A step budget under one image's tokens is raised to them, as vLLM raises it for its
    prefix-LM models (an image is computed in one step), and the tokens stay transformers'."""
    _, model_dir = gemma3
    expected_ids, expected, gaps, _ = reference
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=NUM_IMAGE_TOKENS - 5)
    assert llm.engine.config.max_num_batched_tokens == NUM_IMAGE_TOKENS
    prompts = [engine_prompt(ids, images) for ids, images in PROMPTS]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert_same_tokens(expected, gaps, [list(o.outputs[0].token_ids) for o in outputs], "raised budget")


def test_a_prefix_hit_inside_an_image_computes_the_rest_of_it(gemma3, reference):
    """With 16-token blocks the first prompt's cached prefix ends inside its image: the same prompt
    again starts there, computing the image's last tokens (which see its cached first ones, and
    they, computed whole before, saw these) and gives transformers' tokens and first log-probability."""
    _, model_dir = gemma3
    expected_ids, expected, _, first = reference
    llm = LLM(str(model_dir), dtype="float32", block_size=16)
    ids, images = PROMPTS[0]
    image_start = expected_ids[0].index(IMAGE)
    prompt, params = engine_prompt(ids, images), greedy(logprobs=0)
    for _ in range(2):  # the second finds the first's blocks cached
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        token_id = output.outputs[0].token_ids[0]
        assert list(output.outputs[0].token_ids) == expected[0]
        assert abs(output.outputs[0].logprobs[0][token_id].logprob - first[0][token_id].item()) < 1e-4
    assert image_start < output.num_cached_tokens < image_start + NUM_IMAGE_TOKENS


def test_image_tokens_in_the_prompt_itself_are_refused(gemma3):
    """A prompt holding Gemma 3's image token itself (an already expanded prompt, or
    `<image_soft_token>` typed as text) stands for no image: a ValueError naming the token, in
    token ids and in text; so is a placeholder without its image."""
    _, model_dir = gemma3
    llm = LLM(str(model_dir), dtype="float32")
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match=f"image token \\(id {IMAGE}\\) itself"):
        llm.generate({"prompt_token_ids": [5, IMAGE, 6]}, params, use_tqdm=False)
    with pytest.raises(ValueError, match=f"image token \\(id {IMAGE}\\) itself"):
        llm.generate({"prompt": "a<start_of_image>b<image_soft_token>",
                      "multi_modal_data": {"image": random_image(0, (9, 9))}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="1 image placeholder.*0 image"):
        llm.generate("a<start_of_image>b", params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.skipif(onednn_multiplies(torch.bfloat16),
                    reason="oneDNN multiplies bf16 here: the tower runs in bf16")
def test_a_bf16_engine_encodes_in_fp32_where_the_cpu_multiplies_bf16_slowly(gemma3):
    """On a CPU where oneDNN does not multiply bf16, a bf16 engine's encoder computes in fp32 (faster
    there and nearer the exact result: benchmarks/image_encoder.py) and its embeddings are
    transformers' fp32 image features rounded to bf16."""
    hf, model_dir = gemma3
    llm = LLM(str(model_dir), dtype="bfloat16")
    embedder = llm.engine.runner.image_embedder
    assert {p.dtype for p in embedder.encoder.parameters()} == {torch.float32}
    assert embedder.dtype == torch.bfloat16  # the rows the runner takes
    image = random_image(4, (30, 30))
    encoded = []
    embedder.encoder.register_forward_hook(lambda module, args, out: encoded.append(out))
    llm.generate({"prompt_token_ids": [5, BOI, 6], "multi_modal_data": {"image": image}},
                 SamplingParams(max_tokens=1), use_tqdm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pixels = hf_image_processor()(
            [image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = hf.model.get_image_features(pixels).pooler_output
    torch.testing.assert_close(encoded[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_preprocessing_matches_gemma3_image_processor(mode):
    """Guards Gemma 3's preprocessing defaults: its preprocessor_config.json as transformers saves it
    (unset keys null, pan-and-scan off) and one naming only the type and size are a bilinear
    resize to the tower's size, mean and std 0.5: the pixels of transformers' Gemma3ImageProcessor
    (its Pillow backend), for images of every mode; pan-and-scan on is refused, naming the key."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image = random_image(7, (300, 170)).convert(mode)
    reference = Gemma3ImageProcessorPil(size={"height": 96, "width": 96})
    expected = reference(image, return_tensors="np")["pixel_values"][0]
    saved = reference.to_dict() | {"image_processor_type": "Gemma3ImageProcessor"}
    named = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 96, "width": 96}}
    for config in (saved, named):
        got = ImageProcessor.from_dict(json.loads(json.dumps(config)))(image)
        assert got.shape == expected.shape == (3, 96, 96)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        ImageProcessor.from_dict(saved | {"do_pan_and_scan": True})
