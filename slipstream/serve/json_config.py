"""vLLM's JSON-valued engine options (`--speculative-config`, `--profiler-config`,
`--limit-mm-per-prompt`): a dict (of a config dataclass's fields), or its JSON text, as vLLM's CLI
and `LLM(...)` take them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any


def json_dict(value: Mapping[str, Any] | str, name: str) -> Mapping[str, Any]:
    """`value`, a dict or its JSON text, as a dict; a ValueError naming option `name` for text
    that is no JSON or a value that is no dict."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from error
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict, got {value!r}")
    return value


def config_fields(value: Mapping[str, Any] | str, cls: type, name: str) -> Mapping[str, Any]:
    """`value` (a dict or its JSON text) as the keyword arguments of dataclass `cls`; a ValueError
    naming option `name` for text that is no JSON, a value that is no dict, or keys `cls` lacks."""
    value = json_dict(value, name)
    fields = sorted(field.name for field in dataclasses.fields(cls))
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{name} keys {unknown} are not supported (known: {fields})")
    return value
