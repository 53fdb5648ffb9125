"""Which LoRA adapters an engine has loaded: by the user's `lora_int_id`, each under an engine id
of its own that is never given to another adapter (so that the prefix cache, which keys blocks by
it, can never serve one adapter's keys and values to another, even after an id is reused).

An adapter is loaded the first time a request or `add` names its `lora_int_id`, and stays while
requests use it. Adapters no live request uses are kept up to `max_cpu_loras`, the least recently
named unloaded first (vLLM's CPU LoRA cache). `remove` forgets the user's id at once; its
adapter is unloaded once its last request ends, and a later request with that id loads it anew.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Set

import torch

from slipstream.model.config import ModelConfig
from slipstream.serve.lora import LoRAAdapter, LoRALayers, LoRARequest


class LoRARegistry:
    """The adapters loaded into one model's `LoRALayers`."""

    def __init__(
        self, layers: LoRALayers, config: ModelConfig, *, max_rank: int, max_cpu_loras: int,
        dtype: torch.dtype, device: torch.device, in_use: Callable[[], Set[int]],
    ) -> None:
        """`in_use`: the engine ids that live requests run under."""
        self.layers = layers
        self.config = config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = device
        self.in_use = in_use
        self._named: collections.OrderedDict[int, tuple[LoRARequest, int]] = collections.OrderedDict()
        """User id -> (its request, engine id), least recently named first."""
        self._loaded: dict[int, LoRARequest] = {}
        """Engine id -> the request it was loaded for, removed ones still in use included."""
        self._engine_ids = itertools.count(1)

    def engine_id(self, request: LoRARequest) -> int:
        """The engine id of `request`'s adapter, loaded now if it is not (ValueError if it cannot be
        read or does not fit the model, or if its id names another loaded adapter)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(request).__name__}")
        named = self._named.get(request.lora_int_id)
        if named is not None:
            loaded, engine_id = named
            if (loaded.lora_name, loaded.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is loaded as {loaded.lora_name!r} from "
                    f"{loaded.lora_path!r}, not {request.lora_name!r} from {request.lora_path!r}: "
                    "each adapter needs an id of its own")
            self._named.move_to_end(request.lora_int_id)
            return engine_id
        adapter = LoRAAdapter.load(request, self.config, max_rank=self.max_rank, dtype=self.dtype,
                                   device=self.device)
        engine_id = next(self._engine_ids)
        self.layers.add(dataclasses.replace(adapter, int_id=engine_id))
        self._loaded[engine_id] = request
        self._named[request.lora_int_id] = (request, engine_id)
        self.evict(keep=engine_id)
        return engine_id

    def add(self, request: LoRARequest) -> bool:
        """Load `request`'s adapter (vLLM's `add_lora`); False if it was loaded already."""
        loaded = request.lora_int_id in self._named if isinstance(request, LoRARequest) else False
        self.engine_id(request)
        return not loaded

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter of `lora_int_id` (vLLM's `remove_lora`): unloaded now if no live
        request uses it, else when the last one ends. False if no adapter has that id."""
        if self._named.pop(lora_int_id, None) is None:
            return False
        self.evict()
        return True

    def user_ids(self) -> set[int]:
        """The `lora_int_id`s loaded (vLLM's `list_loras`)."""
        return set(self._named)

    def evict(self, keep: int = 0) -> None:
        """Unload the adapters no live request uses and no user id names, and the least recently
        named of those no live request uses beyond max_cpu_loras (never `keep`)."""
        in_use = self.in_use()
        named = {engine_id for _, engine_id in self._named.values()}
        for engine_id in self.layers.loaded_ids - named - in_use:
            self._unload(engine_id)
        idle = [(user_id, engine_id) for user_id, (_, engine_id) in self._named.items()
                if engine_id not in in_use and engine_id != keep]
        for user_id, engine_id in idle[:max(0, len(self._named) - self.max_cpu_loras)]:
            del self._named[user_id]
            self._unload(engine_id)

    def _unload(self, engine_id: int) -> None:
        self.layers.remove(engine_id)
        del self._loaded[engine_id]

    def names(self, engine_ids: Set[int]) -> list[str]:
        """The `lora_name`s of loaded adapters, by engine id, sorted."""
        return sorted(self._loaded[engine_id].lora_name for engine_id in engine_ids)

    @property
    def has_removed_in_use(self) -> bool:
        """Whether an adapter `remove` forgot is still loaded for the requests that use it."""
        return bool(self.layers.loaded_ids - {engine_id for _, engine_id in self._named.values()})
