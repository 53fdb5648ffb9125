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

A string `pattern` must match the whole value, as vLLM's grammar backends read it (JSON Schema's
own reading is a search, which allows more: every output is still valid), and characters that JSON
escapes are written escaped. Numeric bounds (`minimum`, `maximum`, `exclusiveMinimum`,
`exclusiveMaximum`, draft 4's boolean exclusives too) are exact, on the decimal value the text
writes: a bounded number is written without an exponent and a negative one never as `-0`.

Validation keywords whose limits a regular expression cannot hold or this module does not write
(`multipleOf`, `uniqueItems`, `patternProperties`, `not`, ...) are a ValueError naming them,
rather than an output the schema would reject, and so is a keyword of the wrong type. Annotations
(`title`, `description`, `default`, `examples`, ...) are ignored.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from slipstream.serve.fsm import json_string_regex

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
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_KEYWORD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "type": ((str, list), "a type name or a list of them"),
    "enum": ((list,), "a list"), "anyOf": ((list,), "a list"), "oneOf": ((list,), "a list"),
    "allOf": ((list,), "a list"), "prefixItems": ((list,), "a list"),
    "required": ((list,), "a list of property names"), "properties": ((Mapping,), "an object"),
    "additionalProperties": ((bool, Mapping), "a schema"), "items": ((bool, Mapping), "a schema"),
    "pattern": ((str,), "a string"), "format": ((str,), "a string"), "$ref": ((str,), "a string"),
}
_HANDLED = frozenset({"const", *_KEYWORD_TYPES, *_COUNTS, *_BOUNDS})
MAX_BOUND_DIGITS = 64
"""Most digits a numeric bound may have, written without an exponent."""
MAX_REGEX_CHARS = 1_000_000
"""Longest regular expression a schema may write. Nested arrays and objects with optional members
copy their parts' text at each level, so a small schema can grow it exponentially (five levels of
ten optional properties took a minute and gigabytes): past this it is a ValueError, written no
further, and structured outputs hand the schema to llguidance where installed."""


def json_object_regex() -> str:
    """Any JSON object (vLLM's `json_object`), nested at most MAX_OPEN_DEPTH levels."""
    return _open_object(MAX_OPEN_DEPTH)


def parsed_schema(schema: Any) -> Any:
    """`schema` (a dict or a boolean), or the one a JSON string of it holds; a ValueError where it
    is neither, and for JSON text nested past Python's stack or with an integer past int()'s
    4,300 digits."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as error:
            raise ValueError(f"the JSON schema is not valid JSON: {str(error)[:200]}") from None
    if not isinstance(schema, (Mapping, bool)):
        raise ValueError(f"a JSON schema must be an object or a boolean, got {schema!r}")
    return schema


_NOT_SUBSCHEMAS = frozenset({"const", "enum", "default", "examples", "$defs", "definitions"})
"""Keywords whose values are no subschemas of the one that holds them: instances (a `$ref` in a
`default` is data), and definitions, which count only where a `$ref` reaches them."""
_NAMED_SUBSCHEMAS = frozenset({"properties", "patternProperties", "dependentSchemas"})
"""Keywords whose values map names (any, "default" included) to subschemas."""


MAX_REFERENCES = 1_000
"""Most subschemas with a `$ref` or an `allOf` a schema may reach: llguidance's Rust code recurses
once per link of a chain of them, compiling it and matching with it, and a chain of 2,500
overflowed an 8 MiB thread stack (the server process died); 2,000 passed."""


def check_self_references(schema: Any) -> None:
    """A ValueError where the root reaches more than MAX_REFERENCES subschemas with a `$ref` or an
    `allOf`, and one naming a subschema reachable from the root that is part of itself through
    `$ref`s and `allOf`s alone (`{"$ref": "#"}`, a property whose schema is a `$ref` to that
    property): a value valid under it would first have to be valid under it, so none is, and a
    grammar of it has a rule that never produces a value (llguidance starts such an output and
    strands it part-way: `{"a": `). Only local `$ref`s are followed; one that points nowhere is
    left to the schema's readers."""
    root = parsed_schema(schema)
    # Pointers are tuples of their parts: a string per node would cost its depth times its keys'
    # length, quadratic for a deep schema with long keys.
    links: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
    seen: set[tuple[str, ...]] = set()
    pending: list[tuple[tuple[str, ...], Any, bool]] = [((), root, False)]
    while pending:  # each reachable subschema's pointer, and the pointers it must also be valid under
        pointer, node, names = pending.pop()
        if pointer in seen:
            continue
        seen.add(pointer)
        if isinstance(node, Mapping) and names:
            pending.extend(((*pointer, str(key)), value, False) for key, value in node.items())
        elif isinstance(node, Mapping):
            targets = [(*pointer, "allOf", str(i)) for i in range(len(node["allOf"]))
                       ] if isinstance(node.get("allOf"), list) else []
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                parts = tuple(part.replace("~1", "/").replace("~0", "~") for part in ref[1:].split("/")[1:])
                target = _resolved(root, parts)
                if target is not None:
                    targets.append(parts)
                    pending.append((parts, target[0], False))
            if targets:
                links[pointer] = targets
            pending.extend(((*pointer, str(key)), value, key in _NAMED_SUBSCHEMAS)
                           for key, value in node.items() if key not in _NOT_SUBSCHEMAS)
        elif isinstance(node, list):
            pending.extend(((*pointer, str(i)), value, False) for i, value in enumerate(node))
    if len(links) > MAX_REFERENCES:
        raise ValueError(f"the schema reaches {len(links):,} subschemas with a $ref or an allOf, more than "
                         f"the {MAX_REFERENCES:,} a constraint may hold")
    done: set[tuple[str, ...]] = set()
    for start in links:  # a depth-first search for a cycle, without recursion
        if start in done:
            continue
        path, on_path, stack = [start], {start}, [iter(links[start])]
        while stack:
            target = next(stack[-1], None)
            if target is None:
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                stack.pop()
            elif target in on_path:
                cycle = " -> ".join(map(_written, path[path.index(target):] + [target]))
                raise ValueError(f"{_written(target)}: the schema is part of itself through $ref and allOf "
                                 f"alone ({cycle}), so no value is valid under it")
            elif target not in done and target in links:
                path.append(target)
                on_path.add(target)
                stack.append(iter(links[target]))


