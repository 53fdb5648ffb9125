"""The names a server answers to: its model and the LoRA adapters it serves under it (vLLM's
`OpenAIServingModels`), and the `--lora-modules` entries that name adapters at start-up.

A request's `model` is the served model's name (the base model) or an adapter's; the adapter's
`LoRARequest` then travels with the request. Adapter ids are given here, 1, 2, ... in the order
loads are tried, as vLLM's counter gives them: an id is never given twice, not after an unload nor
after a load that failed or whose client left (the engine may have loaded it all the same), so an
id always names one adapter. A name is taken by one adapter at a time, and never by the served
model's name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any

from slipstream.serve.lora import LoRARequest
from slipstream.serve.protocol import APIError

logger = logging.getLogger(__name__)

RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter, under its own name so that
vLLM deployments port unchanged."""
RESPONSES_API_STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
"""vLLM's switch for the Responses API's store, likewise."""
HTTP_TIMEOUT_KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
"""vLLM's setting of how many seconds the server keeps an idle HTTP connection open, likewise."""
HTTP_TIMEOUT_KEEP_ALIVE_S = 5
"""Its default, vLLM's (and uvicorn's)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoRAModulePath:
    """An adapter to serve from start-up (one `--lora-modules` entry, vLLM's LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str | None = None
    """As vLLM's: the model the adapter was trained on; reported as its card's `parent` only when it
    is the served model's name (vLLM ignores any other)."""

    def __post_init__(self) -> None:
        for field in ("name", "path"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"a LoRA module's {field} must be a non-empty string, got {value!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"a LoRA module's base_model_name must be a string, got "
                             f"{self.base_model_name!r}")


def parse_lora_module(text: str) -> LoRAModulePath:
    """One `--lora-modules` entry in either of vLLM's forms: `name=path`, or a JSON object
    `{"name": ..., "path": ..., "base_model_name": ...}` (text starting with `{`). ValueError
    saying what is wrong with it."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError as error:
            raise ValueError(f"{text!r} is not valid JSON: {error}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"{text!r} must be a JSON object")
        unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"{text!r} has unknown keys {unknown} (it takes name, path and base_model_name)")
        missing = [key for key in ("name", "path") if key not in fields]
        if missing:
            raise ValueError(f"{text!r} lacks {' and '.join(missing)}")
        return LoRAModulePath(**fields)
    name, equals, path = text.partition("=")
    if not equals:
        raise ValueError(f"{text!r} is neither name=path nor a JSON object")
    return LoRAModulePath(name=name, path=path)


def runtime_lora_updating(environ: Mapping[str, str]) -> bool:
    """Whether VLLM_ALLOW_RUNTIME_LORA_UPDATING allows loading and unloading adapters over HTTP."""
    return env_switch(environ, RUNTIME_LORA_UPDATING_ENV)


def responses_api_store(environ: Mapping[str, str]) -> bool:
    """Whether VLLM_ENABLE_RESPONSES_API_STORE makes the Responses API store responses (`store`,
    previous_response_id, GET, background and cancel)."""
    return env_switch(environ, RESPONSES_API_STORE_ENV)


def http_timeout_keep_alive(environ: Mapping[str, str]) -> int:
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE: the seconds an idle connection stays open, a positive whole
    number (default 5). A client that keeps idle connections as long as the server (httpx's
    default is 5 s too) may send a request just as the server closes the connection; a longer
    timeout here makes the client the one that closes them."""
    value = environ.get(HTTP_TIMEOUT_KEEP_ALIVE_ENV, "").strip()
    if not value:
        return HTTP_TIMEOUT_KEEP_ALIVE_S
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{HTTP_TIMEOUT_KEEP_ALIVE_ENV} must be a whole number of seconds >= 1, "
                         f"got {environ[HTTP_TIMEOUT_KEEP_ALIVE_ENV]!r}")
    return int(value)


def env_switch(environ: Mapping[str, str], name: str) -> bool:
    """One of vLLM's on/off environment variables: "1" or "true" as vLLM reads them (any case);
    unset, "", "0" or "false" are off; any other value is a ValueError rather than a guess."""
    value = environ.get(name, "").strip().lower()
    if value not in ("", "0", "false", "1", "true"):
        raise ValueError(f"{name} must be 1, true, 0 or false, got {environ[name]!r}")
    return value in ("1", "true")


class ServedModels:
    """The served model's name and the adapters served under it, by name."""

    def __init__(self, name: str, path: str, max_model_len: int, created: int) -> None:
        self.name = name
        self.path = path
        self.max_model_len = max_model_len
        self.created = created
        self.adapters: dict[str, LoRARequest] = {}
        self._num_ids_given = 0

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, None for the served model (or no name); a 404
        listing what is served for any other name."""
        if model is None or model == self.name:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise self.unknown(model)
        return adapter

    def unknown(self, model: str) -> APIError:
        served = ", ".join(repr(name) for name in (self.name, *self.adapters))
        return APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                        param="model", code="model_not_found")

    def new_adapter(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """The request of an adapter to load under `name`, with the next id; ValueError for a name
        that is taken or is the served model's."""
        if name == self.name:
            raise ValueError(f"the adapter name {name!r} is the served model's name")
        if name in self.adapters:
            raise ValueError(f"an adapter named {name!r} is loaded already (from "
                             f"{self.adapters[name].lora_path!r}); unload it first")
        if base_model_name is not None and base_model_name != self.name:
            logger.warning("LoRA adapter %r: base_model_name %r is not the served model's name, so its card "
                           "names %r as its parent (as vLLM)", name, base_model_name, self.name)
            base_model_name = None
        self._num_ids_given += 1
        return LoRARequest(lora_name=name, lora_int_id=self._num_ids_given, lora_path=path,
                           base_model_name=base_model_name)

    def add(self, adapter: LoRARequest) -> None:
        """Serve a loaded adapter (from `new_adapter`) under its name."""
        self.adapters[adapter.lora_name] = adapter

    def remove(self, name: str | None, lora_int_id: int | None) -> LoRARequest:
        """Stop serving the adapter of this name or id (both, if given, must name the same one); a
        404 if none is served so."""
        by_id = {adapter.lora_int_id: adapter for adapter in self.adapters.values()}
        adapter = self.adapters.get(name) if name is not None else by_id.get(lora_int_id)
        if adapter is None or lora_int_id not in (None, adapter.lora_int_id):
            wanted = " and ".join(f"{key} {value!r}" for key, value in
                                  (("lora_name", name), ("lora_int_id", lora_int_id)) if value is not None)
            raise APIError(404, f"no LoRA adapter with {wanted} is loaded", param="lora_name",
                           code="model_not_found")
        del self.adapters[adapter.lora_name]
        return adapter

    def cards(self) -> list[dict[str, Any]]:
        """The served model's card, then one per adapter, in load order."""
        return [self.card(name) for name in (self.name, *self.adapters)]

    def card(self, model: str) -> dict[str, Any]:
        """OpenAI's model object with vLLM's fields: `root` (the model's or adapter's path, which
        vLLM's own bench client reads), `parent` (an adapter's base model), `max_model_len` and
        `permission`; a 404 for a name not served."""
        adapter = self.lora_request(model)
        permission = {"id": f"modelperm-{self.created}", "object": "model_permission",
                      "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                      "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                      "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
        root, parent = (self.path, None) if adapter is None else (
            adapter.lora_path, adapter.base_model_name or self.name)
        return {"id": model, "object": "model", "created": self.created, "owned_by": "slipstream",
                "root": root, "parent": parent, "max_model_len": self.max_model_len,
                "permission": [permission]}
