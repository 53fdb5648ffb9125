"""Chat templates rendered exactly as Hugging Face transformers renders them.

Templates are untrusted Jinja code from a model directory, so they run in an immutable sandbox
and only ever see plain JSON values. The environment matches transformers': `trim_blocks`,
`lstrip_blocks`, loop controls, `{% generation %}` blocks, a `raise_exception` global,
`strftime_now` and a `tojson` filter that keeps non-ASCII text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


RESERVED_TEMPLATE_KWARGS = frozenset({"tokenize", "return_dict", "messages", "conversation"})
"""Arguments of apply_chat_template that chat_template_kwargs may not set: they would override
the call's own (the messages rendered, the kind of result)."""


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a template source in the sandboxed environment transformers uses."""
    return _jinja_environment().from_string(source)


_CONTINUE_MARK = "SLIPSTREAM_CONTINUE_FINAL_MESSAGE "
"""Appended to the final message under `continue_final_message` to find where it ends once
rendered; the trailing space shows whether the template trimmed it. Letters and underscores only
(as transformers' tag), so that a template quoting the content (`| tojson`) leaves it as it is."""


def render_chat_template(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` (validated: each a dict with a string role and content) to text.

    The template sees `messages`, `tools`, `documents` (None unless passed),
    `add_generation_prompt`, the named special tokens (`bos_token`, ...) and `kwargs`. With
    `continue_final_message` the text ends where the final message's content does (what the
    template writes after it, such as an end-of-turn token, is cut), so that generation continues
    that message, as transformers does; a template that trims the content trims it here too.
    """
    variables = {"documents": None, **(special_tokens or {}), **_plain(kwargs, "kwargs")}
    messages = _validated_messages(messages)
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message needs a final message with string content")
        messages[-1] = messages[-1] | {"content": messages[-1]["content"] + _CONTINUE_MARK}
    variables.update(messages=messages, tools=_plain_tools(tools),
                     add_generation_prompt=add_generation_prompt)
    text = template.render(**variables)
    if not continue_final_message:
        return text
    end = text.rfind(_CONTINUE_MARK.rstrip())
    if end < 0:
        raise ValueError("continue_final_message is set, but the chat template does not write the final "
                         "message's content, so there is nothing to continue")
    kept_spacing = text.startswith(_CONTINUE_MARK, end)
    return text[:end] if kept_spacing else text[:end].rstrip()


class _GenerationTag(jinja2.ext.Extension):
    """Parses `{% generation %}...{% endgeneration %}` (used by training templates) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Unlike Jinja's built-in filter, does not HTML-escape and keeps non-ASCII text as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _jinja_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (templates are untrusted code)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _validated_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as plain dicts without None values (as transformers passes them to templates)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
    validated = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be a dict, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        has_content = isinstance(message.get("content"), str) or (
            "content" not in message and "tool_calls" in message
        )
        if not isinstance(message.get("role"), str) or not has_content:
            raise ValueError(
                f"messages[{index}] must have a string 'role' and a string 'content' "
                f"(or 'tool_calls'), got {message!r}"
            )
        validated.append(_plain(_alias_reasoning(message), f"messages[{index}]"))
    return validated


# Names a message's reasoning text goes by; templates read "reasoning_content" (Qwen) or
# "thinking" (gpt-oss), so transformers 5 fills both from whichever is given.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain_tools(tools: Any) -> list[Any] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(tool, Mapping) for tool in tools):
        raise ValueError(f"tools must be a list of JSON-schema dicts, got {tools!r}")
    return _plain(list(tools), "tools")


def _plain(value: Any, where: str) -> Any:
    """A copy of `value` made of JSON types only, so templates never touch arbitrary objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item, where) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item, where) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item, where) for item in value)
    raise TypeError(f"{where} may only hold JSON values, got {type(value).__name__}: {value!r}")
