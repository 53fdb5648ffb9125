"""Shared pieces of the serving tests: a small random model directory and a dense reference.

The model is a 2-layer Llama shape (2.4M parameters) with the tiny preset's tokenizer (vocabulary
8192, ChatML template, end-of-sequence ids 0 `<|endoftext|>` and 2 `<|im_end|>`), so an engine over
it starts in well under a second and a step costs milliseconds on a CPU.

The test modules load this file as a plugin (`pytest_plugins`), so that its session fixtures are built
once for all of them, and also import its constants and helpers; it holds no asserts, so it opts out
of assertion rewriting (PYTEST_DONT_REWRITE), which pytest cannot apply to a module already imported.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from slipstream import LLM, SamplingParams
from slipstream.model.config import ModelConfig
from slipstream.model.create import stdlib_tokenizer
from slipstream.model.transformer import Transformer
from slipstream.model.weights import load_model, save_model

VOCAB_SIZE = 8192
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITIONS = 512
EOS_TRIGGER_ID = 4321
"""After this token the model's greedy choice is `<|im_end|>` (id 2), by a margin of about 1 logit: its
output row copies this token's embedding, so the two align whenever this token is the last one."""


def build_model_dir(out_dir: Path, *, seed: int = 0) -> Path:
    """Write a small random model with the tiny preset's tokenizer (the cached one that
    `create_model_dir("tiny", ...)` uses, without writing that 16M-parameter model) to `out_dir`."""
    tokenizer = stdlib_tokenizer(VOCAB_SIZE)
    config = ModelConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Transformer(config)
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # so that end-of-sequence can be provoked: see EOS_TRIGGER_ID
        model.lm_head.weight[2] = model.model.embed_tokens.weight[EOS_TRIGGER_ID]
    save_model(model, out_dir, dtype="float32")
    tokenizer.save_pretrained(out_dir)
    generation = {"eos_token_id": list(tokenizer.eos_token_ids), "pad_token_id": tokenizer.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation) + "\n")
    return out_dir


def known_calibration(peak_flops: float, peak_read: float):
    """A CPU calibration with the given fp32 peak and read bandwidth, for tests that must not depend
    on (or wait minutes for) this machine's own."""
    from slipstream.perf import hardware

    return hardware.Calibration(
        device="cpu", device_name="test cpu", torch_version="x", num_threads=1,
        matmul_flops_per_s={"fp32": {"onednn": peak_flops}}, matmul_errors={},
        memory_read_bytes_per_s=peak_read, memory_copy_bytes_per_s=peak_read, cache_read_bytes_per_s={},
        quick=False, elapsed_s=1.0, created_at="2026-12-06T00:00:00")


def kv_bytes_for_blocks(num_blocks: int, block_size: int) -> int:
    """`kv_cache_memory` that gives the engine exactly `num_blocks` fp32 blocks of this model."""
    return num_blocks * block_size * 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The small model directory, built once per test session."""
    return build_model_dir(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="session")
def dense_model(model_dir) -> Transformer:
    """The same weights loaded for a plain dense forward (the reference for logprobs)."""
    return load_model(model_dir)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's tests with one intra-op thread, restoring the setting afterwards. The ops of
    this model take microseconds, so a second thread gains nothing, and on a loaded machine every
    parallel region waits for a descheduled thread: with one busy neighbour process, the serving
    tests took 26 s with two threads and 5 s with one."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)



def random_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> Transformer:
    """A random model with non-trivial norms and biases (ones and zeros would hide a missing one)."""
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights(std=0.1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model.to(dtype).eval()

@torch.no_grad()
def random_hf(
    model_class, config, *, offset: float = 0.3, names: tuple[str, ...] = ("norm",)
) -> torch.nn.Module:
    """transformers' `model_class` of `config`, seeded, in eval mode, with the parameters whose
    names hold one of `names` moved by `offset` times a normal draw (norm weights off 1 and biases
    off 0, which would hide a missing one)."""
    torch.manual_seed(0)
    hf = model_class(config).eval()
    for name, param in hf.named_parameters():
        if any(part in name for part in names):
            param.add_(offset * torch.randn_like(param))
    return hf


def save_with_tokenizer(hf, path: Path, vocab_size: int = 320) -> Path:
    """A model directory: `hf`'s config and weights and a stdlib tokenizer of `vocab_size`."""
    hf.save_pretrained(path)
    stdlib_tokenizer(vocab_size).save_pretrained(path)
    return path


