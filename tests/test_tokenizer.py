"""Tokenizer: transformers parity (encode, decode, chat template), streaming decode, training."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jinja2
import pytest
import tokenizers
import tokenizers.processors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from train_fixtures import qwen2_style_tokenizer

from slipstream.corpus import stdlib_files
from slipstream.model.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    pipeline_differences,
    rebuilt_pipeline,
    train_tokenizer,
)

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 2048

TEXTS = [
    "def main(argv):\n    for i in range(10):\n        print(i)  # loop\n\n\n",
    "class Foo(Bar):\n\t\"\"\"Docstring.\"\"\"\n\tx: int = 0x1F\n",
    "héllo wörld, naïve café — ünïcödé",
    "emoji 😀🚀 family 👨\u200d👩\u200d👧 flags 🇯🇵",
    "中文字符和日本語のテキスト、한국어",
    "   leading, trailing   \t\t\r\n   \n\n\n        ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "x<|endoftext|>y<|im_start|>",
    "12345678901234567890 3.14159 1e-10",
    "",
    " ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 中文 😀?\n\n  spaces  "},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "<|im_end|> inside"}],
]

LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Year: " + strftime_now("%Y") + "\\n" }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{% if date_string is defined %}
    Today: {{ date_string }}
{% endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{% for message in messages %}
    {% if message['role'] == 'note' %}
        {% continue %}
    {% endif %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
    {% if loop.index >= 4 %}
        {% break %}
    {% endif %}
{% endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter für eine Stadt <b>now</b>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    # Every 40th stdlib file (~0.6 MB) trains in well under a second.
    return train_tokenizer(stdlib_files()[::40], VOCAB_SIZE, model_max_length=4096)


@pytest.fixture(scope="session")
def saved_dir(tokenizer, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chatml_tokenizer")
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_tokenizer(saved_dir):
    return transformers.AutoTokenizer.from_pretrained(saved_dir)


@pytest.fixture(scope="session")
def llama3_dir(saved_dir, tmp_path_factory) -> Path:
    """A model dir with Llama-3-style special tokens and template, written by hand as HF would."""
    path = tmp_path_factory.mktemp("llama3_style")
    backend = tokenizers.Tokenizer.from_file(str(saved_dir / "tokenizer.json"))
    backend.add_special_tokens(LLAMA3_TOKENS)
    backend.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "special": True},
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_STYLE_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def qwen2_style_dir(tmp_path_factory) -> Path:
    """A tokenizer with the pipeline of Qwen2's own files, saved as a Qwen2 model dir names it."""
    path = tmp_path_factory.mktemp("qwen2_style")
    qwen2_style_tokenizer(stdlib_files()[::40], VOCAB_SIZE).save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    return path


@pytest.mark.parametrize("model_type", ["llama", "mistral", "phi3", "qwen2", "qwen3"])
@pytest.mark.parametrize("source", ["chatml", "chatml_named_qwen2", "chatml_unnamed", "qwen2_style"])
def test_model_directories_of_each_family_encode_as_auto_tokenizer(model_type, source, saved_dir,
                                                                   qwen2_style_dir, tmp_path):
    """The reference is AutoTokenizer on the same directory: for a qwen2 model, transformers 5
    builds Qwen2Tokenizer's own pipeline (NFC, Qwen2's split) whatever tokenizer_config.json names,
    and so it does for a tokenizer_config.json that names Qwen2Tokenizer (any model type but
    mistral and phi3, whose registered tokenizers read the file as it is) and for a qwen3 model whose
    tokenizer_config.json names no class; the byte-level BPE trained here (GPT-2's split) gets
    other ids there than read as it is, and slipstream does the same (it read the file as it
    is). A Qwen2-style file reads the same either way, so `pipeline_differences` finds nothing to
    report for it."""
    path = tmp_path / "model"
    shutil.copytree(qwen2_style_dir if source == "qwen2_style" else saved_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    if source == "chatml_named_qwen2":
        config["tokenizer_class"] = "Qwen2TokenizerFast"
    elif source == "chatml_unnamed":
        del config["tokenizer_class"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    ours, hf = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    texts = [*TEXTS, "cafe\u0301 ﬁ Ⅻ ½ ｆｕｌｌ", "don't I'LL 2024-06-01 x=12345;\r\n\r\n  y"]
    for text in texts:
        assert ours.encode(text) == hf(text)["input_ids"], (model_type, text)
        assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"])
    as_is = Tokenizer.from_pretrained(qwen2_style_dir if source == "qwen2_style" else saved_dir)
    differences = pipeline_differences(as_is, ours)
    generic = model_type in ("mistral", "phi3")
    rebuilt = (model_type == "qwen2" or (source == "chatml_named_qwen2" and not generic)
               or (source == "chatml_unnamed" and model_type == "qwen3"))
    assert differences == (["normalizer", "pre_tokenizer"] if rebuilt and source != "qwen2_style" else [])
    if differences:
        assert any(as_is.encode(text) != ours.encode(text) for text in texts)


def test_encode_matches_transformers(tokenizer, hf_tokenizer):
    """Our ids equal AutoTokenizer's on code, unicode, emoji, CJK, whitespace and special tokens."""
    for text in TEXTS:
        for add_special_tokens in (True, False):
            expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
            assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, text
    assert tokenizer.encode_batch(TEXTS) == [hf_tokenizer.encode(text) for text in TEXTS]


def test_decode_matches_transformers(tokenizer, hf_tokenizer):
    """decode equals AutoTokenizer.decode with and without skipping special tokens, and keeps them
    by default as transformers does (vLLM scripts decode with llm.get_tokenizer())."""
    for text in [*TEXTS, "spaces before punctuation , which clean-up would strip . It is n't"]:
        ids = hf_tokenizer.encode(text)
        skipped = hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids, skip_special_tokens=True) == skipped
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids)
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
        assert tokenizer.decode(ids) == text
        for clean_up in (True, False):  # transformers 5 applies no clean-up to a BPE tokenizer
            assert tokenizer.decode(ids, clean_up_tokenization_spaces=clean_up) \
                == hf_tokenizer.decode(ids, clean_up_tokenization_spaces=clean_up)
            assert tokenizer.batch_decode([ids], clean_up_tokenization_spaces=clean_up) \
                == hf_tokenizer.batch_decode([ids], clean_up_tokenization_spaces=clean_up)
    assert tokenizer.decode(2) == hf_tokenizer.decode(2) == "<|im_end|>"  # one id, as an int


