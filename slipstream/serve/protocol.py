"""OpenAI's request side: bodies as strict pydantic models, their errors, and sampling params.

Bodies are parsed in pydantic's strict mode, as OpenAI's API does: `"max_tokens": "5"` or
`"stream": 1` is a 400, not a silent coercion. Unknown fields are ignored (as vLLM does), so that
clients which send newer OpenAI fields keep working; known OpenAI and vLLM fields this server
cannot honour (`logits_processors`, `prompt_embeds`, ...: `UNSUPPORTED_FIELDS`) are a 400 when
set rather than ignored, since ignoring them would answer a different question than the one
asked. The vLLM extensions `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`,
`prompt_logprobs`, `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`, `add_special_tokens`,
`return_tokens_as_token_ids`, `use_beam_search` with `length_penalty`, `echo`, the structured
outputs and, for chat, `add_generation_prompt`, `continue_final_message`, `chat_template`,
`chat_template_kwargs` and `documents` are accepted too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from slipstream.model.chat_template import RESERVED_TEMPLATE_KWARGS
from slipstream.serve.beam_search import BeamSearchParams
from slipstream.serve.pooling import PoolingParams
from slipstream.serve.request import SamplingParams
from slipstream.serve.structured import StructuredOutputsParams

MAX_N = 128
"""Most completions per prompt; more would only let one request fill the whole queue."""

MAX_STOP_STRINGS = 256
"""Most stop strings (and bad words) a request may give: each is looked for at every token, on the
engine's thread, so that a request with thousands would slow every other one."""

TokenIds = list[Annotated[int, Field(ge=0)]]


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


BEAM_SEARCH_CONFLICTS: dict[str, tuple[object, ...]] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "stop": ([], ""), "stop_token_ids": ([],),
    "min_tokens": (0,), "logit_bias": ({},), "allowed_token_ids": (), "bad_words": ([],),
    "prompt_logprobs": (), "echo": (False,), "structured_outputs": ({},), "guided_choice": ([],),
    "guided_regex": (), "guided_json": (), "guided_grammar": (), "response_format": ({"type": "text"},),
    "tool_choice": ("none",),
}
"""Request fields beam search cannot honour (vLLM's silently ignores them), each with the values
that ask for nothing (None aside); any other value is a 400."""

UNSUPPORTED_FIELDS: dict[str, object] = {
    "logits_processors": None,
    "prompt_embeds": None, "functions": None, "function_call": None,
}
"""OpenAI and vLLM request fields this server cannot honour, each with the value that asks for
nothing; any other value (None, an empty list or dict aside) is a 400."""


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit null asks for the default, as OpenAI's spec marks optional fields nullable
        and vLLM reads them (`"stream": null`, `"n": null`; completions' `"max_tokens": null` is
        16). Fields whose default is None keep their null."""
        if not isinstance(data, dict):
            return data
        return {name: value for name, value in data.items()
                if value is not None or name not in cls.model_fields
                or cls.model_fields[name].is_required() or cls.model_fields[name].default is None}

    def check_supported(self) -> None:
        """A 400 for what the body asks that the server cannot honour (nothing, unless it says)."""


def _refuse_unsupported(extra: dict[str, Any] | None) -> None:
    """A 400 for the first field of UNSUPPORTED_FIELDS that asks for something."""
    for name, value in (extra or {}).items():
        if name in UNSUPPORTED_FIELDS and value not in (None, [], {}, UNSUPPORTED_FIELDS[name]):
            raise bad_request(f"{name} is not supported by this server", name)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk also carries its choice's usage so far."""
    _given: bool = PrivateAttr(default=False)

    @model_validator(mode="wrap")
    @classmethod
    def _note_given(cls, data: Any, handler: Any) -> StreamOptions:
        options = handler(data)
        options._given = bool(data)
        return options

    @property
    def given(self) -> bool:
        """Whether the request's object held any key, null or unknown ones too: vLLM refuses
        stream_options without stream only then (it tests the object's truth)."""
        return self._given