def engine_greedy(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, **engine_args
) -> list[list[int]]:
    """The engine's greedy tokens (fp32, ignoring end of sequence) for token-id prompts."""
    llm = LLM(str(model_dir), **{"dtype": "float32"} | engine_args)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@torch.no_grad()
def positioned_logits(model: Transformer, token_ids: torch.Tensor) -> torch.Tensor:
    """Our model's logits (B, T, V) for token ids (B, T) at positions 0 .. T - 1."""
    return model(token_ids, torch.arange(token_ids.shape[1]).expand_as(token_ids))


def assert_logits_match(model: Transformer, hf, token_ids: torch.Tensor) -> None:
    """Our model's fp32 logits for token ids (B, T) equal transformers' model's within rtol 1e-5
    and atol 2e-5 (the sums' order differs)."""
    with torch.no_grad():
        expected = hf(token_ids).logits
    torch.testing.assert_close(positioned_logits(model, token_ids), expected, rtol=1e-5, atol=2e-5)


def assert_bf16_logits_equal_transformers(model_dir: Path, token_ids: torch.Tensor) -> None:
    """Our model loaded in bf16 gives transformers' logits bit for bit, transformers' model loaded
    in bf16 with SDPA attention."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                           attn_implementation="sdpa").eval()
    with torch.no_grad():
        expected = hf(token_ids).logits
    got = positioned_logits(load_model(model_dir, dtype=torch.bfloat16), token_ids)
    if not torch.equal(got, expected):
        raise AssertionError(f"bf16 logits differ from transformers' by up to "
                             f"{(got.float() - expected.float()).abs().max().item()}")


@torch.no_grad()
def dense_logprobs(model: Transformer, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits over `token_ids` in one dense causal forward: (T, V)."""
    ids = torch.tensor([token_ids])  # (1, T)
    logits = model(ids, torch.arange(len(token_ids))[None])[0]  # (T, V)
    return logits.float().log_softmax(-1)


@torch.no_grad()
def transformers_greedy(
    hf, prompts: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' batched greedy `generate` (prompts left-padded with id 0, no end of sequence):
    each prompt's new tokens, and the top-1/top-2 logit gap at every generated position (B, T)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.eval().generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    top2 = torch.stack(out.scores, 1).float().topk(2, dim=-1).values  # (B, T, 2)
    return out.sequences[:, width:].tolist(), top2[..., 0] - top2[..., 1]


def assert_same_tokens(expected, gaps, got, label: str) -> None:
    """Fail naming the first prompt and token where `got` leaves `expected`, with the reference's
    top-2 logit gap there (a near tie is rounding, a wide gap a bug)."""
    print(f"{label}: smallest top-2 logit gap in the reference = {gaps.min().item():.3g}")
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        if e != g:
            at = next(t for t, (a, b) in enumerate(zip(e, g, strict=True)) if a != b)
            pytest.fail(f"{label}: prompt {i} diverges at token {at} ({e[at]} vs {g[at]}); "
                        f"reference top-2 gap there {gaps[i, at].item():.3g}")


@torch.no_grad()
def uncached_greedy(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, each from a full uncached forward over the
    sequence so far (transformers' cached `generate` is itself wrong for a sliding window of 1)."""
    expected = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(max_new_tokens):
            seq.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        expected.append(seq[len(prompt):])
    return expected