def test_transformers_calls_of_vllm_scripts_match(tokenizer, hf_tokenizer, llama3_dir):
    """What vLLM scripts call on llm.get_tokenizer() (a transformers tokenizer there) gives
    AutoTokenizer's results: tokenizer(text) and tokenizer(texts), batch_decode, the token/id
    conversions, len, the vocabularies, the special tokens and their ids, and a chat prompt as text;
    on the ChatML tokenizer and on the Llama-3-style one (a BOS token, tokens added to the vocab)."""
    pairs = [(tokenizer, hf_tokenizer),
             (Tokenizer.from_pretrained(llama3_dir), transformers.AutoTokenizer.from_pretrained(llama3_dir))]
    for ours, hf in pairs:
        for add_special_tokens in (True, False):
            for text in TEXTS:
                expected = hf(text, add_special_tokens=add_special_tokens)
                assert ours(text, add_special_tokens=add_special_tokens) == dict(expected), text
            assert ours(TEXTS, add_special_tokens=add_special_tokens) == dict(
                hf(TEXTS, add_special_tokens=add_special_tokens))
        assert ours(TEXTS[0]).input_ids == hf(TEXTS[0]).input_ids
        batch = hf(TEXTS).input_ids
        for skip in (False, True):
            assert ours.batch_decode(batch, skip_special_tokens=skip) == hf.batch_decode(
                batch, skip_special_tokens=skip)
        assert ours.batch_decode(batch) == hf.batch_decode(batch)
        ids = [*hf.encode(TEXTS[2] + TEXTS[6]), len(hf) - 1, len(hf)]  # the last is out of range
        tokens = hf.convert_ids_to_tokens(ids)
        assert ours.convert_ids_to_tokens(ids) == tokens and tokens[-1] is None
        assert ours.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])
        assert ours.convert_tokens_to_ids(tokens[:-1] + ["not a token"]) == hf.convert_tokens_to_ids(
            tokens[:-1] + ["not a token"])
        assert ours.convert_tokens_to_ids(tokens[0]) == hf.convert_tokens_to_ids(tokens[0])
        assert ours.convert_tokens_to_string(tokens[:-1]) == hf.convert_tokens_to_string(tokens[:-1])
        assert len(ours) == len(hf) and ours.vocab_size == hf.vocab_size
        assert ours.get_vocab() == hf.get_vocab() and ours.get_added_vocab() == hf.get_added_vocab()
        for name in ("bos", "eos", "pad", "unk"):
            assert getattr(ours, f"{name}_token") == getattr(hf, f"{name}_token"), name
            assert getattr(ours, f"{name}_token_id") == getattr(hf, f"{name}_token_id"), name
        conversation = CONVERSATIONS[1][:2]
        expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == expected



