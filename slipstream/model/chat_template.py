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


RESERVED_TEMPLATE_KWARGS = frozenset({"tokenize", "return_dict", "messages", "conversation", "content_parts"})
"""Arguments of apply_chat_template that chat_template_kwargs may not set: they would override
the call's own (the messages rendered, the kind of result, the form of their content)."""


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a template source in the sandboxed environment transformers uses."""
    return _jinja_environment().from_string(source)


def template_content_format(source: str) -> str:
    """"openai" where the template loops over a message's content (it expects a list of
    {"type": ..., ...} parts, as multimodal templates do), else "string": what vLLM's
    chat_template_content_format="auto" detects. Like vLLM's, it follows `messages` through
    assignments (`{% set loop_messages = messages[1:] %}`), filters and slices to the loops over
    them, and counts a loop over `<message>.content`, over a variable named `content` (outside a
    macro) or, in a macro, over a parameter that a call passes a message's content. A template
    that does not parse is "string" (rendering then reports the error)."""
    try:
        tree = _jinja_environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    lists = _names_bound_to(tree, "messages")
    items = {loop.target.name for loop in tree.find_all(jinja2.nodes.For)
             if isinstance(loop.target, jinja2.nodes.Name) and any(_reads(loop.iter, name) for name in lists)}

    def is_content(node: jinja2.nodes.Node) -> bool:
        return any(_reads(node, name, "content") for name in items)

    in_macros: set[int] = set()
    for macro in tree.find_all(jinja2.nodes.Macro):  # a macro whose parameter gets a message's content
        params = [arg.name for arg in macro.args]
        content_params = set()
        for call in tree.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                passed = [*zip(params, call.args, strict=False), *((kw.key, kw.value) for kw in call.kwargs)]
                content_params.update(name for name, arg in passed if name in params and is_content(arg))
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in content_params:
                return "openai"
    for loop in tree.find_all(jinja2.nodes.For):
        if is_content(loop.iter) or (id(loop) not in in_macros and _reads(loop.iter, "content")):
            return "openai"
    return "string"


def _names_bound_to(tree: jinja2.nodes.Template, name: str) -> set[str]:
    """`name` and every variable a `{% set %}` binds to it (or to a slice or filter of it), transitively."""
    names, pending = {name}, [name]
    while pending:
        source = pending.pop()
        for assign in tree.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (isinstance(target, jinja2.nodes.Name) and target.name not in names
                    and _reads(assign.node, source)):
                names.add(target.name)
                pending.append(target.name)
    return names


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` is the variable `name` (its `key` item or attribute, when given), possibly
    sliced, filtered or tested."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
        if node.node is None:
            return False
        node = node.node
    if key is not None:
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == key:
            node = node.node
        elif (isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
              and node.arg.value == key):
            node = node.node
        else:
            return False
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


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
    content_parts: bool = False,
    **kwargs: Any,
) -> str:
    """Render `messages` (validated: each a dict with a string role and content; with
    `content_parts`, content may also be a list of OpenAI content parts, for templates that loop
    over it: what `LLM.chat` passes for chat_template_content_format "openai") to text.

    The template sees `messages`, `tools`, `documents` (None unless passed),
    `add_generation_prompt`, the named special tokens (`bos_token`, ...) and `kwargs`. With
    `continue_final_message` the text ends where the final message's content does (what the
    template writes after it, such as an end-of-turn token, is cut), so that generation continues
    that message, as transformers does; a template that trims the content trims it here too.
    """
    variables = {"documents": None, **(special_tokens or {}), **_plain(kwargs, "kwargs")}
    messages = _validated_messages(messages, content_parts)
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


MAX_REPEATED_LENGTH = 2**24
"""The longest string or list a template may build by repeating one (`'x' * n`), and the most bits
of a power's result (`10 ** n`): the sandbox bounds `range` (to 100,000) but not these, and a
request's `{{ 'x' * 10**10 }}` took the server's memory."""


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with repetition and powers bounded (MAX_REPEATED_LENGTH)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if (isinstance(sequence, (str, list, tuple)) and isinstance(count, int)
                        and len(sequence) * count > MAX_REPEATED_LENGTH):
                    raise jinja2.sandbox.SecurityError(
                        f"repeating a sequence of {len(sequence):,} {count:,} times passes the "
                        f"{MAX_REPEATED_LENGTH:,} items a template may build")
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
              and right * abs(left).bit_length() > MAX_REPEATED_LENGTH):
            raise jinja2.sandbox.SecurityError(f"{left} ** {right} passes the {MAX_REPEATED_LENGTH:,} bits "
                                               "a template's number may have")
        return super().call_binop(context, operator, left, right)


def _jinja_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (templates are untrusted code), with
    repetition and powers bounded."""
    env = _ChatTemplateEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _validated_messages(messages: Any, content_parts: bool) -> list[dict[str, Any]]:
    """Messages as plain dicts without None values (as transformers passes them to templates)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
    validated = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be a dict, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        content = message.get("content")
        has_content = isinstance(content, str) or (content_parts and _is_parts(content)) or (
            "content" not in message and "tool_calls" in message
        )
        if not isinstance(message.get("role"), str) or not has_content:
            raise ValueError(
                f"messages[{index}] must have a string 'role' and a string 'content' "
                f"(or 'tool_calls'), got {message!r}"
            )
        validated.append(_plain(_alias_reasoning(message), f"messages[{index}]"))
    return validated


def _is_parts(content: Any) -> bool:
    """Whether `content` is a list of OpenAI content parts (dicts with a string "type"), which
    templates that loop over a message's content read."""
    return isinstance(content, (list, tuple)) and all(
        isinstance(part, Mapping) and isinstance(part.get("type"), str) for part in content)


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
