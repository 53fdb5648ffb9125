"""Serving a model whose tokenizer is SentencePiece-style (Llama 2's and Mistral's layout: "▁" for
spaces, byte-fallback pieces for characters outside the vocabulary, a decoder that drops the
first token's leading space), where text and logprob tokens are easiest to get wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers

from slipstream import LLM, SamplingParams

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PIECES = ["<unk>", "<s>", "</s>", "▁", "▁the", "▁end", "▁def", "a", "b", "the", ",", "(", ")",
          *(f"<0x{b:02X}>" for b in range(256))]


@pytest.fixture(scope="module")
def llm(model_dir, tmp_path_factory) -> LLM:
    """The serving tests' random model with a SentencePiece-style tokenizer of a few hundred pieces
    (its ids are a prefix of the model's vocabulary)."""
    out = Path(tmp_path_factory.mktemp("sentencepiece"))
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, out / name)
    vocab = {piece: i for i, piece in enumerate(PIECES)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.normalizer = tokenizers.normalizers.Sequence([tokenizers.normalizers.Prepend("▁"),
                                                         tokenizers.normalizers.Replace(" ", "▁")])
    backend.decoder = tokenizers.decoders.Sequence([
        tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse(),
        tokenizers.decoders.Strip(" ", 1, 0)])
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>"}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return LLM(str(out), max_model_len=256, kv_cache_memory=2**24, dtype="float32")


def test_logprob_tokens_keep_their_spaces_and_join_to_the_text(llm):
    """Each logprob's decoded_token is the text the token adds inside a text, so "▁the" is " the"
    (decoded alone, the decoder drops its space): the chosen tokens' decoded tokens join to the
    output text, and the prompt's to the prompt's text, as vLLM's restored leading spaces."""
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                            allowed_token_ids=list(range(3, len(PIECES) - 256)))
    [output] = llm.generate("a the end, def", params, use_tqdm=False)
    completion = output.outputs[0]
    assert any(tokenizer.id_to_token(t).startswith("▁") for t in completion.token_ids)
    chosen = zip(completion.logprobs, completion.token_ids, strict=True)
    assert "".join(position[token].decoded_token for position, token in chosen) == completion.text
    prompt = zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:], strict=True)
    # the first token is "▁", which no position predicts
    assert "".join(position[token].decoded_token for position, token in prompt) == "a the end, def"


@pytest.mark.parametrize("prompt", ["a 😀😀", "the 日本語", "é"])
def test_text_after_a_prompt_of_byte_tokens_has_no_stray_replacement_characters(llm, prompt):
    """A prompt whose last characters are byte-fallback tokens: the generated text is exactly what
    the generated ids add to the prompt's text (it began with U+FFFDs of the prompt's bytes)."""
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            allowed_token_ids=list(range(3, len(PIECES) - 256)))
    [output] = llm.generate(prompt, params, use_tqdm=False)
    completion = output.outputs[0]
    full = tokenizer.decode(output.prompt_token_ids + completion.token_ids)
    assert "\ufffd" not in completion.text
    assert prompt + completion.text == full