@pytest.fixture(scope="session")
def bos_eos_dir(saved_dir, tmp_path_factory) -> Path:
    """A model dir whose tokenizer.json adds a BOS and an EOS to every text (a post-processor), so
    that truncation has special tokens to keep."""
    path = tmp_path_factory.mktemp("bos_eos")
    backend = tokenizers.Tokenizer.from_file(str(saved_dir / "tokenizer.json"))
    backend.add_special_tokens(["<s>"])
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A <|endoftext|>",
        special_tokens=[("<s>", backend.token_to_id("<s>")),
                        ("<|endoftext|>", backend.token_to_id("<|endoftext|>"))])
    backend.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "<|endoftext|>", "pad_token": "<|im_end|>", "model_max_length": 12}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_and_truncation_match_transformers(saved_dir, llama3_dir, bos_eos_dir, side, tmp_path):
    """tokenizer(texts, padding=..., truncation=..., max_length=...) equals AutoTokenizer's on
    either side, with and without special tokens (which truncation keeps), for one text and a
    batch, and the sides are read from tokenizer_config.json as transformers reads them."""
    calls = [
        {"truncation": True, "max_length": 5}, {"truncation": "longest_first", "max_length": 2},
        {"max_length": 7}, {"truncation": True}, {"truncation": False, "max_length": 3},
        {"padding": True}, {"padding": "longest", "pad_to_multiple_of": 8},
        {"padding": "max_length", "max_length": 40}, {"padding": "max_length", "max_length": 6},
        {"padding": True, "truncation": True, "max_length": 6},
        {"padding": "max_length", "truncation": True, "max_length": 9},
        {"padding": True, "padding_side": "left" if side == "right" else "right"},
    ]
    for source in (saved_dir, llama3_dir, bos_eos_dir):
        model_dir = tmp_path / source.name
        shutil.copytree(source, model_dir)
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        config.update(padding_side=side, truncation_side=side,
                      pad_token=config.get("pad_token") or "<|im_end|>")
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
        ours, hf = Tokenizer.from_pretrained(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
        assert (ours.padding_side, ours.truncation_side) == (side, side)
        assert (hf.padding_side, hf.truncation_side) == (side, side)
        for kwargs in calls:
            for add_special_tokens in (True, False):
                args = {"add_special_tokens": add_special_tokens, **kwargs}
                assert ours(TEXTS[:9], **args) == dict(hf(TEXTS[:9], **args)), (source.name, args)
                assert ours(TEXTS[0], **args) == dict(hf(TEXTS[0], **args)), (source.name, args)
                if "padding" not in kwargs and "padding_side" not in kwargs:
                    assert ours.encode(TEXTS[1], **args) == hf.encode(TEXTS[1], **args), (source.name, args)
    truncated = Tokenizer.from_pretrained(model_dir).encode(TEXTS[0], truncation=True, max_length=4)
    assert len(truncated) == 4 and truncated[0] == ours.bos_token_id and truncated[-1] == ours.eos_token_id


def test_bad_padding_and_truncation_arguments_are_value_errors(bos_eos_dir):
    tokenizer = Tokenizer.from_pretrained(bos_eos_dir)
    with pytest.raises(ValueError, match="padding must be"):
        tokenizer("x", padding="longer")
    with pytest.raises(ValueError, match="truncation must be"):
        tokenizer("x", truncation="right")
    with pytest.raises(ValueError, match="max_length must be a positive integer, got 0"):
        tokenizer.encode("x", truncation=True, max_length=0)
    with pytest.raises(ValueError, match=r"max_length \(1\) leaves no room for the 2 special tokens"):
        tokenizer.encode("x y", truncation=True, max_length=1)
    with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive integer"):
        tokenizer(["x"], padding=True, pad_to_multiple_of=-8)
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right', got 'top'"):
        tokenizer(["x"], padding=True, padding_side="top")
    with pytest.raises(ValueError, match="truncation_side must be"):
        Tokenizer(tokenizer.backend, truncation_side="middle")
    no_pad = Tokenizer(tokenizer.backend)
    with pytest.raises(ValueError, match="cannot pad: the tokenizer has no pad_token"):
        no_pad(["x", "x y"], padding=True)
    with pytest.raises(ValueError, match="needs max_length"):
        Tokenizer(tokenizer.backend, special_tokens={"pad_token": "<s>"})(["x"], padding="max_length")

def test_unknown_tokens_convert_to_the_unk_id_as_in_transformers(saved_dir):
    """convert_tokens_to_ids gives unk_token_id for a string outside the vocabulary, as
    PreTrainedTokenizerFast over the same tokenizer.json with the same unk token does."""
    backend = tokenizers.Tokenizer.from_file(str(saved_dir / "tokenizer.json"))
    ours = Tokenizer(backend, special_tokens={"unk_token": "<|im_start|>"})
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(saved_dir / "tokenizer.json"),
                                              unk_token="<|im_start|>")
    tokens = ["not a token", "<|im_end|>", backend.id_to_token(300)]
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens) == [1, 2, 300]
    assert ours.unk_token == hf.unk_token and ours.unk_token_id == hf.unk_token_id == 1


def test_special_tokens_and_vocab(tokenizer, hf_tokenizer):
    """ChatML special ids are 0, 1, 2; eos/pad/vocab size agree with transformers."""
    assert len(tokenizer) == len(hf_tokenizer) == VOCAB_SIZE
    assert tokenizer.vocab_size == hf_tokenizer.vocab_size
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        0, 1, 2,
    ]
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 0
    assert tokenizer.pad_token_id == hf_tokenizer.pad_token_id == 0
    assert tokenizer.bos_token_id is None and hf_tokenizer.bos_token_id is None
    assert tokenizer.eos_token_ids == (0, 2)
    assert tokenizer.id_to_token(2) == "<|im_end|>"
    assert tokenizer.id_to_token(VOCAB_SIZE) is None
    assert hf_tokenizer.model_max_length == tokenizer.model_max_length == 4096