def _written(pointer: tuple[str, ...]) -> str:
    """A pointer's parts as a `$ref` writes them: `#/properties/a~1b`."""
    return "#" + "".join("/" + _escaped(part) for part in pointer)


def _escaped(key: str) -> str:
    """A key as a JSON pointer writes it."""
    return key.replace("~", "~0").replace("/", "~1")


def _resolved(root: Any, parts: tuple[str, ...]) -> tuple[Any] | None:
    """The node a JSON pointer's parts name in `root`, in a 1-tuple (it may be None or False); None
    where they name none."""
    node = root
    for part in parts:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return (node,)


def schema_regex(schema: Any) -> str:
    """A regular expression whose matches are JSON texts valid under `schema` (a dict, or a JSON
    string of one); a ValueError for what it cannot write."""
    schema = parsed_schema(schema)
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


def _checked(size: int, where: str) -> None:
    """A ValueError once a regular expression (or a whole being assembled) passes MAX_REGEX_CHARS."""
    if size > MAX_REGEX_CHARS:
        raise ValueError(f"{where}: the schema's regular expression would pass {MAX_REGEX_CHARS:,} "
                         "characters")


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
        regex = self._regex(schema, where, refs_left)
        _checked(len(regex), where)
        return regex

    def _regex(self, schema: Any, where: str, refs_left: int) -> str:
        if schema is True or schema == {}:
            return _open_value(MAX_OPEN_DEPTH)
        if schema is False:
            raise ValueError(f"{where}: the schema false allows no value")
        if not isinstance(schema, Mapping):
            raise ValueError(f"{where}: a schema must be an object or a boolean, got {schema!r}")
        unsupported = sorted(set(schema) - _HANDLED - _ANNOTATIONS)
        if unsupported:
            raise ValueError(f"{where}: {', '.join(unsupported)} cannot be enforced by structured outputs")
        _check_keyword_types(schema, where)
        if "$ref" in schema:
            if refs_left == 0:
                raise _TooDeep(where)
            return self.regex(self._resolve(schema["$ref"], where), schema["$ref"], refs_left - 1)
        if "const" in schema or "enum" in schema:
            return _values(schema, where)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not options:
                    raise ValueError(f"{where}: {key} must be a non-empty list")
                beside = sorted(set(schema) - {key} - _ANNOTATIONS)
                if beside:  # each option would have to meet them too
                    raise ValueError(f"{where}: {key} beside {', '.join(beside)} is not supported")
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
            if len(schema["allOf"]) != 1:
                raise ValueError(f"{where}: allOf is supported with one schema only")
            return self.regex(schema["allOf"][0], f"{where}/allOf/0", refs_left)
        kind = schema.get("type")
        if kind is None:
            string_keys = {"pattern", "format", "minLength", "maxLength"} & schema.keys()
            kind = ("object" if "properties" in schema else "array" if "items" in schema
                    else "string" if string_keys else "number" if set(_BOUNDS) & schema.keys() else None)
        if kind is None:
            return _open_value(MAX_OPEN_DEPTH)
        if isinstance(kind, list):
            if not kind:
                raise ValueError(f"{where}: type is an empty list, which no value matches")
            return "(?:" + "|".join(self.regex({**schema, "type": k}, where, refs_left) for k in kind) + ")"
        if kind == "object":
            return self._object(schema, where, refs_left)
        if kind == "array":
            return self._array(schema, where, refs_left)
        if kind == "string":
            return self._string(schema, where)
        if kind in ("integer", "number"):
            return _number(schema, where, integer=kind == "integer")
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
        if not properties and schema.get("required"):
            raise ValueError(f"{where}: required properties without properties are not supported")
        if not properties:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return rf"\{{{WHITESPACE}\}}"
            values = None if extra is True else self.regex(extra, f"{where}/additionalProperties", refs_left)
            return _open_object(MAX_OPEN_DEPTH, values)
        required = schema.get("required", [])
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
        options, size = [], 0
        for k in range(first_required + 1):
            rest = "".join(f"{separator}{member}" if needed else f"(?:{separator}{member})?"
                           for member, needed in members[k + 1:])
            options.append(members[k][0] + rest)
            size += len(options[-1])
            _checked(size, where)
        body = "(?:" + "|".join(options) + ")"
        if not required:
            body += "?"
        return rf"\{{{WHITESPACE}{body}{WHITESPACE}\}}"

    def _array(self, schema: Mapping, where: str, refs_left: int) -> str:
        low, high = _count_range(schema, "minItems", "maxItems", where)
        if "prefixItems" in schema:
            if "items" in schema and schema["items"] is not False:
                raise ValueError(f"{where}: prefixItems is supported with items false or absent only")
            prefix = schema["prefixItems"]
            count = len(prefix) if high is None else min(len(prefix), high)  # no more may follow
            if low > count:
                raise ValueError(f"{where}: minItems ({low}) exceeds the {count} items prefixItems allows")
            items = [self.regex(sub, f"{where}/prefixItems/{i}", refs_left)
                     for i, sub in enumerate(prefix[:count])]
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
            return json_string_regex(schema["pattern"])
        if "format" in schema:
            if schema["format"] not in _FORMATS:
                raise ValueError(f"{where}: string format {schema['format']!r} is not supported "
                                 f"(supported: {', '.join(sorted(_FORMATS))})")
            return f'"{_FORMATS[schema["format"]]}"'
        low, high = _count_range(schema, "minLength", "maxLength", where)
        if low == 0 and high is None:
            return STRING
        return f'"{_STRING_CHAR}{{{low},{"" if high is None else high}}}"'


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
    "object": (Mapping,), "array": (list,),
}