class GenerationBody(_Body):
    """Fields that completions and chat completions share."""

    model_config = ConfigDict(extra="allow")  # kept, so that check_supported sees them

    model: str | None = None
    """None means the served model."""
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, as OpenAI's API sends it) -> bias, clamped to [-100, 100] as OpenAI
    documents and vLLM does."""
    # vLLM's extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(default=None, ge=0)
    """Log-probabilities of every prompt token with this many alternatives (as in vLLM)."""
    allowed_token_ids: TokenIds | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """Keep only the prompt's last k tokens (-1: the context length), as vLLM."""
    truncation_side: Literal["left", "right"] | None = None
    """vLLM's: "right" keeps the prompt's first k tokens instead (default "left")."""
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)
    """vLLM's: lower is served earlier, under `--scheduling-policy priority` (another value is a
    400 without it, as vLLM documents)."""
    cache_salt: str | None = None
    """vLLM's: prompts share prefix-cache blocks only with requests of the same salt (non-empty, at
    most 128 characters, none of '@', '/', '\\' and NUL, as vLLM's check)."""

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, salt: str | None) -> str | None:
        if salt is not None and (not salt or len(salt) > 128 or any(c in salt for c in "@/\\\x00")):
            raise ValueError("cache_salt must be a non-empty string of at most 128 characters without "
                             "'@', '/', '\\' or NUL")
        return salt
    return_tokens_as_token_ids: bool | None = None
    """Name logprobs tokens "token_id:{id}" (None: the server's default), as vLLM."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's structured outputs: `{"choice": [...]}` (the output is one of the strings), `{"regex":
    ...}` (it matches), `{"json": schema}`, `{"json_object": true}` or `{"grammar": ...}`."""
    guided_choice: list[str] | None = None
    """vLLM's older name for structured_outputs' choice."""
    guided_regex: str | None = None
    """vLLM's older name for structured_outputs' regex."""
    guided_json: dict[str, Any] | str | None = None
    """vLLM's older name for structured_outputs' json (a JSON schema)."""
    guided_grammar: str | None = None
    """vLLM's older name for structured_outputs' grammar (GBNF or Lark)."""
    response_format: dict[str, Any] | None = None
    """OpenAI's: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}}}."""
    use_beam_search: bool = False
    """vLLM's beam search: the `n` best of `n` beams, ranked by the model's log-probabilities."""
    length_penalty: float = 1.0
    """Beam search only: the exponent of the generated length a beam's score divides by."""

    def check_supported(self) -> None:
        """Refuse set fields this server cannot honour, rather than ignore them."""
        _refuse_unsupported(self.model_extra)
        if self.prompt_logprobs is not None and self.stream:  # as vLLM
            raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")
        if self.stream_options is not None and self.stream_options.given and not self.stream:  # as vLLM
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.use_beam_search:
            for name, neutral in BEAM_SEARCH_CONFLICTS.items():
                if getattr(self, name, None) not in (None, *neutral):
                    raise bad_request(f"{name} cannot be used with use_beam_search, which ranks beams by "
                                      "the model's log-probabilities alone", name)
        elif self.length_penalty != 1.0:
            raise bad_request("length_penalty applies only with use_beam_search", "length_penalty")

    def beam_search_params(self, *, max_tokens: int, max_logprobs: int) -> BeamSearchParams:
        """vLLM's use_beam_search: `n` beams of at most `max_tokens`; a 400 naming what beam search
        cannot take (more beams than `max_logprobs` / 2). A temperature changes no beam, as in vLLM."""
        if -1 != max_logprobs < 2 * self.n:
            raise bad_request(f"use_beam_search with n={self.n} asks for {2 * self.n} logprobs per step, "
                              f"more than the server's max_logprobs ({max_logprobs})", "n")
        try:
            return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                    temperature=self.temperature or 0.0, length_penalty=self.length_penalty,
                                    include_stop_str_in_output=self.include_stop_str_in_output)
        except ValueError as error:
            raise bad_request(str(error), str(error).split(" ", 1)[0]) from error

    @property
    def usage_mode(self) -> Literal["final", "continuous"] | None:
        """How a stream reports usage: None (not asked for), "final" (a last chunk with the usage,
        every other chunk's usage null, as OpenAI documents), "continuous" (each chunk also its
        choice's usage so far: vLLM's continuous_usage_stats)."""
        options = self.stream_options
        if options is None or not options.include_usage:
            return None
        return "continuous" if options.continuous_usage_stats else "final"

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            if len(key.lstrip("0")) > 18:  # beyond every vocabulary, and int() refuses 4,300 digits
                raise bad_request(f"logit_bias key {key[:24]}... is outside the vocabulary", "logit_bias")
            bias[int(key)] = min(max(value, -100.0), 100.0)
        return bias

    def _response_format(self) -> dict[str, Any] | None:
        """response_format as structured_outputs fields (None for text)."""
        response_format = self.response_format
        if response_format is None or response_format.get("type") == "text":
            return None
        if response_format.get("type") == "json_object":
            return {"json_object": True}
        if response_format.get("type") == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
            return {"json": spec["schema"]}
        raise bad_request(f"response_format type must be text, json_object or json_schema, got "
                          f"{response_format.get('type')!r}", "response_format")

    def tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced tool call's output must follow (chat only)."""
        return None

    def _structured_fields(self) -> dict[str, Any]:
        """The fields that ask for a structured output, by name, with what each asks for."""
        tool_schema = self.tool_schema()
        return {name: value for name, value in (("tool_choice", None if tool_schema is None
                                                 else {"json": tool_schema}),
                                                ("structured_outputs", self.structured_outputs),
                                                ("guided_choice", self.guided_choice),
                                                ("guided_regex", self.guided_regex),
                                                ("guided_json", self.guided_json),
                                                ("guided_grammar", self.guided_grammar),
                                                ("response_format", self._response_format()))
                if value is not None}

    @property
    def params_named(self) -> dict[str, str]:
        """The request fields that the engine's parameters came from, where the names differ."""
        fields = list(self._structured_fields())
        return {"structured_outputs": fields[0]} if fields else {}

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """structured_outputs (or the older guided_choice / guided_regex / guided_json, or OpenAI's
        response_format) as the engine's; a 400 naming the field for what it cannot take."""
        given = self._structured_fields()
        if len(given) > 1:
            raise bad_request(f"give one of {' and '.join(given)}", list(given)[-1])
        if not given:
            return None
        [(param, value)] = given.items()
        if param in ("structured_outputs", "response_format", "tool_choice"):
            fields = value
        else:
            fields = {param.removeprefix("guided_"): value}
        known = {"choice", "json", "regex", "grammar", "json_object"}
        options = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                   "whitespace_pattern"}  # vLLM's knobs of its grammar backends, which mean nothing here
        for name in fields:
            if name not in known | options:
                raise bad_request(f"structured_outputs.{name} is not a structured output", param)
        try:
            return StructuredOutputsParams(**{name: fields.get(name) for name in known})
        except (ValueError, TypeError) as error:
            raise bad_request(str(error), param) from error

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's SamplingParams; a value it rejects is a 400 naming the parameter. The
        sampling values the request leaves unset (and max_tokens, when None) come from `defaults`
        (the model's generation config, `request.generation_config_defaults`), as in vLLM."""
        defaults = defaults or {}
        values = dict(
            n=self.n, seed=self.seed, min_tokens=self.min_tokens,
            max_tokens=defaults.get("max_tokens") if max_tokens is None else max_tokens,
            stop=() if self.stop is None else self.stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias=self._logit_bias(), allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or (), truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self._structured_outputs(),
        )
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)
        values |= {name: value if value is not None else defaults[name]
                   for name, value in optional.items() if value is not None or name in defaults}
        try:
            return SamplingParams(**values)
        except ValueError as error:
            param = str(error).split(" ", 1)[0]
            raise bad_request(str(error), param if param in values else None) from error