def test_from_pretrained_roundtrip_and_generation_config(tokenizer, saved_dir, tmp_path):
    """A saved tokenizer reloads identically, and generation_config.json eos ids are merged in."""
    shutil.copytree(saved_dir, tmp_path, dirs_exist_ok=True)
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert loaded.encode_batch(TEXTS) == tokenizer.encode_batch(TEXTS)
    assert loaded.chat_template == tokenizer.chat_template
    assert loaded.eos_token_ids == (0,)  # <|im_end|> needs generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (0, 2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == (0, 2)
    for bad in ("x", [2, "3"], -1, True):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be a token id"):
            Tokenizer.from_pretrained(tmp_path)


def test_save_is_byte_identical(tokenizer, saved_dir, tmp_path):
    """Saving a loaded tokenizer again reproduces tokenizer.json and tokenizer_config.json."""
    Tokenizer.from_pretrained(saved_dir).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (saved_dir / name).read_bytes(), name


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chatml_template_matches_transformers(
    tokenizer, hf_tokenizer, conversation, add_generation_prompt
):
    """The trained ChatML template renders and tokenizes exactly as transformers does."""
    kwargs = {"add_generation_prompt": add_generation_prompt}
    expected = hf_tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs) == expected
    expected_ids = hf_tokenizer.apply_chat_template(
        conversation, tokenize=True, return_dict=False, **kwargs
    )
    assert tokenizer.apply_chat_template(conversation, return_dict=False, **kwargs) == expected_ids
    encoding = hf_tokenizer.apply_chat_template(conversation, **kwargs)  # transformers 5's defaults
    assert tokenizer.apply_chat_template(conversation, **kwargs) == dict(encoding)
    assert tokenizer.apply_chat_template(conversation, **kwargs).input_ids == expected_ids


def test_chat_template_arguments_it_cannot_honour_are_refused(tokenizer):
    """transformers' padding, truncation and tensor arguments are a ValueError naming them, not
    template variables that would be silently ignored."""
    for name, value in [("padding", True), ("truncation", True), ("max_length", 8),
                        ("return_tensors", "pt"), ("return_assistant_tokens_mask", True)]:
        with pytest.raises(ValueError, match=f"does not support {name}"):
            tokenizer.apply_chat_template(CONVERSATIONS[0], **{name: value})


@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS}])
def test_chat_template_argument_replaces_the_tokenizers_as_in_transformers(tokenizer, hf_tokenizer, extra):
    """A `chat_template` source renders instead of the tokenizer's, as transformers' argument does."""
    source = ("{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
              "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}")
    expected = hf_tokenizer.apply_chat_template(CONVERSATIONS[1], chat_template=source, tokenize=False,
                                                **extra)
    assert tokenizer.apply_chat_template(CONVERSATIONS[1], chat_template=source, tokenize=False,
                                         **extra) == expected
    assert expected != tokenizer.apply_chat_template(CONVERSATIONS[1], tokenize=False)


def test_chatml_template_format(tokenizer):
    """The ChatML layout is what the serving and SFT code will rely on."""
    rendered = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "conversation",
    [
        CONVERSATIONS[0],
        CONVERSATIONS[1],
        CONVERSATIONS[1] + [{"role": "note", "content": "skipped by continue"}],
        [{"role": "user", "content": f"turn {i}"} if i % 2 == 0 else
         {"role": "assistant", "content": f"  reply {i}  "} for i in range(7)],  # hits break
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS}, {"date_string": "26 Jul 2024"}])
def test_llama3_style_template_matches_transformers(
    llama3_dir, conversation, add_generation_prompt, extra
):
    """bos_token, trim/lstrip blocks, loop controls, tojson(indent), strftime_now, tools, kwargs."""
    ours = Tokenizer.from_pretrained(llama3_dir)
    hf = transformers.AutoTokenizer.from_pretrained(llama3_dir)
    kwargs = {"add_generation_prompt": add_generation_prompt, **extra}
    expected = hf.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert ours.apply_chat_template(conversation, tokenize=False, **kwargs) == expected
    assert expected.startswith("<|begin_of_text|>")
    ids = ours.apply_chat_template(conversation, return_dict=False, **kwargs)
    assert ids == hf.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)
    assert ids[0] == ours.bos_token_id == hf.bos_token_id