def _values(schema: Mapping, where: str) -> str:
    """A `const` or `enum`: its values, those of a `type` beside it only (other keywords beside
    them are refused: a value would have to meet them too)."""
    beside = sorted(set(schema) - {"const", "enum", "type"} - _ANNOTATIONS)
    if beside:
        raise ValueError(f"{where}: {'const' if 'const' in schema else 'enum'} beside {', '.join(beside)} "
                         "is not supported")
    values = [schema["const"]] if "const" in schema else schema["enum"]
    if not values:
        raise ValueError(f"{where}: enum must be a non-empty list")
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        unknown = [k for k in kinds if k not in _JSON_TYPES]
        if unknown:
            raise ValueError(f"{where}: unknown type {unknown[0]!r}")
        values = [v for v in values if any(_is_of_type(v, k) for k in kinds)]
        if not values:
            raise ValueError(f"{where}: no value of the enum or const is of type {schema['type']!r}")
    return "(?:" + "|".join(_literal(value) for value in values) + ")"


def _is_of_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool):
        return kind == "boolean"
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES[kind])


def _check_keyword_types(schema: Mapping, where: str) -> None:
    for name, (types, what) in _KEYWORD_TYPES.items():
        if name in schema and not isinstance(schema[name], types):
            raise ValueError(f"{where}: {name} must be {what}, got {schema[name]!r}")
    for name in ("type", "required"):
        if isinstance(schema.get(name), list) and not all(isinstance(item, str) for item in schema[name]):
            raise ValueError(f"{where}: {name} must list strings, got {schema[name]!r}")
    for name in _COUNTS:
        value = schema.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    for name in _BOUNDS:
        value = schema.get(name, 0)
        if isinstance(value, bool) and name.startswith("exclusive"):
            continue  # draft 4: it makes minimum (maximum) exclusive
        # (an int is finite, and math.isfinite of one past float's range an OverflowError)
        finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
        if isinstance(value, bool) or not finite:
            raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")


