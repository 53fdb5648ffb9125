"""Gemma 3's images (Gemma3ForConditionalGeneration): the SigLIP tower and Gemma 3's projector, the
placeholder's expansion, and the engine's greedy tokens for prompts with images, whose tokens attend
to each other both ways, against transformers."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
import transformers
from serve_fixtures import assert_same_tokens, random_hf
from test_gemma_model import GEMMA3, SHAPE

from slipstream import LLM, SamplingParams
from slipstream.model.create import stdlib_tokenizer
from slipstream.model.llava import LlavaConfig, load_image_encoder
from slipstream.serve.multimodal import ImagePrompts, ImageWrap

BOI, EOI, IMAGE = 330, 331, 332
VOCAB = 336
NUM_IMAGE_TOKENS = 16
"""A 4 x 4 grid pooled from 8 x 8 patches: longer than the text model's 5-token window."""
IMAGE_SIZE = 56
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=IMAGE_SIZE, patch_size=7)
MAX_TOKENS = 8


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
    hf = random_gemma3()
    path = tmp_path_factory.mktemp("gemma3-images")
    hf.save_pretrained(path)
    stdlib_tokenizer(320).save_pretrained(path)
    processor = {"image_processor_type": "Gemma3ImageProcessor",
                 "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}}
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return hf, path


def random_image(seed: int, size: tuple[int, int]) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


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


def test_placeholders_join_newlines_as_the_tokenizer_would():
    """Gemma 3's expansion, "\\n\\n<start_of_image>", the image tokens, "<end_of_image>\\n\\n", joins
    its blank lines with newline tokens beside them into one token where the vocabulary has one
    for the run, as tokenizing the expanded text does (vLLM's Gemma 3 processor joins the runs of
    "\\n" + "\\n\\n", "\\n\\n" + "\\n" and "\\n\\n" + "\\n\\n" so)."""
    newlines = {"\n": 1, "\n\n": 2, "\n\n\n": 3, "\n\n\n\n": 4}  # id = the run's length
    wrap = ImageWrap.gemma3(LlavaConfig.from_hf_dict({"model_type": "gemma3", "boi_token_index": BOI,
                                                      "eoi_token_index": EOI, "image_token_index": IMAGE}),
                            lambda text: [newlines[text]] if text in newlines else [9, 9])
    prompts = ImagePrompts(None, BOI, 3, IMAGE_SIZE, wrap)
    image = [BOI, IMAGE, IMAGE, IMAGE, EOI]
    assert prompts.expand_ids([7, BOI, 8]) == ([7, 2, *image, 2, 8], [3])
    assert prompts.expand_ids([7, 1, BOI, 1, 8]) == ([7, 3, *image, 3, 8], [3])
    assert prompts.expand_ids([2, BOI, BOI]) == ([4, *image, 4, *image, 2], [2, 8])
    assert prompts.expand_ids([3, BOI, 3]) == ([3, 2, *image, 2, 3], [3])  # no token for 5 newlines


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
            processor = transformers.Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
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
    blank = stdlib_tokenizer(320).encode("\n\n", add_special_tokens=False)
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
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": [random_image(*i) for i in images]}}
               if images else {"prompt_token_ids": ids} for ids, images in PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
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
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": [random_image(*i) for i in images]}}
               if images else {"prompt_token_ids": ids} for ids, images in PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                                   logprobs=0), use_tqdm=False)
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


def test_a_budget_under_one_image_is_refused(gemma3):
    _, model_dir = gemma3
    with pytest.raises(ValueError, match="max_num_batched_tokens .* one image"):
        LLM(str(model_dir), dtype="float32", max_num_batched_tokens=NUM_IMAGE_TOKENS - 1)