@pytest.mark.parametrize("reply", ["The answer", "  padded reply  ", "ends in a newline\n"])
def test_continue_final_message_matches_transformers(tokenizer, hf_tokenizer, llama3_dir, reply):
    """The final message is left open, as transformers leaves it: cut after its content, which a
    trimming template (the Llama 3 one) trims here too."""
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    llama3 = (Tokenizer.from_pretrained(llama3_dir), transformers.AutoTokenizer.from_pretrained(llama3_dir))
    for ours, hf in ((tokenizer, hf_tokenizer), llama3):
        expected = hf.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
        assert ours.apply_chat_template(conversation, continue_final_message=True, tokenize=False) == expected
        assert expected.endswith(reply.strip()) or expected.endswith(reply)
    with pytest.raises(ValueError, match="cannot both be true"):
        tokenizer.apply_chat_template(conversation, continue_final_message=True, add_generation_prompt=True)
    # Quoting the content, as Llama 3.1 quotes tool turns: the end is found as transformers finds it.
    quoting = "{% for m in messages %}<{{ m.role }}>{{ m.content | tojson }}{% endfor %}"
    expected = hf_tokenizer.apply_chat_template(conversation, chat_template=quoting, tokenize=False,
                                                continue_final_message=True)
    assert tokenizer.apply_chat_template(conversation, chat_template=quoting, tokenize=False,
                                         continue_final_message=True) == expected


def test_token_bytes_rebuild_multi_byte_characters(tokenizer):
    """Each token's bytes (OpenAI's logprob `bytes`) join to the text's UTF-8, also where a token
    holds part of a character and decodes to U+FFFD alone: byte-level BPE and byte fallback."""
    text = "héllo 中文 😀 naïve ✓"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    pieces = ["<unk>", "▁a", *(f"<0x{b:02X}>" for b in "中".encode())]
    model = tokenizers.models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                                  byte_fallback=True)
    fallback = tokenizers.Tokenizer(model)
    fallback.decoder = tokenizers.decoders.Sequence([
        tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(),
        tokenizers.decoders.Fuse()])
    ours = Tokenizer(fallback)
    assert [ours.decode([i]) for i in (2, 3)] == ["\ufffd", "\ufffd"]
    assert b"".join(ours.token_bytes(i) for i in (1, 2, 3, 4)) == " a中".encode()


@pytest.mark.parametrize("layout", ["llama2", "metaspace"])
def test_token_bytes_keep_the_space_a_first_token_loses(layout):
    """SentencePiece-style decoders drop the leading space of a text's first token ("▁the" alone
    decodes to "the"); a token's bytes are those it stands for inside a text, so structured
    outputs spell " the" with it and logprob bytes join to the text: Llama-2's decoder (Replace,
    ByteFallback, Fuse, Strip) and a Metaspace one (ByteFallback, Metaspace)."""
    pieces = ["<unk>", "▁", "▁the", "▁end", "a", "the", ",", *(f"<0x{b:02X}>" for b in range(256))]
    model = tokenizers.models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                                  byte_fallback=True)
    backend = tokenizers.Tokenizer(model)
    if layout == "llama2":
        backend.decoder = tokenizers.decoders.Sequence([
            tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse(), tokenizers.decoders.Strip(" ", 1, 0)])
    else:
        backend.decoder = tokenizers.decoders.Sequence([
            tokenizers.decoders.ByteFallback(), tokenizers.decoders.Metaspace(prepend_scheme="first")])
    ours = Tokenizer(backend)
    ids = {piece: i for i, piece in enumerate(pieces)}
    assert ours.decode([ids["▁the"]]) == "the"  # alone: the space is gone
    assert ours.token_bytes(ids["▁the"]) == b" the" and ours.token_bytes(ids["▁"]) == b" "
    assert ours.token_bytes(ids["<0x20>"]) == b" " and ours.token_bytes(ids["the"]) == b"the"
    text_ids = [ids["a"], ids["▁the"], ids[","], ids["▁end"], ids["<0x20>"], ids["<0xC3>"], ids["<0xA9>"]]
    assert b"".join(ours.tokens_bytes(text_ids)) == ours.decode(text_ids).encode() == "a the, end é".encode()


def test_template_raise_exception(llama3_dir):
    """raise_exception in a template surfaces as a jinja2 TemplateError, as in transformers."""
    ours = Tokenizer.from_pretrained(llama3_dir)
    bad = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        ours.apply_chat_template(bad)


def test_template_files_and_named_templates(saved_dir, tmp_path):
    """chat_template.jinja overrides the config; a list of named templates uses default/tool_use."""
    shutil.copy(saved_dir / "tokenizer.json", tmp_path)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "chat_template": [
            {"name": "default", "template": "D{% for m in messages %}{{ m.content }}{% endfor %}"},
            {"name": "tool_use", "template": "T{{ tools | tojson }}{{ messages[0].content }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "ü"}]
    for tools in (None, TOOLS):
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        assert ours.apply_chat_template(messages, tools=tools, tokenize=False) == expected
    # chat_template may name one of them (and is otherwise a template source).
    expected = hf.apply_chat_template(messages, chat_template="tool_use", tokenize=False)
    assert ours.apply_chat_template(messages, chat_template="tool_use", tokenize=False) == expected
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}{{ eos_token }}")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_pretrained(tmp_path)
    expected = hf.apply_chat_template(messages, tokenize=False)
    assert ours.apply_chat_template(messages, tokenize=False) == expected == "J1<|endoftext|>"


def test_generation_tag_and_reasoning_fields(saved_dir, tmp_path):
    """{% generation %} blocks parse, and reasoning fields are aliased as transformers 5 does."""
    shutil.copy(saved_dir / "tokenizer.json", tmp_path)
    template = (
        "{% for m in messages %}{{ m.role }}:{% if m.reasoning_content is defined %}"
        "<think>{{ m.reasoning_content }}|{{ m.thinking }}</think>{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_pretrained(tmp_path)
    messages = [
        {"role": "user", "content": "q", "reasoning_content": None},
        {"role": "assistant", "content": "a", "reasoning": "because"},
    ]
    expected = hf.apply_chat_template(messages, tokenize=False)
    assert ours.apply_chat_template(messages, tokenize=False) == expected  # trim_blocks eats the newlines
    assert expected == "user:qassistant:<think>because|because</think>a"


def _stream(tokenizer, ids, prompt_ids=(), skip_special_tokens=True) -> list[str]:
    detokenizer = tokenizer.detokenizer(prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.push(token_id) for token_id in ids]
    return deltas + [detokenizer.flush()]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40), skip=st.booleans())