def _count_range(schema: Mapping, low_name: str, high_name: str, where: str) -> tuple[int, int | None]:
    low, high = schema.get(low_name, 0), schema.get(high_name)
    if high is not None and high < low:
        raise ValueError(f"{where}: {high_name} ({high}) is below {low_name} ({low})")
    return low, high


# ---- numeric bounds ----------------------------------------------------------------------------
# A bounded number is split by sign into magnitudes, and a magnitude into its integer part (a
# range of integers, written digit by digit as the classic range-to-regex construction does) and
# its fraction (digit strings compared with a bound's digits one at a time).


def _number(schema: Mapping, where: str, *, integer: bool) -> str:
    low, low_inclusive, high, high_inclusive = _bounds(schema, where)
    if low is None and high is None:
        return _SCALARS["integer" if integer else "number"]
    if low is not None and high is not None:  # (_decimal_magnitude needs low <= high)
        if low > high or (low == high and not (low_inclusive and high_inclusive)):
            raise ValueError(f"{where}: no number lies within the bounds")
    if integer:  # the same integers within inclusive integer bounds
        low = None if low is None else math.ceil(low) if low_inclusive else math.floor(low) + 1
        high = None if high is None else math.floor(high) if high_inclusive else math.ceil(high) - 1
        low_inclusive = high_inclusive = True
    magnitude = _integer_magnitude if integer else _decimal_magnitude
    options = []
    if high is None or high > 0 or (high == 0 and high_inclusive):  # values >= 0
        from_zero = low is None or low < 0
        options.append(magnitude(0 if from_zero else low, from_zero or low_inclusive, high, high_inclusive))
    if low is None or low < 0:  # values < 0: '-' and a magnitude above 0
        below_zero = high is not None and high < 0
        options.append(magnitude(-high if below_zero else 0, below_zero and high_inclusive,
                                 None if low is None else -low, low_inclusive))
        if options[-1] is not None:
            options[-1] = "-" + options[-1]
    options = [option for option in options if option is not None]
    if not options:
        raise ValueError(f"{where}: no {'integer' if integer else 'number'} lies within the bounds")
    return "(?:" + "|".join(options) + ")"


def _bounds(schema: Mapping, where: str) -> tuple[Decimal | None, bool, Decimal | None, bool]:
    """(low, low inclusive, high, high inclusive): the tighter of minimum and exclusiveMinimum and of
    maximum and exclusiveMaximum, exact (a float bound is the decimal its shortest repr writes)."""
    def bound(name: str) -> Decimal | None:
        value = schema.get(name)
        if value is None or isinstance(value, bool):
            return None
        exact = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
        if len(f"{exact:f}") > MAX_BOUND_DIGITS:
            raise ValueError(f"{where}: {name} {value!r} has more than {MAX_BOUND_DIGITS} digits")
        return exact

    low, low_inclusive = bound("minimum"), schema.get("exclusiveMinimum") is not True
    high, high_inclusive = bound("maximum"), schema.get("exclusiveMaximum") is not True
    exclusive_low, exclusive_high = bound("exclusiveMinimum"), bound("exclusiveMaximum")
    if exclusive_low is not None and (low is None or exclusive_low >= low):
        low, low_inclusive = exclusive_low, False
    if exclusive_high is not None and (high is None or exclusive_high <= high):
        high, high_inclusive = exclusive_high, False
    return low, low_inclusive, high, high_inclusive


def _integer_magnitude(low: int, low_inclusive: bool, high: int | None, high_inclusive: bool) -> str | None:
    """Integers in [low, high] (bounds made inclusive by the caller; an exclusive 0 is 1)."""
    return _natural_range(low if low_inclusive else low + 1, high)