class CompletionRequest(GenerationBody):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(default=16, ge=0)
    """0 only with `echo`: the prompt alone, scored (vLLM's and OpenAI's legacy scoring call)."""
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    """Each choice starts with its prompt (and, with logprobs, the prompt's logprobs)."""
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True
    """vLLM's: false encodes a text prompt without the tokenizer's special tokens (BOS), for a
    prompt that already holds them."""

    def check_supported(self) -> None:
        super().check_supported()
        for name, unsupported in (("suffix", self.suffix is not None),
                                  ("best_of", self.best_of not in (None, self.n))):
            if unsupported:
                raise bad_request(f"{name} is not supported", name)
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo)", "max_tokens")

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """As for any body, except that an echo of the prompt alone (max_tokens 0) generates one
        token, which the response leaves out, and that echo with logprobs scores the prompt too
        (with `prompt_logprobs` alternatives if set, else `logprobs`, as vLLM)."""
        params = super().sampling_params(max_tokens=max(max_tokens, 1) if max_tokens is not None else None,
                                         logprobs=logprobs, defaults=defaults)
        if self.echo and logprobs is not None and params.prompt_logprobs is None:
            params = params.replace(prompt_logprobs=logprobs)
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompt or batch of prompts, each text or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            prompts = [self.prompt]
        else:
            prompts = list(self.prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise bad_request("prompt must not be empty", "prompt")
        return prompts


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str
    """A data URL (`data:image/png;base64,...`), an http(s) URL or a file URL, loaded as the
    server's media settings allow (media.py)."""
    detail: str | None = None
    """OpenAI's resolution hint; LLaVA's encoder has one resolution, so it changes nothing."""


class ImageURLPart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL | str
    """OpenAI's {"url": ...} object, or (as vLLM also takes it) the URL as a plain string."""

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class FunctionCall(_Body):
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI sends them."""


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    """system, developer, user, assistant, tool, or any other role the chat template knows (Llama
    3.1's "ipython", ...), passed to it as it is, as vLLM's custom-role messages."""
    content: str | list[TextPart | ImageURLPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant's earlier calls."""
    tool_call_id: str | None = None
    """A tool message's answer to this call."""
    reasoning: str | None = Field(default=None,
                                  validation_alias=AliasChoices("reasoning", "reasoning_content"))
    """An assistant's earlier thinking, as a reasoning parser returned it (vLLM 0.32's field; its
    older name `reasoning_content` is read too); templates see it under their own names
    (chat_template.py)."""

    def template_message(self, placeholder: str | None = None, content_parts: bool = False) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined by newlines, and a tool call's
        arguments as a dict (what transformers' tool-use templates expect, as vLLM passes them).
        An image part reads as `placeholder` (the image token's text) on a line of its own, or,
        with `content_parts` (a template that loops over a message's content), the content is a
        list of {"type": "text", "text": ...} and {"type": "image"} parts. `placeholder` None: the
        model takes no images, and an image part is a 400 naming `messages`."""
        parts = [self.content] if isinstance(self.content, str) else self.content or []
        if placeholder is None and self.image_urls:
            raise bad_request("image_url content parts need a model that takes images (a LLaVA checkpoint); "
                              "this one is text-only", "messages")
        content: str | list[dict[str, str]] = "\n".join(  # as vLLM joins them
            part if isinstance(part, str) else part.text if isinstance(part, TextPart) else placeholder
            for part in parts)
        if content_parts and self.role != "tool":
            content = [{"type": "image"} if isinstance(part, ImageURLPart)
                       else {"type": "text", "text": part if isinstance(part, str) else part.text}
                       for part in parts]
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning is not None:
            message["reasoning"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": call.type,
                 "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls]
        return message


    @property
    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        content = self.content if isinstance(self.content, list) else []
        return [part.url for part in content if isinstance(part, ImageURLPart)]


def _arguments(text: str) -> Any:
    """A call's JSON arguments, parsed; the text itself where it is no JSON. JSON nested past
    Python's stack or with an integer past int()'s 4,300 digits is a 400 (vLLM's parse of them
    fails the request too)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
    except (ValueError, RecursionError) as error:
        raise bad_request(f"a tool call's arguments {_excerpt(text)} cannot be read as JSON: "
                          f"{str(error)[:200]}", "messages") from None


def _excerpt(text: str, limit: int = 60) -> str:
    """`text` quoted, cut to about `limit` characters (a hostile one can be megabytes)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments."""
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """As vLLM: a named function or "required" makes the reply a call (its arguments, or the list of
    calls, constrained to the tools' JSON schemas); "auto", the default with tools, lets the model
    choose, which needs the server's --tool-call-parser to read its calls."""
    parallel_tool_calls: bool = True
    """False: at most one call, as vLLM (a "required" list holds one; an "auto" reply keeps its
    first)."""
    # vLLM's extensions
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    """True adds the tokenizer's special tokens (BOS) on top of those the chat template writes."""
    continue_final_message: bool = False
    """Render the final (assistant) message open, so that the reply continues it."""
    echo: bool = False
    """Start each reply with the final message's content when the reply continues it (vLLM's
    chat echo: the final message is the assistant's, or add_generation_prompt is false)."""
    chat_template: str | None = None
    """A Jinja chat template for this request instead of the model's (vLLM's; the server must
    trust request templates: --trust-request-chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the template (e.g. Qwen 3's enable_thinking), overriding the named ones,
    as vLLM's."""
    documents: list[dict[str, Any]] | None = None
    """Documents for retrieval-augmented templates (the template's `documents`)."""
    include_reasoning: bool = True
    """False: with the server's --reasoning-parser, the reply's reasoning is left out (its content
    is still the answer alone), as vLLM's."""

    def check_supported(self) -> None:
        super().check_supported()
        self._check_tools()
        if self.add_generation_prompt and self.continue_final_message:  # as vLLM
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true "
                              "(set add_generation_prompt to false)", "continue_final_message")
        if self.top_logprobs and not self.logprobs:  # as vLLM, which takes 0 without logprobs
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        reserved = RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {})
        if reserved:
            raise bad_request(f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}",
                              "chat_template_kwargs")

    def _check_tools(self) -> None:
        """vLLM's rules: tool_choice needs tools, a named one must be among them, and a forced call
        is no structured output (the server checks that "auto" has a parser)."""
        choice = self.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice == "none":
            return
        if not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        names = {tool.function.name for tool in self.tools}
        if len(names) < len(self.tools):
            seen = [tool.function.name for tool in self.tools]
            twice = next(name for name in seen if seen.count(name) > 1)
            raise bad_request(f"tools name the function {twice!r} more than once", "tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                              "tool_choice")
        if choice == "auto":
            return
        for name in ("structured_outputs", "guided_choice", "guided_regex", "guided_json", "guided_grammar"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} cannot be used with tool_choice {choice!r}", name)
        if self._response_format() is not None:
            raise bad_request("response_format cannot be used with a tool_choice", "response_format")

    @property
    def tool_mode(self) -> Literal["named", "required", "auto"] | None:
        """How the reply may be a tool call: "named" (its arguments), "required" (a list of calls),
        "auto" (the model's choice, in its own format), or None (text)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if not self.tools or self.tool_choice == "none":
            return None
        return "required" if self.tool_choice == "required" else "auto"

    @property
    def forced_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced call's output must follow (vLLM's): a named function's
        parameters, or for "required" a non-empty list of {"name", "parameters"} objects, one of
        the tools each."""
        def parameters(tool: Tool) -> dict[str, Any]:
            return tool.function.parameters or {"type": "object", "properties": {}}

        if self.tool_mode == "named":
            [tool] = [t for t in self.tools if t.function.name == self.forced_function]
            return parameters(tool)
        if self.tool_mode == "required":
            # Each tool's definitions move to the root, where its "#/$defs/..." references point
            # (as vLLM does; pydantic's schemas use them); two tools may share one only if equal.
            definitions: dict[str, dict[str, Any]] = {}
            calls = []
            for tool in self.tools:
                tool_parameters = dict(parameters(tool))
                for key in ("$defs", "definitions"):
                    if not isinstance(tool_parameters.get(key), dict):
                        continue
                    for name, definition in tool_parameters.pop(key).items():
                        if definitions.setdefault(key, {}).setdefault(name, definition) != definition:
                            raise bad_request(f"two tools define {key}/{name} differently; a required "
                                              "tool_choice puts all tools' definitions in one schema",
                                              "tools")
                calls.append({"type": "object", "required": ["name", "parameters"], "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]}, "parameters": tool_parameters}})
            at_most_one = {} if self.parallel_tool_calls else {"maxItems": 1}
            return {"type": "array", "minItems": 1, **at_most_one, "items": {"anyOf": calls}, **definitions}
        return None

    def template_arguments(self) -> dict[str, Any]:
        """What apply_chat_template takes besides the messages, as vLLM merges them: the named
        arguments, then chat_template_kwargs over them."""
        arguments = {"add_generation_prompt": self.add_generation_prompt,
                     "continue_final_message": self.continue_final_message, "tools": self.template_tools(),
                     "chat_template": self.chat_template}
        if self.documents is not None:
            arguments["documents"] = self.documents
        return arguments | (self.chat_template_kwargs or {})

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (OpenAI's dicts)."""
        return None if not self.tools else [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def echoed_text(self) -> str:
        """What echo puts before each reply: the final message's content, when the reply continues
        that message's role ("" otherwise, or without echo)."""
        final = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and final.role != "assistant"):
            return ""
        return final.template_message()["content"]

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, or the older max_tokens; None means up to the context length."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field max_new_tokens came from, for errors that name it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per position the engine must return (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a prompt's ids, or a chat's as the chat route renders it (the chat
    fields are those of ChatCompletionRequest, which validates them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None
    """Add the tokenizer's special tokens (BOS, ...): by default to a prompt, and not to a chat,
    whose template writes its own (vLLM's defaults)."""
    return_token_strs: bool = False
    """Also return each id's vocabulary string."""

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give one of prompt and messages", "prompt")


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): the text of token ids."""

    model: str | None = None
    tokens: TokenIds


class EmbeddingRequest(_Body):
    """POST /v1/embeddings (OpenAI's), with vLLM's extensions."""

    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    """A text, texts, token ids, or lists of them: one embedding each."""
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each embedding as its little-endian float32 bytes, base64-encoded (as OpenAI's)."""
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    """Which end truncate_prompt_tokens cuts (vLLM's; default "right", keeping the first tokens, as
    vLLM's pooling runner)."""
    add_special_tokens: bool = True
    use_activation: bool | None = None
    """L2-normalise the embeddings (None: the model's default)."""
    normalize: bool | None = None
    """Older vLLM's name of use_activation: refused as vLLM 0.32 refuses it, not ignored."""
    priority: int = 0
    cache_salt: str | None = None
    """vLLM's, which the pooling engine does not take: other than their defaults, a 400 rather
    than ignored."""
    embed_dtype: str | None = None
    endianness: str | None = None
    """vLLM's base64 layouts (a float response ignores them, as vLLM's): only its defaults
    (float32, native = little-endian here) are served; another is a 400 rather than vectors a
    client would misread."""

    def check_supported(self) -> None:
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must not be empty", "input")
        if self.truncate_prompt_tokens == 0:
            raise bad_request("truncate_prompt_tokens must be >= 1, or -1 for the context length",
                              "truncate_prompt_tokens")
        checks = [("priority", (0,)), ("cache_salt", ())]
        if self.encoding_format == "base64":  # vLLM applies the layouts to base64 alone
            checks += [("embed_dtype", ("float32",)), ("endianness", ("native", "little"))]
        for name, served in checks:
            value = getattr(self, name)
            if value not in (None, *served):
                only = f"only {', '.join(map(repr, served))}" if served else "the pooling engine takes none"
                raise bad_request(f"{name} {value!r} is not supported for embeddings ({only})", name)
        if self.normalize is not None:
            raise bad_request("normalize was removed (as in vLLM); use use_activation instead", "normalize")

    def inputs(self) -> list[str | list[int]]:
        """One prompt per embedding."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, use_activation=self.use_activation)


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's; served with VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    """vLLM's reload under a name already taken: refused, not ignored (unload, then load)."""

    def check_supported(self) -> None:
        if self.load_inplace:
            raise bad_request("load_inplace is not supported: unload the adapter, then load it again",
                              "load_inplace")


class UnloadLoRAAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's): the adapter by name, or by the id the server gave it."""

    lora_name: str | None = None
    lora_int_id: int | None = None

    def check_supported(self) -> None:
        if self.lora_name is None and self.lora_int_id is None:
            raise bad_request("give the adapter's lora_name (or its lora_int_id)", "lora_name")


def parse_body(model: type[_Body], body: bytes) -> Any:
    """The body as `model`, or a 400 saying what is wrong with it."""
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise validation_error(error) from None


def validation_error(error: ValidationError) -> APIError:
    """A 400 for the first problem pydantic found. Alternatives of one union field (stop: a string
    or a list of strings) each report an error; they are summed up in one message."""
    errors = error.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}")
    if not first["loc"]:
        return bad_request(f"the request body must be a JSON object: {first['msg']}")
    param = str(first["loc"][0])
    same_field = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    if len(same_field) > 1 and first["type"] != "missing":
        where = ".".join(str(part) for part in os.path.commonprefix([e["loc"] for e in same_field]))
        reasons = "; ".join(dict.fromkeys(e["msg"] for e in same_field))
        return bad_request(f"{where} has the wrong type or value ({reasons})", param)
    where = ".".join(str(part) for part in first["loc"])
    return bad_request(f"{where}: {first['msg']}", param)


# ---- the Responses API: POST /v1/responses ----------------------------------------------------

RESPONSE_INCLUDABLE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", "message.output_text.logprobs",
})
"""OpenAI's `include` values. Only the output text's logprobs ask this server for something (the
others name outputs of built-in tools and reasoning items it never produces)."""
OUTPUT_LOGPROBS = "message.output_text.logprobs"
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
INSTRUCTION_ROLES = ("system", "developer")
"""Roles of the messages that truncation "auto" always keeps."""
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's limits on a response's metadata."""
FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for the name of a json_schema text format."""
VERBOSITIES = ("low", "medium", "high")
TRUNCATION_OUTPUT_TOKENS = 4096
"""With truncation "auto" and no max_output_tokens, the room the kept input leaves for the output
(at most half the context)."""
RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens", "response_format": "text", "logprobs": "top_logprobs"}
"""Chat request fields -> the Responses field they were built from, for the errors of the chat
request a Responses request becomes (`ResponsesRequest.errors_named`)."""


class Reasoning(_Body):
    """OpenAI's reasoning options; other keys are ignored."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses (OpenAI's Responses API) for text models, with vLLM's extensions. Its input
    items become a chat (`chat_request`), so that the chat route's template, sampling, tool calls and
    structured outputs answer it. As vLLM by default, nothing is stored: `store` is ignored (echoed
    false), a `previous_response_id` is never found, and `background` (which needs the store) is a 400;
    a server started with VLLM_ENABLE_RESPONSES_API_STORE stores them (`check_store`)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    """A user message's text, or items: messages (roles user, system, developer, assistant; content
    a string or input_text / output_text parts), function_call and function_call_output."""
    instructions: str | None = None
    """A system message before the input."""
    max_output_tokens: int | None = Field(default=None, ge=1)
    """At most this many tokens, and at most what the context leaves after the input (as vLLM)."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """Alternatives per output token, with `include` ["message.output_text.logprobs"] (as vLLM)."""
    include: list[str] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    """Function tools, in the Responses' flat shape: {"type": "function", "name", "parameters", ...}."""
    tool_choice: str | dict[str, Any] | None = None
    """"none", "auto" (the default with tools), "required" or {"type": "function", "name": ...}."""
    text: dict[str, Any] | None = None
    """{"format": {"type": "text"}}, {"format": {"type": "json_object"}} or {"format": {"type":
    "json_schema", "name": ..., "schema": {...}, "strict": ...}}: a structured output; and
    "verbosity" (low, medium, high), only echoed."""
    parallel_tool_calls: bool = True
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    """"auto" drops the input's first items until the rest leaves room for the output
    (`truncated_messages`); "disabled" makes a too-long input a 400."""
    reasoning: Reasoning | None = None
    """{"effort": ...}: the effort reaches the chat template as `reasoning_effort` (as vLLM)."""
    background: bool = False
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    max_tool_calls: int | None = Field(default=None, ge=1)
    """OpenAI's bound on calls of built-in tools, of which this server has none."""
    prompt: dict[str, Any] | None = None
    """OpenAI's stored prompt templates: refused, as vLLM."""
    prompt_cache_key: str | None = None
    """Ignored, as vLLM."""
    # vLLM's extensions
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    top_k: int | None = Field(default=None, ge=-1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)
    cache_salt: str | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    """False: with the server's --reasoning-parser, the Response has no reasoning item (vLLM's)."""

    def check_supported(self) -> None:
        """vLLM's refusal of a stored prompt and the checks the chat request cannot make in the
        Responses' terms (those of the store's fields are `check_store`'s)."""
        if self.prompt is not None:
            raise bad_request("prompt templates are not supported", "prompt")
        if not self.input:  # "" or []
            raise bad_request("input must not be empty", "input")
        for value in self.include or ():
            if value not in RESPONSE_INCLUDABLE:
                raise bad_request(f"include {_excerpt(value)} is not one of "
                                  f"{', '.join(sorted(RESPONSE_INCLUDABLE))}", "include")
        self._check_metadata()
        self._check_text()

    def _check_metadata(self) -> None:
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_PAIRS:
            raise bad_request(f"metadata has {len(metadata)} pairs, more than {MAX_METADATA_PAIRS}",
                              "metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise bad_request(f"metadata key {_excerpt(key)} or its value is too long (keys hold at most "
                                  f"{MAX_METADATA_KEY_CHARS} characters, values {MAX_METADATA_VALUE_CHARS})",
                                  "metadata")

    def _check_text(self) -> None:
        """OpenAI's rules for text: a known verbosity, and a format of a known type; a json_schema
        one with a name of OpenAI's pattern, an object schema and a boolean strict."""
        text = self.text or {}
        verbosity = text.get("verbosity")
        if verbosity is not None and verbosity not in VERBOSITIES:
            raise bad_request(f"text.verbosity must be one of {', '.join(VERBOSITIES)}, got "
                              f"{_shown(verbosity)}", "text")
        spec = text.get("format")
        if spec is None:
            return
        if not isinstance(spec, dict):
            raise bad_request(f'text.format must be an object such as {{"type": "json_object"}}, got '
                              f"{_shown(spec)}", "text")
        kind = spec.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise bad_request("text.format.type must be text, json_object or json_schema, got "
                              f"{_shown(kind)}", "text")
        if kind != "json_schema":
            return
        name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
        if not isinstance(name, str) or not FORMAT_NAME.fullmatch(name):
            raise bad_request("text.format.name must be 1 to 64 letters, digits, underscores or dashes, got "
                              f"{_shown(name)}", "text")
        if not isinstance(schema, dict):
            raise bad_request(f"text.format.schema must be an object (a JSON schema), got {_shown(schema)}",
                              "text")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"text.format.strict must be true or false, got {_shown(strict)}", "text")

    def check_store(self, enabled: bool) -> None:
        """Without the server's store (`enabled` False), vLLM's answers: background is a 400 and a
        previous response is never found. With it, background needs `store` (as OpenAI)."""
        if not enabled:
            if self.background:
                raise bad_request("background needs store, which this server does not offer (as vLLM "
                                  "without VLLM_ENABLE_RESPONSES_API_STORE)", "background")
            if self.previous_response_id is not None:
                raise response_not_found(self.previous_response_id, "previous_response_id")
            return
        if self.background and not self.store:
            raise bad_request("background needs store true (a background response is read back from the "
                              "store)", "background")
        if self.previous_response_id is not None and not self.previous_response_id.startswith("resp_"):
            raise response_not_found(self.previous_response_id, "previous_response_id")

    def conversation(self, dropped_users: int = 0) -> list[dict[str, Any]]:
        """The input as items (a string is one user message), without the instructions: what a later
        request naming this one's response as its previous_response_id continues from. Where truncation
        "auto" dropped the chat's first `dropped_users` user messages (and what followed each up to the
        next), only the items rendered: the system and developer ones, and those from the first user
        message kept (a user message is one item), so that a chain's stored history stays within the
        context however long the chain."""
        items = ([{"type": "message", "role": "user", "content": self.input}] if isinstance(self.input, str)
                 else self.input)
        if dropped_users == 0:
            return items
        users = [index for index, item in enumerate(items) if _message_role(item) == "user"]
        return [item for index, item in enumerate(items)
                if index >= users[dropped_users] or _message_role(item) in INSTRUCTION_ROLES]

    def continuing(self, history: list[dict[str, Any]]) -> ResponsesRequest:
        """This request with the `history` of a previous response (its conversation, then its
        output items) before its input. The previous instructions are not carried over (as OpenAI
        documents): this request's own, if any, lead the chat."""
        return self.model_copy(update={"input": [*history, *self.conversation()]})

    @property
    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())

    def output_reserve(self, max_model_len: int) -> int:
        """The tokens truncation "auto" leaves the output: max_output_tokens (or
        TRUNCATION_OUTPUT_TOKENS), but at most half the context, so that a large max_output_tokens
        never cuts the input to nothing."""
        return min(self.max_output_tokens or TRUNCATION_OUTPUT_TOKENS, max_model_len // 2)

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request that answers this one, whole (truncation "auto" is the
        server's: it needs the rendered length). Its 400s name the chat's fields; `errors_named`
        renames them. Built from Python values (no JSON round trip), off the event loop: an input
        may hold thousands of items."""
        chat: dict[str, Any] = {
            "model": self.model, "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens, "logprobs": self.wants_logprobs,
            "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
            "response_format": self._response_format(), "parallel_tool_calls": self.parallel_tool_calls,
            "chat_template_kwargs": self._template_kwargs(),
        }
        for name in ("temperature", "top_p", "seed", "user", "top_k", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "stop", "ignore_eos", "skip_special_tokens",
                     "include_stop_str_in_output", "logit_bias", "priority", "cache_salt",
                     "structured_outputs", "include_reasoning"):
            chat[name] = getattr(self, name)
        if self.tools:
            chat["tools"] = [_chat_tool(index, tool) for index, tool in enumerate(self.tools)]
        chat["tool_choice"] = self._chat_tool_choice()
        try:
            request = ChatCompletionRequest.model_validate(chat)
        except ValidationError as error:
            raise validation_error(error) from None
        request.check_supported()
        return request

    @contextlib.contextmanager
    def errors_named(self) -> Iterator[None]:
        """Re-raise a 400 of the chat request built from this one under the Responses field it came
        from and in its words: text.format for response_format, tools for a tool's parameters
        schema (the chat route names its tool_choice), structured_outputs for itself."""
        try:
            yield
        except APIError as error:
            param = error.param
            if param == "tool_choice" and error.message.startswith("structured_outputs"):
                param = "tools"
            where = {"response_format": "text.format.schema", "tools": "the tools' parameters"}.get(param)
            if where is not None:
                error.message = error.message.replace("structured_outputs.json", where)
            error.message = error.message.replace("response_format", "text.format")
            error.param = RESPONSES_PARAMS.get(param, param)
            raise

    def _messages(self) -> list[dict[str, Any]]:
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for index, item in enumerate(self.input):
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                message, previous = _message(index, item), messages[-1] if messages else {}
                if message["role"] == "assistant" and _thinking_only(previous):
                    previous["content"] = message["content"]  # one turn: its reasoning, then its text
                else:
                    messages.append(message)
            elif kind == "reasoning":
                reasoning = _reasoning_text(index, item)
                messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
            elif kind == "function_call":
                function = {"name": _item_text(index, item, "name"),
                            "arguments": _item_text(index, item, "arguments")}
                call = {"id": _item_text(index, item, "call_id"), "type": "function", "function": function}
                previous = messages[-1] if messages else {}
                if previous.get("role") == "assistant":  # one turn: its text and calls, as OpenAI's output
                    previous.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                content = (_parts(index, output) if isinstance(output, list)
                           else _item_text(index, item, "output"))
                messages.append({"role": "tool", "tool_call_id": _item_text(index, item, "call_id"),
                                 "content": content})
            else:
                raise bad_request(f"input[{index}] has type {_excerpt(str(kind))}; this server takes "
                                  "message, reasoning, function_call and function_call_output items", "input")
        return messages

    def _response_format(self) -> dict[str, Any] | None:
        """text.format (checked by `_check_text`) as chat's response_format (None for text)."""
        spec = (self.text or {}).get("format") or {"type": "text"}
        if spec["type"] == "text":
            return None
        if spec["type"] == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": spec["name"], "schema": spec["schema"]}}

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or (choice == "auto" and not self.tools):  # as vLLM: "auto" without tools is "none"
            return None
        if isinstance(choice, str):
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice must be none, auto, required or {"type": "function", "name": ...} '
                              "(this server serves function tools)", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}

    def _template_kwargs(self) -> dict[str, Any] | None:
        if self.reasoning is None or self.reasoning.effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning.effort} | (self.chat_template_kwargs or {})

    def settings(self, params: SamplingParams, *, store_enabled: bool = False) -> dict[str, Any]:
        """The request's settings as a Response echoes them; temperature and top_p as sampled, and
        `store` and previous_response_id as they are honoured (`store_enabled`: the server's store)."""
        text = {"format": (self.text or {}).get("format") or {"type": "text"}}
        if (self.text or {}).get("verbosity") is not None:
            text["verbosity"] = self.text["verbosity"]
        reasoning = None if self.reasoning is None else self.reasoning.model_dump()
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls, "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id if store_enabled else None,
            "reasoning": reasoning, "service_tier": self.service_tier, "store": self.store and store_enabled,
            "background": self.background,
            "temperature": params.temperature, "top_p": params.top_p, "top_logprobs": self.top_logprobs or 0,
            "text": text, "tools": self.tools or [],
            "tool_choice": "auto" if self.tool_choice is None else self.tool_choice,  # as sent, as vLLM
            "truncation": self.truncation, "user": self.user,
        }