def test_detokenizer_random_ids_concatenate_to_decode(tokenizer, ids, skip):
    """For any id sequence (split characters, specials) the deltas join to decode(ids)."""
    deltas = _stream(tokenizer, ids, skip_special_tokens=skip)
    full_text = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full_text
    if "\ufffd" not in full_text:
        assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("text", TEXTS + ["ÿ€😀中" * 20])
def test_detokenizer_multibyte_text(tokenizer, text):
    """Real text streams as valid UTF-8: no U+FFFD ever, and the deltas join to the text."""
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in delta for delta in deltas)


def test_detokenizer_after_prompt(tokenizer):
    """With prompt ids, the deltas are exactly the text the generated ids add to the prompt."""
    prompt_ids = tokenizer.encode("<|im_start|>user\nSay 😀 in 中文<|im_end|>\n")
    generated_ids = tokenizer.encode("<|im_start|>assistant\n😀 是 emoji。<|im_end|>")
    deltas = _stream(tokenizer, generated_ids, prompt_ids)
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full_text = tokenizer.decode(prompt_ids + generated_ids, skip_special_tokens=True)
    assert "".join(deltas) == full_text[len(prompt_text):]
    assert "".join(deltas) == "assistant\n😀 是 emoji。"


@pytest.mark.parametrize("text", ["😀😀 hello", "日本語 hello world", "…こんにちは, x", "é😀中 a😀"])
def test_detokenizer_after_a_prompt_ending_in_byte_tokens(llama2_layout_json, text):
    """Byte-fallback tokens (Llama 2's, Mistral's): a prompt whose last characters are spelled in
    byte tokens, cut at every point, streams exactly the text the generated ids add, never a
    U+FFFD that belongs to a character the detokenizer's window starts inside."""
    ours = Tokenizer(tokenizers.Tokenizer.from_file(str(llama2_layout_json)))
    ids = ours.encode(text, add_special_tokens=False)
    assert any(ours.id_to_token(i).startswith("<0x") for i in ids)
    for cut in range(1, len(ids)):
        prompt_ids, generated_ids = ids[:cut], ids[cut:]
        deltas = _stream(ours, generated_ids, prompt_ids)
        # The prompt's text is its finished characters (a token-id prompt may end inside one).
        full = b"".join(ours.tokens_bytes(ids)).decode()
        prompt = b"".join(ours.tokens_bytes(prompt_ids)).decode(errors="ignore")
        assert "".join(deltas) == full[len(prompt):], cut
        assert not any("\ufffd" in delta for delta in deltas), cut


