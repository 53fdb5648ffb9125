"""JSON schemas as regular expressions (slipstream/serve/json_schema.py): every text the regex
matches is JSON valid under the schema, by `jsonschema` (texts drawn from the regex by
hypothesis), and the usual instances, written as a model would, are matched."""

from __future__ import annotations

import enum
import functools
import json
import re
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal, localcontext

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from slipstream.serve.fsm import ByteDFA
from slipstream.serve.json_schema import check_self_references, json_object_regex, schema_regex

jsonschema = pytest.importorskip("jsonschema")


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Address(BaseModel):
    street: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str
    age: int
    email: str | None = None
    favourite: Color = Color.RED
    addresses: list[Address] = Field(default_factory=list, max_length=2)
    scores: tuple[float, bool]


SCHEMAS = {
    "scalars": {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
        "b": {"type": "boolean"}, "z": {"type": "null"}}, "required": ["s", "i", "n", "b", "z"]},
    "optional": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}, "required": ["b"]},
    "none required": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    "enum const anyOf": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", 3, None, True]}, "v": {"const": {"x": [1, "é"]}},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
        "several": {"type": ["integer", "null"]}}, "required": ["kind", "v", "either", "several"]},
    "arrays": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}], "items": False},
        "any": {"type": "array"}}, "required": ["xs", "pair", "any"]},
    "strings": {"type": "object", "properties": {
        "short": {"type": "string", "minLength": 2, "maxLength": 4},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"},
        "day": {"type": "string", "format": "date"}, "when": {"type": "string", "format": "date-time"},
        "id": {"type": "string", "format": "uuid"}}, "required": ["short", "code", "day", "when", "id"]},
    "open": {"type": "object", "properties": {
        "meta": {}, "extra": {"type": "object"},
        "counts": {"type": "object", "additionalProperties": {"type": "integer"}}},
        "required": ["meta", "extra", "counts"]},
    "top-level array": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 4,
                        "$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer"}},
                                           "required": ["id"]}}},
    "recursive": {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value"]}}},
    "pydantic": Person.model_json_schema(),
    # keywords beside enum and prefixItems (an enum's values of another type, or a prefix longer
    # than maxItems, came out although the schema rejects them)
    "beside": {"type": "object", "properties": {
        "typed": {"type": "string", "enum": ["a", 1, "b"]}, "capped": {
            "type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "maxItems": 1}},
        "required": ["typed", "capped"]},
}


OPEN = {"open", "arrays"}
"""Schemas with values left open, whose regexes are large: hypothesis draws from them slowly."""


@pytest.mark.parametrize("name", sorted(set(SCHEMAS) - OPEN))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_match_is_valid_under_the_schema(name, data):
    check_a_match(name, data)


@pytest.mark.parametrize("name", sorted(OPEN))
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_match_of_an_open_schema_is_valid(name, data):
    check_a_match(name, data)


@functools.cache
def matches_of(regex: str) -> st.SearchStrategy[str]:
    """Texts `regex` matches whole, one strategy per regex for all of a test's examples:
    hypothesis builds a strategy from the regex's parse (seconds for a schema's regex of 30,000
    characters) and may evict the nested strategies of a new one from its cache between examples.
    Character classes that run to U+10FFFF are drawn up to U+1FFFF (planes 0 and 1, emoji
    included): hypothesis adds a class's characters one at a time (~8 s for a class to U+10FFFF),
    and no regex here treats a character above U+1FFFF apart from the rest of its class."""
    return st.from_regex(re.compile(regex.replace("-\\U0010ffff]", "-\\U0001ffff]")), fullmatch=True)


def check_a_match(name, data):
    schema = SCHEMAS[name]
    text = data.draw(matches_of(schema_regex(schema)))
    jsonschema.validate(json.loads(text), schema)
    if name == "pydantic":
        Person.model_validate_json(text)


INSTANCES = {
    "scalars": {"s": "x \"q\" \\ \u00e9 😀", "i": -12, "n": 3.5e-3, "b": False, "z": None},
    "optional": {"b": ""},
    "none required": {},
    "enum const anyOf": {"kind": None, "v": {"x": [1, "é"]}, "either": "abc", "several": None},
    "arrays": {"xs": [1, 2, 3], "pair": ["a", 1.5], "any": [[1, {"a": None}], "s"]},
    "strings": {"short": "abcd", "code": "AB-12", "day": "2026-12-04", "when": "2026-12-04T10:00:00Z",
                "id": "123e4567-e89b-12d3-a456-426614174000"},
    "open": {"meta": {"a": [1, 2]}, "extra": {}, "counts": {"a": 1, "b": -2}},
    "top-level array": [{"id": 1}, {"id": 2}],
    "recursive": {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]},
    "pydantic": {"name": "Ann", "age": 30, "email": None, "favourite": "green",
                 "addresses": [{"street": "Main St", "zip_code": "12345"}], "scores": [0.5, True]},
}


@pytest.mark.parametrize("name", sorted(INSTANCES))
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_valid_instances_written_compactly_or_spaced_are_matched(name, separators):
    """Instances whose properties come in the schema's order, with no space or one space after
    ',' and ':', match; so does a JSON object of json_object."""
    text = json.dumps(INSTANCES[name], separators=separators, ensure_ascii=False)
    jsonschema.validate(INSTANCES[name], SCHEMAS[name])
    assert ByteDFA(schema_regex(SCHEMAS[name])).matches(text.encode()), text
    assert ByteDFA(schema_regex(json.dumps(SCHEMAS[name]))).matches(text.encode())  # a schema as JSON text


def test_json_object_matches_json_objects_only():
    """Any JSON object nested up to MAX_OPEN_DEPTH (3) levels, and nothing else."""
    dfa = ByteDFA(json_object_regex())
    for value in ({}, {"a": 1}, {"a": [1, {"b": "x"}], "c": "d"}):
        assert dfa.matches(json.dumps(value).encode())
    for text in ("[1]", '"x"', "{", '{"a" 1}', "{'a': 1}", '{"a": [1,]}', "null", '{"a": [{"b": [1]}]}'):
        assert not dfa.matches(text.encode()), text


@pytest.mark.parametrize("schema, message", [
    ({"type": "number", "multipleOf": 0.5}, "multipleOf cannot be enforced"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems cannot be enforced"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties cannot be enforced"),
    ({"not": {"type": "string"}}, "not cannot be enforced"),
    ({"type": "string", "format": "email"}, "string format 'email' is not supported"),
    ({"type": "string", "pattern": "(?=a)"}, "lookaround"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, r"required properties \['b'\]"),
    ({"$ref": "https://example.com/s.json"}, r"only local \$refs"),
    ({"$ref": "#/$defs/missing"}, "points nowhere"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "nest deeper than"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, r"maxItems \(2\) is below minItems \(3\)"),
    ({"type": "date"}, "unknown type 'date'"),
    (False, "allows no value"),
    ("{bad json", "not valid JSON"),
    ([1], "must be an object or a boolean"),
    # keywords of the wrong type (each a 500 at the server once)
    ({"type": "string", "pattern": 1e308}, "pattern must be a string"),
    ({"type": "string", "format": {"a": 1}}, "format must be a string"),
    ({"type": "object", "properties": [1]}, "properties must be an object"),
    ({"type": "object", "properties": {"a": {}}, "required": [{}]}, "required must list strings"),
    ({"type": [{}]}, "type must list strings"),
    ({"type": "array", "prefixItems": {"a": 1}}, "prefixItems must be a list"),
    ({"type": "string", "minLength": 1.5}, "minLength must be a non-negative integer"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, r"maxLength \(2\) is below minLength \(3\)"),
    ({"type": "integer", "minimum": "0"}, "minimum must be a finite number"),
    ({"type": "integer", "maximum": True}, "maximum must be a finite number"),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "no integer lies within the bounds"),
    ({"type": "number", "minimum": 2, "maximum": 1}, "no number lies within the bounds"),
    ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "no number lies within the bounds"),
    ({"type": "number", "minimum": 1e-70}, "more than 64 digits"),
    # bounds past float's range (math.isfinite's OverflowError, a 500) and hostile JSON text
    ({"type": "integer", "minimum": 10**400}, "more than 64 digits"),
    ({"type": "number", "exclusiveMaximum": -(10**400)}, "more than 64 digits"),
    ({"type": "number", "maximum": float("inf")}, "maximum must be a finite number"),
    ("[" * 2000 + "]" * 2000, "not valid JSON: maximum recursion depth"),  # a RecursionError, a 500
    ('{"minimum": ' + "1" * 5000 + "}", "not valid JSON: Exceeds the limit"),
    # keywords the regex used to drop: outputs the schema rejects
    ({"type": "object", "required": ["a"]}, "required properties without properties"),
    ({"type": "object", "properties": {"a": {}}, "anyOf": [{"required": ["a"]}]},
     "anyOf beside properties, type"),
    ({"enum": ["ab", "c"], "minLength": 2}, "enum beside minLength"),
    ({"type": "integer", "enum": ["a"]}, "no value of the enum or const is of type"),
    ({"type": "array", "prefixItems": [{}, {}], "minItems": 3, "items": False}, r"minItems \(3\) exceeds"),
    # a small schema whose regex would grow exponentially (five levels of ten optional members)
    (functools.reduce(lambda inner, _: {"type": "object", "properties": {
        **{f"p{j}": {"type": "integer"} for j in range(9)}, "child": inner}}, range(5), {"type": "integer"}),
     "would pass 1,000,000 characters"),
])
def test_what_a_regex_cannot_enforce_is_a_value_error(schema, message):
    with pytest.raises(ValueError, match=message):
        schema_regex(schema)