def _natural_range(low: int, high: int | None) -> str | None:
    """Integers in [low, high] (None: unbounded), low >= 0, written as JSON writes them."""
    if high is not None and high < low:
        return None
    options, digits = [], len(str(low))
    while high is None or digits <= len(str(high)):
        first, last = (10 ** (digits - 1) if digits > 1 else 0), 10**digits - 1
        start = max(low, first)
        if high is None and start == first:  # every integer of `digits` digits or more
            options.append("(?:0|[1-9][0-9]*)" if digits == 1 else f"[1-9][0-9]{{{digits - 1},}}")
            break
        options.append(_same_length_range(str(start), str(last if high is None else min(high, last))))
        digits += 1
    return "(?:" + "|".join(options) + ")"


def _same_length_range(low: str, high: str) -> str:
    """Digit strings of one length between `low` and `high` (inclusive)."""
    if low == high:
        return low
    if len(low) == 1:
        return f"[{low}-{high}]"
    rest = len(low) - 1
    if low[0] == high[0]:
        return low[0] + _same_length_range(low[1:], high[1:])
    if low[1:] == "0" * rest and high[1:] == "9" * rest:
        return f"[{low[0]}-{high[0]}][0-9]{{{rest}}}"
    options = [low[0] + _same_length_range(low[1:], "9" * rest)]
    if int(high[0]) - int(low[0]) > 1:
        options.append(f"[{int(low[0]) + 1}-{int(high[0]) - 1}][0-9]{{{rest}}}")
    options.append(high[0] + _same_length_range("0" * rest, high[1:]))
    return "(?:" + "|".join(options) + ")"


def _decimal_magnitude(low: Decimal, low_inclusive: bool, high: Decimal | None,
                       high_inclusive: bool) -> str | None:
    """Decimals (an integer part, then a fraction or not) between low >= 0 and high (None: none)."""
    low_int, low_fraction = _split_decimal(low)
    high_int, high_fraction = _split_decimal(high) if high is not None else (None, None)
    if high_int == low_int:
        parts = [(str(low_int), _fraction(low_fraction, low_inclusive, high_fraction, high_inclusive))]
    else:
        parts = [(str(low_int), _fraction(low_fraction, low_inclusive, None, True))]
        middle = _natural_range(low_int + 1, None if high_int is None else high_int - 1)
        if middle is not None:
            parts.append((middle, (True, "[0-9]+")))
        if high_int is not None:
            parts.append((str(high_int), _fraction(None, True, high_fraction, high_inclusive)))
    options = []
    for integer_part, (whole, fraction) in parts:
        if fraction is not None:
            options.append(rf"{integer_part}(?:\.{fraction})" + ("?" if whole else ""))
        elif whole:
            options.append(integer_part)
    return "(?:" + "|".join(options) + ")" if options else None


def _split_decimal(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal's integer part and the digits of its fraction, trailing zeros dropped."""
    integer, _, fraction = f"{value:f}".partition(".")
    return int(integer), fraction.rstrip("0")


def _fraction(low: str | None, low_inclusive: bool, high: str | None,
              high_inclusive: bool) -> tuple[bool, str | None]:
    """The digit strings F after a decimal point with 0.F within bounds given as digit strings
    without trailing zeros ("" is 0; None: no bound): whether F may be empty (no fraction at all),
    and a regex of the non-empty ones (None: there are none)."""
    if low == "" and low_inclusive:
        low = None
    whole = low is None and (high is None or high != "" or high_inclusive)  # F empty: 0.F is 0
    if low is None and high is None:
        return True, "[0-9]+"
    if high == "":  # 0.F <= 0: only zeros
        return whole, ("0+" if whole else None)
    if low == "" and high is None:  # 0.F > 0: a digit other than 0
        return False, "[0-9]*[1-9][0-9]*"
    by_digit = []  # (digit, the regex of what may follow it), digits in order
    for digit in "0123456789":
        if low not in (None, "") and digit < low[0] or high is not None and digit > high[0]:
            continue
        next_low = low if low == "" and digit == "0" else low[1:] if low and digit == low[0] else None
        next_high = high[1:] if high and digit == high[0] else None
        empty, rest = _fraction(next_low, low_inclusive, next_high, high_inclusive)
        if empty or rest is not None:
            by_digit.append((digit, "" if rest is None else f"(?:{rest})" + ("?" if empty else "")))
    options = []
    for follow, group in itertools.groupby(by_digit, key=lambda pair: pair[1]):
        digits = [digit for digit, _ in group]
        head = digits[0] if len(digits) == 1 else f"[{digits[0]}-{digits[-1]}]"
        options.append(head + follow)
    return whole, ("(?:" + "|".join(options) + ")" if options else None)