class _CountingTokenizer:
    """Wraps a Tokenizer and records how many ids each decode call received."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.decoded_lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id):
        return self.tokenizer.token_bytes(token_id)


def test_detokenizer_cost_does_not_grow(tokenizer):
    """Each push decodes a short window, not the whole sequence so far."""
    ids = tokenizer.encode(Path(stdlib_files()[0]).read_text() * 3 + "😀中文" * 200)
    assert len(ids) > 1000
    counting = _CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, ids[:50])
    text = "".join(detokenizer.push(token_id) for token_id in ids[50:]) + detokenizer.flush()
    assert text == tokenizer.decode(ids)[len(tokenizer.decode(ids[:50])):]
    assert max(counting.decoded_lengths) <= 16


@pytest.mark.parametrize("repeated", ["\ufffd", "lone continuation byte"])
def test_detokenizer_cost_stays_bounded_under_text_ending_in_u_fffd(tokenizer, repeated):
    """Output whose text keeps ending in U+FFFD (the character itself, or bytes that are no UTF-8)
    still streams and is decoded a bounded window at a time (it was held back whole, every push
    decoding all of it: 8,000 such tokens took a minute); the deltas join to the decoding."""
    if repeated == "\ufffd":
        ids = tokenizer.encode("\ufffd" * 400)
    else:
        byte = next(i for i in range(len(tokenizer)) if tokenizer.token_bytes(i) == b"\x80")
        ids = [byte] * 400
    counting = _CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, tokenizer.encode("x"))
    deltas = [detokenizer.push(token_id) for token_id in ids]
    assert sum(map(bool, deltas)) > 10  # it streams
    assert "".join(deltas) + detokenizer.flush() == tokenizer.decode(ids)
    assert max(counting.decoded_lengths) <= 32


def test_missing_and_corrupt_files(saved_dir, tmp_path):
    """Missing tokenizer.json is FileNotFoundError and corrupt JSON ValueError, naming the file."""
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    shutil.copy(saved_dir / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_no_chat_template(saved_dir, tmp_path):
    """A tokenizer without a chat template refuses apply_chat_template with a clear message."""
    shutil.copy(saved_dir / "tokenizer.json", tmp_path)
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    assert tokenizer.chat_template is None and tokenizer.eos_token_ids == ()
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "user", "content": "ok"}, "not a dict"], r"messages\[1\]"),
        ([{"role": "user"}], r"messages\[0\]"),
        ([{"content": "no role"}], r"messages\[0\]"),
        ([{"role": 3, "content": "x"}], r"messages\[0\]"),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], r"messages\[0\]"),
    ],
)
def test_malformed_messages(tokenizer, messages, match):
    """Malformed messages are a ValueError naming the offending message."""
    with pytest.raises(ValueError, match=match):
        tokenizer.apply_chat_template(messages)


def test_train_is_deterministic(tmp_path):
    """Two trainings on the same files give a byte-identical tokenizer.json."""
    files = stdlib_files()[5::97]
    first = train_tokenizer(files, 600)
    second = train_tokenizer(files, 600)
    first.save_pretrained(tmp_path / "a")
    second.save_pretrained(tmp_path / "b")
    first_json = (tmp_path / "a/tokenizer.json").read_bytes()
    assert first_json == (tmp_path / "b/tokenizer.json").read_bytes()
    assert first.vocab_size == 600


def test_train_rejects_tiny_vocab():
    """A vocabulary smaller than the 256 bytes plus specials is a user error."""
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(stdlib_files()[:2], 100)


@pytest.fixture(scope="module")
def llama2_layout_json(tmp_path_factory) -> Path:
    """A SentencePiece-style BPE written as Llama 2's and Mistral v0.1's tokenizer.json are: byte
    fallback pieces, a normalizer that prepends "▁" and replaces spaces, Llama's decoder, a BOS
    post-processor."""
    text = [p.read_text(encoding="utf-8", errors="ignore") for p in stdlib_files()[:15]]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, limit_alphabet=90, show_progress=False)
    learned = tokenizers.Tokenizer(tokenizers.models.BPE())
    learned.normalizer = tokenizers.normalizers.Replace(" ", "▁")
    learned.pre_tokenizer = tokenizers.pre_tokenizers.Split("▁", behavior="merged_with_next")
    learned.train_from_iterator(text, trainer)
    model = json.loads(learned.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                                                         fuse_unk=True))
    backend.normalizer = tokenizers.normalizers.Sequence([tokenizers.normalizers.Prepend("▁"),
                                                         tokenizers.normalizers.Replace(" ", "▁")])
    backend.decoder = tokenizers.decoders.Sequence([
        tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse(),
        tokenizers.decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>", "[INST]", "[/INST]"])
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A",
                                                                      special_tokens=[("<s>", 1)])
    path = tmp_path_factory.mktemp("llama2") / "tokenizer.json"
    backend.save(str(path))
    return path


@pytest.mark.parametrize("config, model_type", [
    ({}, None), ({"legacy": True}, "llama"), ({"legacy": False}, None), ({"add_prefix_space": False}, None),
    ({}, "mistral"), ({}, "mixtral"), ({}, "phi3"), ({}, "qwen3"), ({}, "qwen3_moe"), ({}, "qwen2_moe")])
def test_llama_tokenizer_class_encodes_as_transformers(config, model_type, llama2_layout_json, tmp_path):
    """transformers 5 builds a LlamaTokenizer's pipeline itself (Metaspace, prepending "▁" as
    legacy and add_prefix_space say) over a tokenizer.json that is not byte-level, unless the
    model type's registered tokenizer is generic (Mistral's, Mixtral's and Phi-3's read the file as it is;
    Qwen3's and the Qwen MoE types' registered Qwen2Tokenizer yields to the named class); read as it is,
    Llama 2's file prepends "▁" to every text (" Hello" got two): the ids, decoded texts and the
    default padding side are transformers'."""
    if model_type is not None:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    shutil.copy(llama2_layout_json, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        **config}))
    ours, hf = Tokenizer.from_pretrained(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = [" Hello", "Hello world", "  two spaces", "[INST] Hi [/INST]", "x</s> y", "héllo 中文 😀",
             "\n\nnew", "a  b   c", "", "def f(x):\n    return x  # done"]
    for text in texts:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text)), text
    generic = model_type in ("mistral", "mixtral", "phi3")
    assert ours.padding_side == hf.padding_side == ("right" if generic else "left")