@pytest.mark.parametrize("schema, cycle", [
    ({"$ref": "#"}, "# -> #"),
    ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]},
     "#/properties/a -> #/properties/a"),
    ({"allOf": [{"type": "object"}, {"$ref": "#"}]}, "# -> #/allOf/1 -> #"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
     "#/$defs/a -> #/$defs/b -> #/$defs/a"),
    ({"$ref": "#/$defs/a~1b~0", "$defs": {"a/b~": {"$ref": "#/$defs/a~1b~0"}}},
     "#/$defs/a~1b~0 -> #/$defs/a~1b~0"),
    ({"type": "object", "properties": {"default": {"$ref": "#/properties/default"}}},  # a name, not data
     "#/properties/default -> #/properties/default"),
    ('{"$ref": "#"}', "# -> #"),
])
def test_a_schema_that_is_part_of_itself_is_a_value_error(schema, cycle):
    """A subschema that must be valid under itself before anything else (through $refs and allOf
    alone) has no valid value; llguidance would start an output of it and strand it part-way."""
    with pytest.raises(ValueError, match=re.escape(f"({cycle}), so no value is valid under it")):
        check_self_references(schema)


@pytest.mark.parametrize("schema", [
    SCHEMAS["recursive"], {"$ref": "#/$defs/missing"}, {"$ref": "https://example.com/s.json"}, True,
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # each level an object: values end
    {"allOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "string"}}},
    # what xgrammar and llguidance take: a loop among definitions the root never reaches, and $refs
    # inside instances (const, enum, default, examples hold data, not schemas)
    {"type": "string", "$defs": {"loop": {"$ref": "#/$defs/loop"}}},
    {"type": "object",
     "properties": {"s": {"type": "object", "default": {"$ref": "#/properties/s/default"}}}},
    {"const": {"$ref": "#/const"}}, {"enum": [{"$ref": "#/enum/0"}]},
    {"examples": [{"$ref": "#/examples/0"}]},
])
def test_a_recursive_schema_whose_values_end_is_no_cycle(schema):
    check_self_references(schema)

PATTERNS = [r"^[0-9]{5}$", r'[a-z"\\]+', r"^a|bc$", r".{0,6}", r"(?:x\n|\t\x01|é😀)*", r"[^a-z]{2,4}"]


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_string_pattern_gives_valid_json_whose_value_matches_it_whole(pattern, data):
    """Characters JSON escapes (quotes, backslashes, controls) come escaped, so the text is JSON,
    and the decoded value matches the whole pattern (so jsonschema's search finds it too)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}},
              "required": ["s"]}
    text = data.draw(matches_of(schema_regex(schema)))
    value = json.loads(text)
    assert re.fullmatch(pattern, value["s"]), (text, value)
    jsonschema.validate(value, schema)


@pytest.mark.parametrize("pattern, value", [
    (r'[a-z"\\]+', 'a"b\\'), (r".{0,6}", '\x1f"\t'), (r"^a|bc$", "bc"),
    (r"(?:x\n|\t\x01|é😀)*", "x\n\t\x01é😀"),
])
def test_a_string_pattern_matches_the_values_json_dumps_writes(pattern, value):
    text = json.dumps({"s": value}, ensure_ascii=False)
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}},
              "required": ["s"]}
    assert ByteDFA(schema_regex(schema)).matches(text.encode()), text


BOUND_VALUES = st.one_of(st.integers(-1200, 1200), st.decimals(-30, 30, places=3), st.sampled_from(
    [Decimal(0), Decimal("0.5"), Decimal("-0.5"), Decimal("0.05"), Decimal("99.99"), Decimal("1e3")]))


@st.composite
def numeric_schemas(draw):
    """An integer or number schema with a random mix of inclusive and exclusive bounds (each a
    number, or draft 4's boolean form), and the exact interval it allows."""
    kind = draw(st.sampled_from(["integer", "number"]))
    schema, interval = {"type": kind}, [None, True, None, True]
    for side, (inclusive_name, exclusive_name) in enumerate([("minimum", "exclusiveMinimum"),
                                                            ("maximum", "exclusiveMaximum")]):
        form = draw(st.sampled_from(["none", "inclusive", "exclusive", "draft4"]))
        if form == "none":
            continue
        bound = Decimal(draw(BOUND_VALUES))
        value = int(bound) if bound == bound.to_integral_value() and draw(st.booleans()) else float(bound)
        if form == "exclusive":
            schema[exclusive_name] = value
        else:
            schema[inclusive_name] = value
            if form == "draft4":
                schema[exclusive_name] = True
        interval[2 * side: 2 * side + 2] = [Decimal(repr(value)), form == "inclusive"]
    return schema, interval


def within(value: Decimal, interval) -> bool:
    low, low_inclusive, high, high_inclusive = interval
    return ((low is None or value > low or (low_inclusive and value == low))
            and (high is None or value < high or (high_inclusive and value == high)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=numeric_schemas(), data=st.data())
def test_numeric_bounds_allow_exactly_the_numbers_within(case, data):
    """Every number a bounded schema's regex matches lies within the bounds (exactly, as a decimal)
    and is JSON of the right type; every number within, as `format(value, "f")` writes it, matches;
    and numbers just outside do not. Where no number fits, a ValueError says so."""
    schema, interval = case
    integer = schema["type"] == "integer"
    low, _, high, _ = interval
    step = Decimal(1) if integer else Decimal("0.001")
    edges = [edge + delta for edge in (low, high) if edge is not None for delta in (-step, 0, step)]
    candidates = edges + [data.draw(st.decimals(-1300, 1300, places=0 if integer else 4)) for _ in range(5)]
    if integer:
        candidates = [value for value in candidates if value == value.to_integral_value()]
    inside = [value for value in candidates if within(value, interval)]
    try:
        pattern = re.compile(schema_regex(schema))
    except ValueError as error:
        assert "lies within the bounds" in str(error)
        assert not inside
        return
    text = data.draw(st.from_regex(pattern, fullmatch=True))
    exponent = re.search(r"[eE][+-]?([0-9]+)$", text)
    assume(exponent is None or len(exponent[1]) < 18)  # JSON, but past any decimal context
    with localcontext(Context(Emax=MAX_EMAX, Emin=MIN_EMIN)):  # 0E1000000 is a number
        value = json.loads(text, parse_float=Decimal)
        assert isinstance(value, int) if integer else isinstance(value, (int, Decimal)), text
        assert within(Decimal(value), interval), (schema, text)
    for value in candidates:
        written = str(int(value)) if integer else format(value, "f")
        if written.startswith("-") and value == 0:
            continue  # -0 is never written
        assert bool(pattern.fullmatch(written)) == within(value, interval), (schema, written)
