"""JSON schemas as regular expressions, for structured outputs. Plain Python.

`schema_regex(schema)` writes a regular expression (`fsm.py`'s syntax) whose every match is a
JSON text valid under the schema, in the manner of outlines' `build_regex_from_schema`: objects
list their declared properties in order (required ones always, optional ones when the model
chooses), with at most one space around `:` and `,`; `json_object_regex()` matches any JSON object.
A regular expression cannot count nesting, so values the schema leaves open (`{}`, `true`, an
object without `properties`, `json_object`) nest at most `MAX_OPEN_DEPTH` levels, and a recursive
schema is unrolled `MAX_REF_DEPTH` `$ref`s deep: below that, the optional properties, array items
and `anyOf` options that would recurse further are left out (a tree whose leaves have no
children); a required one is a ValueError.

Validation keywords whose limits a regular expression cannot hold or this module does not write
(numeric bounds, `uniqueItems`, `patternProperties`, `not`, ...) are a ValueError naming them,
rather than an output the schema would reject. Annotations (`title`, `description`, `default`,
`examples`, ...) are ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

MAX_OPEN_DEPTH = 3
"""Levels of nesting a value the schema leaves open may have (each level multiplies the automaton
by about four)."""
MAX_REF_DEPTH = 4
"""How deep `$ref`s may nest (a recursive schema unrolled that many times)."""

WHITESPACE = r"[ ]?"
_STRING_CHAR = (r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]'
                r'|\\u(?:[0-9a-cA-CeEfF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))')
"""A character of a JSON string: any but '"', '\\' and controls, or an escape (\\u of a surrogate
left out: a lone one is JSON many parsers refuse)."""
STRING = f'"{_STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = rf"{INTEGER}(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SCALARS = {"string": STRING, "integer": INTEGER, "number": NUMBER, "boolean": "(?:true|false)",
            "null": "null"}
_FORMATS = {
    "date": r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])",
    "time": (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?"
             r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?"),
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}
_FORMATS["date-time"] = f"{_FORMATS['date']}T{_FORMATS['time']}"

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "$defs", "definitions", "strict",
})
_HANDLED = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "required",
    "additionalProperties", "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
    "pattern", "format",
})


def json_object_regex() -> str:
    """Any JSON object (vLLM's `json_object`), nested at most MAX_OPEN_DEPTH levels."""
    return _open_object(MAX_OPEN_DEPTH)


def schema_regex(schema: Any) -> str:
    """A regular expression whose matches are JSON texts valid under `schema` (a dict, or a JSON
    string of one); a ValueError for what it cannot write."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"the JSON schema is not valid JSON: {error}") from error
    if not isinstance(schema, (Mapping, bool)):
        raise ValueError(f"a JSON schema must be an object or a boolean, got {schema!r}")
    try:
        return _Writer(schema).regex(schema, "#", MAX_REF_DEPTH)
    except _TooDeep as error:
        raise ValueError(f"{error}: $refs nest deeper than {MAX_REF_DEPTH} levels where the schema "
                         "requires them") from None


class _TooDeep(Exception):
    """A $ref past MAX_REF_DEPTH: the caller leaves out what needs it, if it may."""


def _literal(value: Any) -> str:
    """The regex of one JSON value (a const or enum member), with the whitespace a value may have."""
    if isinstance(value, Mapping):
        members = [f"{_literal(str(key))}{WHITESPACE}:{WHITESPACE}{_literal(item)}"
                   for key, item in value.items()]
        return rf"\{{{WHITESPACE}" + f"{WHITESPACE},{WHITESPACE}".join(members) + rf"{WHITESPACE}\}}"
    if isinstance(value, list):
        items = [_literal(item) for item in value]
        return rf"\[{WHITESPACE}" + f"{WHITESPACE},{WHITESPACE}".join(items) + rf"{WHITESPACE}\]"
    return re.escape(json.dumps(value, ensure_ascii=False))


def _sequence(item: str, low: int, high: int | None) -> str:
    """`low` to `high` (None: any number of) `item`s, comma-separated."""
    separator = f"{WHITESPACE},{WHITESPACE}"
    if high == 0:
        return ""
    rest_low = max(low - 1, 0)
    rest = f"(?:{separator}{item})" + (f"{{{rest_low},}}" if high is None else f"{{{rest_low},{high - 1}}}")
    items = f"{item}{rest}"
    return items if low > 0 else f"(?:{items})?"


def _array(item: str, low: int = 0, high: int | None = None) -> str:
    return rf"\[{WHITESPACE}{_sequence(item, low, high)}{WHITESPACE}\]"


def _open_value(depth: int) -> str:
    """Any JSON value nested at most `depth` levels."""
    scalars = "|".join(_SCALARS.values())
    if depth == 0:
        return f"(?:{scalars})"
    return f"(?:{scalars}|{_open_object(depth)}|{_array(_open_value(depth - 1))})"


def _open_object(depth: int, values: str | None = None) -> str:
    member = f"{STRING}{WHITESPACE}:{WHITESPACE}{values or _open_value(depth - 1)}"
    return rf"\{{{WHITESPACE}{_sequence(member, 0, None)}{WHITESPACE}\}}"


class _Writer:
    def __init__(self, root: Any) -> None:
        self.root = root

    def regex(self, schema: Any, where: str, refs_left: int) -> str:
        """The regex of `schema` (at `where`, for errors), following at most `refs_left` more $refs."""
        if schema is True or schema == {}:
            return _open_value(MAX_OPEN_DEPTH)
        if schema is False:
            raise ValueError(f"{where}: the schema false allows no value")
        if not isinstance(schema, Mapping):
            raise ValueError(f"{where}: a schema must be an object or a boolean, got {schema!r}")
        unsupported = sorted(set(schema) - _HANDLED - _ANNOTATIONS)
        if unsupported:
            raise ValueError(f"{where}: {', '.join(unsupported)} cannot be enforced by structured outputs")
        if "$ref" in schema:
            if refs_left == 0:
                raise _TooDeep(where)
            return self.regex(self._resolve(schema["$ref"], where), schema["$ref"], refs_left - 1)
        if "const" in schema:
            return _literal(schema["const"])
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise ValueError(f"{where}: enum must be a non-empty list")
            return "(?:" + "|".join(_literal(value) for value in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise ValueError(f"{where}: {key} must be a non-empty list")
                regexes = []
                for i, option in enumerate(options):
                    try:
                        regexes.append(self.regex(option, f"{where}/{key}/{i}", refs_left))
                    except _TooDeep:
                        continue
                if not regexes:
                    raise _TooDeep(where)
                return "(?:" + "|".join(regexes) + ")"
        if "allOf" in schema:
            if not isinstance(schema["allOf"], list) or len(schema["allOf"]) != 1:
                raise ValueError(f"{where}: allOf is supported with one schema only")
            return self.regex(schema["allOf"][0], f"{where}/allOf/0", refs_left)
        kind = schema.get("type")
        if kind is None:
            string_keys = {"pattern", "format", "minLength", "maxLength"} & schema.keys()
            kind = ("object" if "properties" in schema else "array" if "items" in schema
                    else "string" if string_keys else None)
        if kind is None:
            return _open_value(MAX_OPEN_DEPTH)
        if isinstance(kind, list):
            return "(?:" + "|".join(self.regex({**schema, "type": k}, where, refs_left) for k in kind) + ")"
        if kind == "object":
            return self._object(schema, where, refs_left)
        if kind == "array":
            return self._array(schema, where, refs_left)
        if kind == "string":
            return self._string(schema, where)
        if kind in _SCALARS:
            return _SCALARS[kind]
        raise ValueError(f"{where}: unknown type {kind!r}")

    def _resolve(self, ref: Any, where: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"{where}: only local $refs (#/...) are supported, got {ref!r}")
        node = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, Mapping) or part not in node:
                raise ValueError(f"{where}: $ref {ref!r} points nowhere")
            node = node[part]
        return node

    def _object(self, schema: Mapping, where: str, refs_left: int) -> str:
        properties = schema.get("properties")
        if not properties:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return rf"\{{{WHITESPACE}\}}"
            values = None if extra is True else self.regex(extra, f"{where}/additionalProperties", refs_left)
            return _open_object(MAX_OPEN_DEPTH, values)
        required = schema.get("required", [])
        if not isinstance(required, list):
            raise ValueError(f"{where}: required must be a list of property names")
        unknown = sorted(set(required) - set(properties))
        if unknown:
            raise ValueError(f"{where}: required properties {unknown} are not in properties")
        members = []
        for name, sub in properties.items():
            try:
                value = self.regex(sub, f"{where}/properties/{name}", refs_left)
            except _TooDeep:
                if name in required:
                    raise
                continue
            members.append((f"{_literal(name)}{WHITESPACE}:{WHITESPACE}{value}", name in required))
        if not members:
            return rf"\{{{WHITESPACE}\}}"
        separator = f"{WHITESPACE},{WHITESPACE}"
        # The first member present is some k up to the first required one; after it, each member
        # is there (required) or may be (optional), after a comma.
        first_required = next((i for i, (_, needed) in enumerate(members) if needed), len(members) - 1)
        options = []
        for k in range(first_required + 1):
            rest = "".join(f"{separator}{member}" if needed else f"(?:{separator}{member})?"
                           for member, needed in members[k + 1:])
            options.append(members[k][0] + rest)
        body = "(?:" + "|".join(options) + ")"
        if not required:
            body += "?"
        return rf"\{{{WHITESPACE}{body}{WHITESPACE}\}}"

    def _array(self, schema: Mapping, where: str, refs_left: int) -> str:
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        for name, value in (("minItems", low), ("maxItems", high)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{where}: {name} must be a non-negative integer, got {value!r}")
        if high is not None and high < low:
            raise ValueError(f"{where}: maxItems ({high}) is below minItems ({low})")
        if "prefixItems" in schema:
            if "items" in schema and schema["items"] is not False:
                raise ValueError(f"{where}: prefixItems is supported with items false or absent only")
            items = [self.regex(sub, f"{where}/prefixItems/{i}", refs_left)
                     for i, sub in enumerate(schema["prefixItems"])]
            return rf"\[{WHITESPACE}" + f"{WHITESPACE},{WHITESPACE}".join(items) + rf"{WHITESPACE}\]"
        item = schema.get("items", True)
        try:
            return _array(self.regex(item, f"{where}/items", refs_left), low, high)
        except _TooDeep:
            if low > 0:
                raise
            return rf"\[{WHITESPACE}\]"

    def _string(self, schema: Mapping, where: str) -> str:
        if "pattern" in schema:
            if {"format", "minLength", "maxLength"} & schema.keys():
                raise ValueError(f"{where}: pattern cannot be combined with format, minLength or maxLength")
            pattern = schema["pattern"]
            if not (pattern.startswith("^") and pattern.endswith("$")):
                raise ValueError(f"{where}: a string pattern must be anchored (^...$): a partial match "
                                 "would let any text surround it")
            return f'"{pattern[1:-1]}"'
        if "format" in schema:
            if schema["format"] not in _FORMATS:
                raise ValueError(f"{where}: string format {schema['format']!r} is not supported "
                                 f"(supported: {', '.join(sorted(_FORMATS))})")
            return f'"{_FORMATS[schema["format"]]}"'
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if low == 0 and high is None:
            return STRING
        return f'"{_STRING_CHAR}{{{low},{"" if high is None else high}}}"'