def _message(index: int, item: dict[str, Any]) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in MESSAGE_ROLES:
        raise bad_request(f"input[{index}] has role {_excerpt(str(role))}; a message's role is one of "
                          f"{', '.join(MESSAGE_ROLES)}", "input")
    if isinstance(content, list):
        return {"role": role, "content": _parts(index, content, images=role != "assistant")}
    if not isinstance(content, str):
        raise bad_request(f"input[{index}].content must be a string or a list of input_text parts", "input")
    return {"role": role, "content": content}


def _thinking_only(message: dict[str, Any]) -> bool:
    """Whether a message is an assistant turn with reasoning so far only (a reasoning item's)."""
    return (message.get("role") == "assistant" and message.get("reasoning") is not None
            and message.get("content") is None and not message.get("tool_calls"))


def _reasoning_text(index: int, item: dict[str, Any]) -> str:
    """A reasoning item's text: its reasoning_text content, or else its summary (as vLLM reads it);
    an encrypted one is refused (nothing here could read it)."""
    if item.get("encrypted_content"):
        raise bad_request(f"input[{index}] is a reasoning item with encrypted_content, which this server "
                          "cannot read; send its content instead", "input")
    for key in ("content", "summary"):
        parts = item.get(key) or []
        texts = [part.get("text") if isinstance(part, dict) else None for part in parts] if isinstance(
            parts, list) else [None]
        if not all(isinstance(text, str) for text in texts):
            raise bad_request(f"input[{index}] (reasoning) needs {key} as a list of parts with a text",
                              "input")
        if texts:
            return "\n".join(texts)
    return ""


