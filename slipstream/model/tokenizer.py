"""Tokenizer: Hugging Face `tokenizer.json` plus special tokens, chat template and streaming decode.

`Tokenizer` wraps a `tokenizers.Tokenizer` and reads the few things a model directory adds around
it: named special tokens and the chat template (`tokenizer_config.json`, `chat_template.jinja`,
`additional_chat_templates/`, a multimodal processor's `chat_template.json`) and the
end-of-sequence ids (`generation_config.json`). It renders chat templates the way `transformers`
does, so prompts are byte-identical to a Hugging Face tokenizer's, and it answers the calls that
vLLM scripts make on `llm.get_tokenizer()` (which in vLLM is a transformers tokenizer) with
transformers' defaults and results: `tokenizer(text)`, `decode`, `batch_decode`,
`convert_ids_to_tokens`, `convert_tokens_to_ids`, `len(tokenizer)`, the special tokens and their
ids; `tokenizer(texts, padding=..., truncation=..., max_length=...)` pads and truncates as
transformers does (on `padding_side` and `truncation_side`).
`IncrementalDetokenizer` turns a stream of generated ids into valid UTF-8 text deltas.
`train_tokenizer` trains a byte-level BPE with ChatML special tokens on a corpus of files.

Decoding is exactly `tokenizers`' decode: we do not apply `clean_up_tokenization_spaces`, a
WordPiece-era post-processing that transformers 5 also ignores for BPE models.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from slipstream.corpus import read_documents, select_files
from slipstream.model.chat_template import CHATML_TEMPLATE, compile_chat_template, render_chat_template

logger = logging.getLogger(__name__)

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# transformers writes this when a tokenizer has no length limit; we read it back as "no limit".
_NO_MAX_LENGTH = int(1e29)

MAX_COMPILED_TEMPLATES = 32
"""Chat templates kept compiled (the model's, and those requests bring); the oldest goes first."""

# Tokens of already-emitted text the incremental detokenizer re-decodes as context, so decoders
# that treat the first token of a sequence specially (SentencePiece's leading space) agree.
_DETOKENIZE_CONTEXT_TOKENS = 5
# Ids the incremental detokenizer holds back while their text ends in U+FFFD. A character is at
# most 4 bytes, so past 4 ids the U+FFFD before the last ones is final (invalid bytes, or the
# character U+FFFD itself): held longer, every push would re-decode a growing window.
_MAX_HELD_IDS = 16
_UTF8_MAX_BYTES = 4


# transformers' apply_chat_template arguments this tokenizer does not implement; left in
# `kwargs` they would silently become template variables.
_UNSUPPORTED_CHAT_TEMPLATE_ARGS = frozenset({
    "padding", "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens",
})


class BatchEncoding(dict):
    """What calling a `Tokenizer` returns, as transformers' BatchEncoding: a dict whose keys
    (`input_ids`, `attention_mask`) also read as attributes (`encoding.input_ids`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """A `tokenizers.Tokenizer` with named special tokens, a chat template and end-of-sequence ids.

    `special_tokens` maps names from `SPECIAL_TOKEN_NAMES` ("eos_token", ...) to token strings.
    `chat_template` is a Jinja source, or a mapping from template name to source ("default" is
    used unless tools are given and a "tool_use" template exists). `extra_eos_token_ids` are ids
    besides `eos_token` that end generation (e.g. from `generation_config.json`);
    `eos_token_ids` holds them all, `eos_token_id` first.
    """

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        model_max_length: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        padding_side: str = "right",
        truncation_side: str = "right",
    ) -> None:
        special_tokens = dict(special_tokens or {})
        unknown = sorted(set(special_tokens) - set(SPECIAL_TOKEN_NAMES))
        if unknown:
            raise ValueError(f"unknown special token names {unknown}; valid: {SPECIAL_TOKEN_NAMES}")
        self.backend = hf_tokenizer
        self.special_tokens = special_tokens
        if chat_template is not None and not isinstance(chat_template, str):
            chat_template = dict(chat_template)
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        for name, side in (("padding_side", padding_side), ("truncation_side", truncation_side)):
            if side not in ("left", "right"):
                raise ValueError(f"{name} must be 'left' or 'right', got {side!r}")
        self.padding_side = padding_side
        """Where `tokenizer(texts, padding=...)` puts pad tokens (transformers' default: "right")."""
        self.truncation_side = truncation_side
        """Which end truncation cuts (transformers' default: "right"; vLLM generates from
        left-truncated prompts)."""
        self._special_ids = {name: self._require_id(tok) for name, tok in special_tokens.items()}
        eos_ids = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos_ids, *extra_eos_token_ids]))
        self._compiled_templates: dict[str, jinja2.Template] = {}
        self._token_bytes: dict[int, bytes] = {}
        """`token_bytes` of the ids asked for so far."""

    def _require_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    # ---- loading and saving -------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, model_type: str | None = None) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json`, chat template files and EOS ids.

        The ids are those of transformers' `AutoTokenizer`, which replaces parts of the file's
        pipeline for some model types (config.json's `model_type`, or `model_type` when given:
        how a model of that type would read these tokenizer files)."""
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"{tokenizer_path} not found; a model directory needs one")
        try:
            spec = tokenizer_path.read_text(encoding="utf-8")
            hf_tokenizer = tokenizers.Tokenizer.from_str(spec)
        except Exception as error:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"{tokenizer_path} is not a valid tokenizer.json: {error}") from error
        config = _read_json(model_dir / "tokenizer_config.json")
        if model_type is None:
            model_type = _read_json(model_dir / "config.json").get("model_type")
        pipeline = rebuilt_pipeline(config, model_type)
        llama = pipeline == "llama" and '"ByteLevel"' not in spec
        if llama:
            _use_llama_pipeline(hf_tokenizer, config)
        elif pipeline == "qwen2" and isinstance(hf_tokenizer.model, models.BPE):
            _use_qwen2_pipeline(hf_tokenizer, config)
        special_tokens_map = _read_json(model_dir / "special_tokens_map.json")
        generation_config = _read_json(model_dir / "generation_config.json")
        max_length = _read_model_max_length(config.get("model_max_length"),
                                            model_dir / "tokenizer_config.json")
        return cls(
            hf_tokenizer,
            special_tokens=_read_special_tokens(config, special_tokens_map),
            chat_template=_read_chat_templates(model_dir, config),
            model_max_length=max_length,
            extra_eos_token_ids=_as_id_list(generation_config.get("eos_token_id"),
                                            f"{model_dir / 'generation_config.json'}: eos_token_id"),
            padding_side=config.get("padding_side", "left" if llama else "right"),
            truncation_side=config.get("truncation_side", "right"),
        )

    def save_pretrained(self, model_dir: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json`, loadable by `AutoTokenizer`.

        Only tokenizer files are written; `eos_token_ids` belongs in `generation_config.json`,
        which the caller writes with the rest of the model.
        """
        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(model_dir / "tokenizer.json"), pretty=True)
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens,
            "clean_up_tokenization_spaces": False,
            "padding_side": self.padding_side,
            "truncation_side": self.truncation_side,
        }
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        if isinstance(self.chat_template, dict):
            config["chat_template"] = [
                {"name": name, "template": source} for name, source in self.chat_template.items()
            ]
        elif self.chat_template is not None:
            config["chat_template"] = self.chat_template
        for name in ("chat_template.json", "chat_template.jinja"):
            if (model_dir / name).exists():
                logger.warning("%s has a %s, overriding the saved one", model_dir, name)
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (model_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")

    # ---- vocabulary -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, added tokens left out, as transformers' `vocab_size`;
        `len(tokenizer)` counts every id."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """Number of ids, added tokens included, as `len()` of a transformers tokenizer."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_ids.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_ids.get("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_ids.get("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_ids.get("unk_token")

    def token_to_id(self, token: str) -> int | None:
        """The id of `token`, or None when it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id` (byte-level form for BPE), None if out of range."""
        return self.backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        """transformers' name for `id_to_token`: the vocabulary string of one id, or of each id
        of a list (None for an id out of range)."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(token_id) for token_id in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """As transformers: the id of one vocabulary string, or of each string of a list; a string
        not in the vocabulary gets `unk_token_id` (None when there is no unk token)."""

        def to_id(token: str) -> int | None:
            token_id = self.backend.token_to_id(token)
            return self.unk_token_id if token_id is None else token_id

        return to_id(tokens) if isinstance(tokens, str) else [to_id(token) for token in tokens]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        """The text of vocabulary strings, through the tokenizer's decoder (as transformers)."""
        decoder = self.backend.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    def get_vocab(self) -> dict[str, int]:
        """Vocabulary string -> id, added tokens included."""
        return self.backend.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        """Added token (special tokens among them) -> id."""
        added = sorted(self.backend.get_added_tokens_decoder().items())
        return {token.content: token_id for token_id, token in added}

    # ---- encode and decode ------------------------------------------------------------------

    def encode(
        self, text: str, add_special_tokens: bool = True, *,
        truncation: bool | str | None = None, max_length: int | None = None,
        truncation_side: str | None = None,
    ) -> list[int]:
        """Token ids of `text`; special-token strings in `text` become their ids. `truncation` and
        `max_length` cut it to at most `max_length` ids, special tokens included, as transformers
        does (`truncation_side`, default `self.truncation_side`, says which end goes)."""
        return self._encode([text], add_special_tokens, self._truncation_length(truncation, max_length),
                            truncation_side)[0]

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """`encode` for many texts at once (parallel in the Rust backend)."""
        return self._encode(list(texts), add_special_tokens, None)

    def __call__(
        self, text: str | Sequence[str], *, add_special_tokens: bool = True,
        padding: bool | str = False, truncation: bool | str | None = None,
        max_length: int | None = None, pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
    ) -> BatchEncoding:
        """As calling a transformers tokenizer: `input_ids` and `attention_mask` of one text, or
        lists of them for a list of texts, with transformers' padding and truncation.

        `padding` is False ("do_not_pad"), True ("longest": to the longest text) or "max_length"
        (to `max_length`, else `model_max_length`), rounded up to a multiple of
        `pad_to_multiple_of`; pads go on `padding_side` (default `self.padding_side`) and have mask
        0. `truncation` (True, "longest_first" or "only_first"; also implied by `max_length` when
        not padding) cuts each text to `max_length` (default `model_max_length`), special tokens
        included, at `truncation_side`.
        """
        padding = _padding_strategy(padding)
        if truncation is None and padding != "do_not_pad":
            truncation = False  # as transformers: max_length then says how far to pad, not to cut
        texts = [text] if isinstance(text, str) else list(text)
        batch = self._encode(texts, add_special_tokens, self._truncation_length(truncation, max_length))
        masks = [[1] * len(ids) for ids in batch]
        if padding != "do_not_pad" or pad_to_multiple_of is not None:
            batch, masks = self._pad(batch, padding, max_length, pad_to_multiple_of,
                                     padding_side or self.padding_side)
        if isinstance(text, str):
            return BatchEncoding(input_ids=batch[0], attention_mask=masks[0])
        return BatchEncoding(input_ids=batch, attention_mask=masks)

    def _truncation_length(self, truncation: bool | str | None, max_length: int | None) -> int | None:
        """The most ids an encoding may have under transformers' rules, None for no limit."""
        if truncation not in (None, True, False, "longest_first", "only_first", "do_not_truncate"):
            raise ValueError(f"truncation must be True, False, 'longest_first', 'only_first' or "
                             f"'do_not_truncate', got {truncation!r}")
        if max_length is not None:
            _check_length("max_length", max_length)
        if truncation in (False, "do_not_truncate") or (truncation is None and max_length is None):
            return None
        return max_length if max_length is not None else self.model_max_length

    def _encode(self, texts: list[str], add_special_tokens: bool, max_length: int | None,
                side: str | None = None) -> list[list[int]]:
        """Ids of each text, cut to `max_length` at `side` (default `truncation_side`; None: not
        cut) before the special tokens are added, so that they stay (transformers' truncation)."""
        side = side or self.truncation_side
        if side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
        if max_length is None:
            encodings = self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
            return [encoding.ids for encoding in encodings]
        specials = self.backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        if max_length < specials:
            raise ValueError(f"max_length ({max_length}) leaves no room for the {specials} special "
                             "tokens this tokenizer adds")
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        for encoding in encodings:
            encoding.truncate(max_length - specials, direction=side)
        return [self.backend.post_process(encoding, add_special_tokens=add_special_tokens).ids
                for encoding in encodings]

    def _pad(
        self, batch: list[list[int]], padding: str, max_length: int | None,
        pad_to_multiple_of: int | None, side: str,
    ) -> tuple[list[list[int]], list[list[int]]]:
        """The encodings padded with `pad_token_id` to a common length, and their masks."""
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
        if self.pad_token_id is None:
            raise ValueError("cannot pad: the tokenizer has no pad_token")
        if padding == "max_length":
            length = max_length if max_length is not None else self.model_max_length
            if length is None:
                raise ValueError("padding='max_length' needs max_length (the tokenizer has no "
                                 "model_max_length)")
        else:
            length = max(len(ids) for ids in batch)
        if pad_to_multiple_of is not None:
            _check_length("pad_to_multiple_of", pad_to_multiple_of)
            length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
        padded, masks = [], []
        for ids in batch:
            pads = max(length - len(ids), 0)
            if side == "left":
                padded.append([self.pad_token_id] * pads + ids)
                masks.append([0] * pads + [1] * len(ids))
            else:
                padded.append(ids + [self.pad_token_id] * pads)
                masks.append([1] * len(ids) + [0] * pads)
        return padded, masks

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """Text of `ids` (or of one id); bytes that do not form valid UTF-8 become U+FFFD. Special
        tokens are kept unless `skip_special_tokens`, as transformers' default (generated text
        skips them by default: SamplingParams.skip_special_tokens). `clean_up_tokenization_spaces`
        is taken and, as transformers 5 does for these (BPE) tokenizers, not applied."""
        _no_clean_up(clean_up_tokenization_spaces)
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> list[str]:
        """`decode` for each id sequence, as transformers' `batch_decode`."""
        _no_clean_up(clean_up_tokenization_spaces)
        batch = [list(ids) for ids in sequences]
        return self.backend.decode_batch(batch, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for inside a text (OpenAI's logprob `bytes`, and how structured
        outputs spell with it): the UTF-8 of its text after another token, since decoders drop
        the leading space of a text's first token (SentencePiece's "▁the" alone decodes to
        "the"), except for a token that holds part of a multi-byte character, whose text is
        U+FFFD: then its own bytes, from its byte-level BPE form or its byte-fallback piece."""
        cached = self._token_bytes.get(token_id)  # per logprob of every token: the common case
        return cached if cached is not None else self.tokens_bytes([token_id])[0]

    def tokens_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """`token_bytes` of each id, in one decoding call (each id's bytes kept for the next)."""
        cache = self._token_bytes
        missing = [i for i in dict.fromkeys(token_ids) if i not in cache]
        if missing:
            anchor = self._anchor
            texts = self.backend.decode_batch([[i] if anchor is None else [anchor, i] for i in missing],
                                              skip_special_tokens=False)
            for token_id, text in zip(missing, texts, strict=True):
                if anchor is not None:  # a decoder that merged the anchor with it: the token alone
                    text = (text[len(self._anchor_text):] if text.startswith(self._anchor_text)
                            else self.decode([token_id]))
                cache[token_id] = self._piece_bytes(token_id, text) if "\ufffd" in text else text.encode()
        return [cache[i] for i in token_ids]

    @functools.cached_property
    def _anchor(self) -> int | None:
        """A token that decodes to one ASCII letter whatever follows it, to decode others after
        (None if the vocabulary has none, or no decoder joins tokens: they are decoded alone)."""
        if self.backend.decoder is None:
            return None
        for letter in "aeioustnrlAEIOUSTNRL":
            for piece in (letter, f"<0x{ord(letter):02X}>"):
                token_id = self.backend.token_to_id(piece)
                if token_id is not None and self.decode([token_id]) == letter:
                    return token_id
        return None

    @functools.cached_property
    def _anchor_text(self) -> str:
        return "" if self._anchor is None else self.decode([self._anchor])

    def _piece_bytes(self, token_id: int, text: str) -> bytes:
        """The bytes of a token whose text has U+FFFD: those its vocabulary piece spells."""
        piece = self.id_to_token(token_id)
        if piece is None:
            return text.encode()
        if fallback := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            return bytes([int(fallback.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if all(char in alphabet for char in piece):
            return bytes(alphabet[char] for char in piece)
        return text.encode()

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A streaming decoder for ids generated after `prompt_ids`."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)

    # ---- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int] | BatchEncoding:
        """Render `messages` with the chat template exactly as transformers does; `chat_template`,
        as there, replaces it with a template source or the name of one of the named templates.

        The template sees `messages`, `tools`, `documents` (None unless passed),
        `add_generation_prompt`, the named special tokens (`bos_token`, ...) and `kwargs`.
        `continue_final_message` leaves the final message open for the reply to continue.
        Returns, with transformers 5's defaults, the encoding of the rendered text (its
        `input_ids` and `attention_mask`, encoded without adding special tokens: the template
        already wrote them); with `return_dict=False` the ids; with `tokenize=False` the text.
        """
        unsupported = sorted(_UNSUPPORTED_CHAT_TEMPLATE_ARGS & kwargs.keys())
        if unsupported:
            raise ValueError(f"apply_chat_template does not support {', '.join(unsupported)} (it neither "
                             "pads, truncates nor builds tensors: call the tokenizer on its text for that)")
        source = self.template_source(tools, chat_template)
        if source not in self._compiled_templates:
            if len(self._compiled_templates) >= MAX_COMPILED_TEMPLATES:  # templates may come with requests
                del self._compiled_templates[next(iter(self._compiled_templates))]
            self._compiled_templates[source] = compile_chat_template(source)
        text = render_chat_template(
            self._compiled_templates[source], messages, tools=tools,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            special_tokens=self.special_tokens, **kwargs,
        )
        if not tokenize:
            return text
        encoding = self(text, add_special_tokens=False)
        return encoding if return_dict else encoding["input_ids"]

    def template_source(self, tools: object, chat_template: str | None) -> str:
        """`chat_template` when given (as in transformers, a name among the tokenizer's named
        templates or a template source), else the tokenizer's template for the call."""
        if chat_template is not None:
            named = self.chat_template if isinstance(self.chat_template, dict) else {}
            return named.get(chat_template, chat_template)
        source = self.chat_template
        if source is None:
            raise ValueError("this tokenizer has no chat template (none in tokenizer_config.json "
                             "or chat_template.jinja), so apply_chat_template cannot be used")
        if isinstance(source, dict):
            name = "tool_use" if tools is not None and "tool_use" in source else "default"
            if name not in source:
                raise ValueError(f"no 'default' chat template among {sorted(source)}")
            source = source[name]
        return source


def _no_clean_up(clean_up_tokenization_spaces: bool | None) -> None:
    """transformers 5 ignores clean_up_tokenization_spaces=True for BPE tokenizers, with a warning
    (the WordPiece-era clean-up strips the spaces before punctuation); so do we."""
    if clean_up_tokenization_spaces:
        logger.warning("ignoring clean_up_tokenization_spaces=True, as transformers 5 does for a BPE "
                       "tokenizer: it would strip the spaces before punctuation")


def _use_llama_pipeline(backend: tokenizers.Tokenizer, config: Mapping[str, Any]) -> None:
    """The pipeline transformers 5's `LlamaTokenizer` builds, whatever a (not byte-level)
    tokenizer.json holds: no normalizer, a Metaspace pre-tokenizer that prepends "▁" to the first
    word (`add_prefix_space`, default true; to every word where `legacy` is true) and Llama's
    decoder. Llama 2's and Mistral v0.1's files, read as they are, prepend "▁" to every text (a
    text starting with a space got two), so their ids would differ from transformers'."""
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    scheme = ("always" if config.get("legacy", False) else "first") if add_prefix_space else "never"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)


_TOKENIZER_FAMILY = {"mixtral": "mistral", "qwen2_moe": "qwen3", "qwen3_moe": "qwen3"}


def rebuilt_pipeline(config: Mapping[str, Any], model_type: str | None) -> str | None:
    """Which tokenizer class of its own transformers 5's `AutoTokenizer` builds around the vocab
    of a model directory's tokenizer.json, given its tokenizer_config.json (`config`) and
    config.json's `model_type`: "llama", "qwen2", or None where it reads the file as it is.

    - "llama": tokenizer_config.json names LlamaTokenizer(Fast) and the model type is llama,
      unknown, or one whose registered tokenizer is a class of its own other than Llama's and
      which is not in the incorrect-class list (qwen3), for which transformers trusts the named
      class (Mistral's registered tokenizer is generic: it reads the file as it is).
      `Tokenizer.from_pretrained` rebuilds only a tokenizer.json that is not byte-level.
    - "qwen2": every qwen2 model, whatever tokenizer_config.json names (qwen2 is in transformers'
      MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS); a tokenizer_config.json that names
      Qwen2Tokenizer(Fast), for any model type whose registered tokenizer is a class of its own
      (llama, qwen3) or none (no config.json), since transformers then trusts the named class;
      and a qwen3 model (registered: Qwen2Tokenizer) whose tokenizer_config.json names no class.
      Mistral's registered tokenizer is generic, and so is phi3's (it is in the incorrect-class
      list, which registers the generic backend for it), so their models read the file as it is.

    Mixture-of-experts types register what their dense family does: mixtral mistral's generic
    tokenizer, qwen2_moe and qwen3_moe Qwen2Tokenizer (neither is in the incorrect-class list)."""
    model_type = _TOKENIZER_FAMILY.get(model_type, model_type)
    named = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    if named == "LlamaTokenizer" and model_type in (None, "llama", "qwen3"):
        return "llama"
    if (model_type == "qwen2" or (named == "Qwen2Tokenizer" and model_type not in ("mistral", "phi3"))
            or (not named and model_type == "qwen3")):
        return "qwen2"
    return None


QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
"""Qwen2's pre-tokenizer split: letters with one leading non-letter, single digits, runs of
punctuation, newlines and spaces."""


def _use_qwen2_pipeline(backend: tokenizers.Tokenizer, config: Mapping[str, Any]) -> None:
    """The pipeline transformers 5's `Qwen2Tokenizer` builds around a tokenizer.json's BPE vocab
    and merges, whatever else the file holds: NFC normalization, the `QWEN2_PRETOKENIZE_REGEX`
    split, byte-level mapping (`add_prefix_space`, default false), a byte-level decoder, and a
    plain BPE (no dropout, unknown token, word affixes or byte fallback). A Qwen2 file holds that
    pipeline already; any other tokenizer exported with a qwen2 model is tokenized this way by
    transformers and vLLM. Model fields are set only where they change something, so that a file
    with the pipeline keeps its own text (`pipeline_differences`)."""
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")), use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    model = backend.model
    for name, plain in (("dropout", None), ("unk_token", None), ("continuing_subword_prefix", None),
                        ("end_of_word_suffix", None), ("fuse_unk", False), ("byte_fallback", False),
                        ("ignore_merges", False)):
        if getattr(model, name):
            setattr(model, name, plain)


_PIPELINE_PARTS = ("normalizer", "pre_tokenizer", "model", "decoder")
_MODEL_SETTINGS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                   "byte_fallback", "ignore_merges")
"""The settings of a tokenizer model that a rebuilt pipeline may change (`_use_qwen2_pipeline`);
its vocab and merges it never does."""


def pipeline_differences(a: Tokenizer, b: Tokenizer) -> list[str]:
    """The parts of the tokenization pipeline (normalizer, pre_tokenizer, model, decoder) in which
    two tokenizers differ. The model is compared by its type and settings, not its vocab and
    merges (a rebuilt pipeline keeps those); settings that only move offsets (`trim_offsets`)
    are left out."""
    def parts(tokenizer: Tokenizer) -> dict[str, Any]:
        backend = tokenizer.backend
        found: dict[str, Any] = {}
        for part in ("normalizer", "pre_tokenizer", "decoder"):
            value = getattr(backend, part)
            found[part] = None if value is None else _without_key(json.loads(value.__getstate__()),
                                                                  "trim_offsets")
        model = backend.model
        found["model"] = (type(model).__name__, [getattr(model, name, None) for name in _MODEL_SETTINGS])
        return found

    ours, theirs = parts(a), parts(b)
    return [part for part in _PIPELINE_PARTS if ours[part] != theirs[part]]


def _without_key(value: Any, key: str) -> Any:
    if isinstance(value, dict):
        return {k: _without_key(v, key) for k, v in value.items() if k != key}
    if isinstance(value, list):
        return [_without_key(v, key) for v in value]
    return value


def _read_model_max_length(value: Any, path: Path) -> int | None:
    """tokenizer_config.json's `model_max_length` as a whole number of tokens (a float such as
    2048.0 or transformers' 1e30 taken as vLLM's `int()` takes it); None where it names none or
    transformers' "no limit"; a ValueError naming the file where it is no positive number (a 0
    would leave the engine a context of no tokens)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= math.inf:
        raise ValueError(f"{path}: model_max_length must be a positive number of tokens, got {value!r}")
    return None if value >= _NO_MAX_LENGTH else int(value)


def _starts_inside_a_character(data: bytes) -> bool:
    """Whether `data` starts with a UTF-8 continuation byte."""
    return bool(data) and 0x80 <= data[0] < 0xC0


def _is_unfinished_character(data: bytes) -> bool:
    """Whether `data` is the start of one multi-byte UTF-8 character, without its last bytes."""
    lead = data[0] if data else 0
    needed = 4 if lead >= 0xF0 else 3 if lead >= 0xE0 else 2 if lead >= 0xC0 else 0
    return len(data) < needed and all(0x80 <= byte < 0xC0 for byte in data[1:])


class IncrementalDetokenizer:
    """Turns ids pushed one at a time into text deltas that are always valid UTF-8.

    Algorithm (the prefix/read offset technique): keep a short window of ids whose text was
    already emitted (the prefix) followed by ids not yet emitted. Each push decodes the window and
    emits whatever extends past the prefix text, unless it ends in U+FFFD, which means a
    multi-byte character is still incomplete; then the ids stay pending. After emitting, the
    pending ids become the new prefix. Past `_MAX_HELD_IDS` pending ids, the text before the last
    4 of them is emitted (its U+FFFD can no longer complete). Work per push is bounded by the
    window, so `"".join(deltas) + flush()` equals `decode(all_ids)` at a cost independent of the
    sequence length.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The window of prompt ids starts and ends at characters, as far as tokens allow: one that
        # starts inside a character's byte tokens would decode to U+FFFDs, taken for output (a
        # byte-fallback decoder makes them of the whole byte run), and a character the prompt
        # leaves unfinished stays pending, so that the ids completing it complete its text.
        start = max(0, len(prompt_ids) - _DETOKENIZE_CONTEXT_TOKENS)
        for _ in range(_UTF8_MAX_BYTES - 1):
            if start == 0 or not _starts_inside_a_character(tokenizer.token_bytes(prompt_ids[start])):
                break
            start -= 1
        window = self._window_ids = list(prompt_ids[start:])
        self._num_prefix_ids = len(window)
        for num_pending in range(1, min(_UTF8_MAX_BYTES, len(window) + 1)):
            if _is_unfinished_character(b"".join(map(tokenizer.token_bytes, window[-num_pending:]))):
                self._num_prefix_ids -= num_pending
                break
        # A token that ends inside a character after a whole one (byte-level BPE) decodes to a
        # trailing U+FFFD; dropping it lets the finished character appear in the first delta.
        self._prefix_text = self._decode(self._window_ids[: self._num_prefix_ids]).rstrip("\ufffd")

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the newly completed text ("" while held back)."""
        self._window_ids.append(token_id)
        text = self._decode(self._window_ids)
        if len(text) <= len(self._prefix_text):
            return ""
        if not text.endswith("\ufffd"):
            return self._emit(text, len(self._window_ids))
        if len(self._window_ids) - self._num_prefix_ids <= _MAX_HELD_IDS:
            return ""
        end = len(self._window_ids) - _UTF8_MAX_BYTES
        head = self._decode(self._window_ids[:end])
        if len(head) <= len(self._prefix_text) or not text.startswith(head):
            return ""
        return self._emit(head, end)

    def flush(self) -> str:
        """Return any held-back text (e.g. a trailing incomplete character, as U+FFFD)."""
        text = self._decode(self._window_ids)
        return self._emit(text, len(self._window_ids)) if len(text) > len(self._prefix_text) else ""

    def _emit(self, text: str, end: int) -> str:
        """The delta of `text`, the decoding of the window's first `end` ids; those past the
        prefix become the new prefix, the rest stay pending."""
        delta = text[len(self._prefix_text):]
        del self._window_ids[: self._num_prefix_ids]
        self._num_prefix_ids = end - self._num_prefix_ids
        self._prefix_text = self._decode(self._window_ids[: self._num_prefix_ids])
        return delta


# ---- training ---------------------------------------------------------------------------------


def train_tokenizer(
    files: Iterable[Path],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    max_bytes: int | None = None,
    model_max_length: int | None = None,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 pre-tokenizer regex) with ChatML special tokens on `files`.

    Special tokens get the first ids: `<|endoftext|>` = 0 (eos and pad, no BOS, as in Qwen),
    `<|im_start|>` = 1, `<|im_end|>` = 2; `eos_token_ids` holds both 0 and 2. `max_bytes` trains on
    a deterministic, evenly spread subset of `files` (see `corpus.select_files`). The same files
    and arguments give a byte-identical `tokenizer.json`, whatever the number of threads.
    """
    special = [ENDOFTEXT, IM_START, IM_END]
    min_vocab_size = 256 + len(special)
    if vocab_size < min_vocab_size:
        raise ValueError(
            f"vocab_size must be at least {min_vocab_size} (256 bytes + specials), got {vocab_size}"
        )
    hf_tokenizer = tokenizers.Tokenizer(models.BPE())
    hf_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf_tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    hf_tokenizer.train_from_iterator(read_documents(select_files(files, max_bytes)), trainer)
    logger.info("trained a byte-level BPE tokenizer with %d tokens", hf_tokenizer.get_vocab_size())
    return Tokenizer(
        hf_tokenizer,
        special_tokens={"eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT},
        chat_template=CHATML_TEMPLATE,
        model_max_length=model_max_length,
        extra_eos_token_ids=[hf_tokenizer.token_to_id(IM_END)],
    )


# ---- helpers: model directory files -----------------------------------------------------------


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's scheme, which `tokenizers`'
    ByteLevel uses): the printable Latin-1 bytes stand for themselves, the other bytes, in order,
    for the characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(others)}


def _padding_strategy(padding: bool | str) -> str:
    """transformers' name for a `padding` argument: "do_not_pad", "longest" or "max_length"."""
    strategies = {False: "do_not_pad", True: "longest", "do_not_pad": "do_not_pad",
                  "longest": "longest", "max_length": "max_length"}
    if isinstance(padding, bool) or (isinstance(padding, str) and padding in strategies):
        return strategies[padding]
    raise ValueError(f"padding must be True, False, 'longest', 'max_length' or 'do_not_pad', "
                     f"got {padding!r}")


def _check_length(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as written by transformers: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_special_tokens(config: dict[str, Any], special_tokens_map: dict[str, Any]) -> dict:
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = _token_content(config.get(name)) or _token_content(special_tokens_map.get(name))
        if token is not None:
            tokens[name] = token
    return tokens


def _as_id_list(value: Any, what: str) -> list[int]:
    """None, one token id or a list of them as a list; anything else a ValueError naming `what`."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0
               for token_id in values):
        raise ValueError(f"{what} must be a token id or a list of them, got {value!r}")
    return values


def _read_chat_templates(model_dir: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The chat template(s); template files take priority over `tokenizer_config.json`. A
    multimodal processor's `chat_template.json` ({"chat_template": source}, where llava-hf
    checkpoints keep theirs) comes first, as transformers' processor reads it before
    `chat_template.jinja` (and refuses it next to `additional_chat_templates/`) and vLLM renders
    with the processor's template."""
    legacy = _read_processor_chat_template(model_dir)
    if legacy is not None:
        return legacy
    templates: dict[str, str] = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if not templates:
        configured = config.get("chat_template")
        if isinstance(configured, list):  # [{"name": ..., "template": ...}, ...]
            templates = {entry["name"]: entry["template"] for entry in configured}
        elif configured is None or isinstance(configured, str):
            return configured
        else:
            raise ValueError(f"chat_template in {model_dir}/tokenizer_config.json must be a string "
                             f"or a list of {{name, template}}, got {type(configured).__name__}")
    return templates["default"] if list(templates) == ["default"] else templates


def _read_processor_chat_template(model_dir: Path) -> str | None:
    """The template of `model_dir/chat_template.json`, None where there is no such file."""
    path = model_dir / "chat_template.json"
    if not path.is_file():
        return None
    if (model_dir / "additional_chat_templates").is_dir():
        raise ValueError(f"{model_dir} has both chat_template.json and additional_chat_templates/, which "
                         "transformers refuses: replace chat_template.json by chat_template.jinja")
    try:
        template = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(template, dict) or not isinstance(template.get("chat_template"), str):
        raise ValueError(f"{path} must be an object whose chat_template is a string, got {template!r:.200}")
    return template["chat_template"]