@pytest.mark.parametrize("stop, include, text, reason", [
    ("abc", False, "", "abc"), ("b", True, "ab", "b"), ("zz", False, "abc", None)])
def test_a_stop_string_in_text_held_back_to_the_end_still_stops(stop, include, text, reason):
    """A byte-level token of whole characters and the start of another (b"abc\\xc3", as Qwen's
    and Llama 3's vocabularies have) holds its text back until the character completes; cut by
    max_tokens there, the whole characters are the output's text, and a stop string in them ends
    it as anywhere else (the output kept it, finish reason "length")."""
    from slipstream.serve.outputs import SequenceOutput
    from slipstream.serve.request import SamplingParams

    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {piece: i for i, piece in enumerate(sorted(alphabet))}
    vocab["abcÃ"] = len(vocab)  # "Ã" is byte 0xC3 in the byte-level alphabet
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    backend.decoder = tokenizers.decoders.ByteLevel()
    ours = Tokenizer(backend)
    assert ours.decode([vocab["abcÃ"]]) == "abc\ufffd"
    params = SamplingParams(max_tokens=1, stop=[stop], include_stop_str_in_output=include)
    output = SequenceOutput(0, ours, params, prompt_ids=[vocab["a"]])
    assert output.append(vocab["abcÃ"], None) is None  # held back: nothing to look in yet
    output.finish("length")
    assert (output.text, output.stop_reason) == (text, reason)
    assert output.finish_reason == ("length" if reason is None else "stop")


def test_pipeline_differences_compare_settings_not_vocab(tokenizer, qwen2_style_dir):
    """Two tokenizers with one pipeline and other vocabularies and merges do not differ (the old
    comparison of whole tokenizer.json files reported their model); a model setting does."""
    other = train_tokenizer(stdlib_files()[1::40], VOCAB_SIZE // 2)
    assert tokenizer.backend.get_vocab() != other.backend.get_vocab()
    assert pipeline_differences(tokenizer, other) == []
    other.backend.model.byte_fallback = True
    assert pipeline_differences(tokenizer, other) == ["model"]
    assert pipeline_differences(tokenizer, Tokenizer.from_pretrained(qwen2_style_dir)) \
        == ["normalizer", "pre_tokenizer"]


@pytest.mark.parametrize(("named", "model_type", "expected"), [
    ("LlamaTokenizerFast", None, "llama"), ("LlamaTokenizer", "llama", "llama"),
    ("LlamaTokenizer", "qwen2", "qwen2"), ("PreTrainedTokenizerFast", "qwen2", "qwen2"),
    ("Qwen2Tokenizer", None, "qwen2"), ("Qwen2TokenizerFast", "llama", "qwen2"),
    ("Qwen2Tokenizer", "qwen3", "qwen2"), ("Qwen2Tokenizer", "mistral", None), (None, "qwen3", "qwen2"),
    ("PreTrainedTokenizerFast", "qwen3", None), ("PreTrainedTokenizerFast", "llama", None),
    (None, "mistral", None), ("LlamaTokenizer", "qwen3", "llama"), ("LlamaTokenizer", "qwen3_moe", "llama"),
    ("LlamaTokenizer", "mixtral", None), (None, "qwen2_moe", "qwen2"), ("Qwen2Tokenizer", "mixtral", None),
    ("LlamaTokenizer", "phi3", None), ("Qwen2Tokenizer", "phi3", None), (None, "phi3", None),
])
def test_rebuilt_pipeline_follows_auto_tokenizer(named, model_type, expected):
    """transformers 5's AutoTokenizer rule (models/auto/tokenization_auto.py): a qwen2 model always
    gets Qwen2Tokenizer, another model type the class tokenizer_config.json names unless its
    registered tokenizer is generic (mistral; phi3, in the incorrect-class list), and its registered
    one when none is named."""
    config = {} if named is None else {"tokenizer_class": named}
    assert rebuilt_pipeline(config, model_type) == expected


@pytest.mark.parametrize("value, expected", [
    (2048, 2048), (2048.0, 2048), (100.5, 100), (int(1e30), None), (1e30, None), (None, None),
    (0, "model_max_length must be a positive number of tokens, got 0"),
    (-1, "got -1"), (True, "got True"), ("4096", "got '4096'"),
])
def test_model_max_length_is_read_as_vllm_takes_it_or_named(saved_dir, tmp_path, value, expected):
    """A float is a whole number of tokens (vLLM's int()), transformers' 1e30 is no limit, and a
    value that would leave no context (0, -1, a bool, a string) is a ValueError naming the file
    (it became the engine's max_model_len)."""
    shutil.copytree(saved_dir, tmp_path / "model")
    path = tmp_path / "model" / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"model_max_length": value}))
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=f"tokenizer_config.json: .*{re.escape(expected)}"):
            Tokenizer.from_pretrained(tmp_path / "model")
    else:
        assert Tokenizer.from_pretrained(tmp_path / "model").model_max_length == expected