def _parts(index: int, parts: list[Any], images: bool = False) -> list[dict[str, Any]]:
    """input_text / output_text parts as chat's text parts, and (`images`: a message other than
    the assistant's) input_image parts as its image_url parts."""
    chat_parts: list[dict[str, Any]] = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if images and kind == "input_image":
            chat_parts.append(_image_part(index, part))
            continue
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            takes = "input_text, output_text and input_image" if images else "input_text and output_text"
            raise bad_request(f"input[{index}] has a content part of type {_excerpt(str(kind))}; this server "
                              f"takes {takes} parts here", "input")
        chat_parts.append({"type": "text", "text": part["text"]})
    return chat_parts


def _image_part(index: int, part: dict[str, Any]) -> dict[str, Any]:
    """An input_image part ({"image_url": URL, "detail": ...}) as chat's image_url part."""
    if part.get("file_id") is not None:
        raise bad_request(f"input[{index}] has an input_image with a file_id; this server has no Files API: "
                          "send the image as its image_url (a data, http(s) or file URL)", "input")
    url, detail = part.get("image_url"), part.get("detail")
    if not isinstance(url, str):
        raise bad_request(f"input[{index}] has an input_image without an image_url string", "input")
    if detail not in (None, "auto", "low", "high"):
        raise bad_request(f"input[{index}] has an input_image whose detail is {_excerpt(str(detail))}; "
                          "it is auto, low or high", "input")
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def _item_text(index: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input[{index}] ({item.get('type')}) needs {key} as a string", "input")
    return value


def _chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (flat) as chat's ({"type": "function", "function": {...}}),
    checked here so that its 400s name the Responses' shape (tools[0].name)."""
    if tool.get("type") != "function":
        raise bad_request(f"tools[{index}] has type {_excerpt(str(tool.get('type')))}; this server serves "
                          "function tools", "tools")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"tools[{index}].name must be a non-empty string, got {_shown(name)}", "tools")
    for key, kind, what in (("description", str, "a string"), ("strict", bool, "true or false"),
                            ("parameters", dict, "an object (a JSON schema)")):
        if tool.get(key) is not None and not isinstance(tool[key], kind):
            raise bad_request(f"tools[{index}].{key} must be {what}, got {_shown(tool[key])}", "tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                if tool.get(key) is not None}
    return {"type": "function", "function": function}


def response_not_found(response_id: str, param: str = "response_id") -> APIError:
    """vLLM's answer for a response id while it stores none: a 400 for an id that is no response's
    (not "resp_..."), else a 404."""
    if not response_id.startswith("resp_"):
        return bad_request(f"Invalid '{param}': {_excerpt(response_id)}. Expected an ID that begins with "
                           "'resp'.", param)
    return APIError(404, f"Response with id {_excerpt(response_id)} not found.", param=param)


def _shown(value: Any, limit: int = 60) -> str:
    """A JSON value as the request wrote it, cut to about `limit` characters."""
    text = json.dumps(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _message_role(item: dict[str, Any]) -> str | None:
    """The role of an input item that is a message (as `ResponsesRequest._messages` reads it), else None."""
    return item.get("role") if item.get("type", "message" if "role" in item else None) == "message" else None


def truncated_messages(messages: list[ChatMessage],
                       fits: Callable[[list[ChatMessage]], bool]) -> list[ChatMessage]:
    """truncation "auto", as OpenAI documents it and vLLM does: the chat less the fewest leading
    messages that make it `fits`, keeping every system and developer message (the instructions).
    The kept chat starts, after those, with a user message (a template may insist on it) and keeps
    the call of every tool result it keeps. Where even the shortest such chat does not fit, that
    one (the context check then judges it). The rendered length falls as messages are dropped, so
    the cut is found by bisection: a few renders, not one per message."""
    if fits(messages):
        return messages
    cuts = _cuts(messages)
    if not cuts:
        return messages

    def kept(cut: int) -> list[ChatMessage]:
        return [m for index, m in enumerate(messages) if index >= cut or m.role in INSTRUCTION_ROLES]

    low, high = -1, len(cuts) - 1  # kept(cuts[high]) fits; kept(cuts[low]) (the whole at -1) does not
    if not fits(kept(cuts[high])):
        return kept(cuts[high])
    while high - low > 1:
        middle = (low + high) // 2
        if fits(kept(cuts[middle])):
            high = middle
        else:
            low = middle
    return kept(cuts[high])


def _cuts(messages: list[ChatMessage]) -> list[int]:
    """The indices where truncation may cut (dropping the non-instruction messages before them, of
    which there is one at least): at a user message, past which no tool result answers a call
    before it."""
    call_index = {call.id: index for index, message in enumerate(messages)
                  for call in message.tool_calls or ()}
    last_answer: dict[int, int] = {}  # a call's message -> the last tool result answering it
    for index, message in enumerate(messages):
        if message.role == "tool" and message.tool_call_id in call_index:
            last_answer[call_index[message.tool_call_id]] = index
    cuts, reach, drops = [], -1, False  # reach: the last answer to a call before the cut
    for cut in range(1, len(messages)):
        reach = max(reach, last_answer.get(cut - 1, -1))
        drops = drops or messages[cut - 1].role not in INSTRUCTION_ROLES
        if drops and reach < cut and messages[cut].role == "user":
            cuts.append(cut)
    return cuts
