"""Which LoRA adapters an engine has loaded: by the user's `lora_int_id`, each under an engine id
of its own that is never given to another adapter (so that the prefix cache, which keys blocks by
it, can never serve one adapter's keys and values to another, even after an id is reused).

An adapter is loaded the first time a request or `add` names its `lora_int_id`, and stays while
requests use it. Adapters no live request uses are kept up to `max_cpu_loras`, the least recently
named unloaded first (vLLM's CPU LoRA cache), except those `pin` keeps. `remove` forgets the
user's id at once (and its pin); its
adapter is unloaded once its last request ends, and a later request with that id loads it anew.

Under tensor parallelism each rank holds its part of every adapter, split as the model's
projections are (`shard_adapter`): the driver reads and checks an adapter once, keeps rank 0's
part and sends the whole to the workers, which keep theirs (`ShardedLoRALayers`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
from collections.abc import Callable, Set

import torch

from slipstream.model.config import ModelConfig
from slipstream.serve.lora import LoRAAdapter, LoRALayers, LoRARequest
from slipstream.serve.tensor_parallel import LoadLoRA, UnloadLoRA, Workers, kv_share

_ROWS_SPLIT = ("q_proj", "gate_proj", "up_proj")
"""Projections split by output rows (column-parallel): their B is split the same way; k_proj and
v_proj too, by K/V heads (`kv_share`)."""
_COLUMNS_SPLIT = ("o_proj", "down_proj")
"""Projections split by input columns (row-parallel): their A is split the same way."""


def shard_adapter(adapter: LoRAAdapter, config: ModelConfig, rank: int, size: int) -> LoRAAdapter:
    """Tensor-parallel rank `rank`'s part of `adapter`, split as `tensor_parallel.shard_model`
    splits the model: B's rows where the projection's rows are split (q, k, v, gate, up), A's
    columns where its columns are (o, down). Each rank adds its update to its own rows, or, for o
    and down, a partial sum that the ranks' all-reduce completes with the base layer's."""
    weights = {}
    for name, (a, b, scaling) in adapter.weights.items():
        projection = name.rsplit(".", 1)[-1]
        if projection in _ROWS_SPLIT:
            b = b.chunk(size)[rank]
        elif projection in ("k_proj", "v_proj"):
            part, parts = kv_share(config.num_key_value_heads, rank, size)
            b = b.chunk(parts)[part]
        elif projection in _COLUMNS_SPLIT:
            a = a.chunk(size, dim=1)[rank]
        else:
            raise ValueError(f"LoRA adapter {adapter.path}: no tensor-parallel split for module {name}")
        weights[name] = (a.contiguous(), b.contiguous(), scaling)
    return dataclasses.replace(adapter, weights=weights)


class ShardedLoRALayers:
    """The driver's `LoRALayers` under tensor parallelism, as `LoRARegistry` uses them: an
    adapter added is split, rank 0's part loaded here and the whole sent to the workers."""

    def __init__(self, layers: LoRALayers, workers: Workers, config: ModelConfig) -> None:
        self.layers = layers
        self.workers = workers
        self.config = config

    def add(self, adapter: LoRAAdapter) -> None:
        self.layers.add(shard_adapter(adapter, self.config, 0, self.workers.size))
        self.workers.send(LoadLoRA(adapter))

    def remove(self, int_id: int) -> None:
        self.layers.remove(int_id)
        self.workers.send(UnloadLoRA(int_id))

    @property
    def loaded_ids(self) -> frozenset[int]:
        return self.layers.loaded_ids


class LoRARegistry:
    """The adapters loaded into one model's `LoRALayers`."""

    def __init__(
        self, layers: LoRALayers | ShardedLoRALayers, config: ModelConfig, *, max_rank: int,
        max_cpu_loras: int, dtype: torch.dtype, device: torch.device, in_use: Callable[[], Set[int]],
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
        self._pinned: set[int] = set()
        """User ids `pin` keeps loaded while they are idle."""

    def engine_id(self, request: LoRARequest) -> int:
        """The engine id of `request`'s adapter, loaded now if it is not (ValueError if it cannot be
        read or does not fit the model, or if its id names another loaded adapter)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {request!r}")
        named = self._named.get(request.lora_int_id)
        if named is not None:
            loaded, engine_id = named
            if (loaded.lora_name, os.path.realpath(loaded.lora_path)) != (
                    request.lora_name, os.path.realpath(request.lora_path)):
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
        loaded = isinstance(request, LoRARequest) and request.lora_int_id in self._named
        self.engine_id(request)
        return not loaded

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter of `lora_int_id` (vLLM's `remove_lora`): unloaded now if no live
        request uses it, else when the last one ends. False if no adapter has that id."""
        if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {lora_int_id!r}")
        if self._named.pop(lora_int_id, None) is None:
            return False
        self._pinned.discard(lora_int_id)
        self.evict()
        return True

    def pin(self, lora_int_id: int) -> bool:
        """Keep the adapter of `lora_int_id` loaded while no request uses it, beyond max_cpu_loras
        (vLLM's `pin_lora`); ValueError if no adapter with that id is loaded."""
        if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {lora_int_id!r}")
        if lora_int_id not in self._named:
            raise ValueError(f"no LoRA adapter with lora_int_id {lora_int_id} is loaded (loaded: "
                             f"{sorted(self._named)}); add it first")
        self._pinned.add(lora_int_id)
        return True

    def user_ids(self) -> set[int]:
        """The `lora_int_id`s loaded (vLLM's `list_loras`)."""
        return set(self._named)

    def evict(self, keep: int = 0) -> None:
        """Unload the adapters no live request uses and no user id names, and the least recently
        named of those no live request uses beyond max_cpu_loras (never `keep` nor a pinned one)."""
        in_use = self.in_use()
        named = {engine_id for _, engine_id in self._named.values()}
        for engine_id in self.layers.loaded_ids - named - in_use:
            self._unload(engine_id)
        idle = [(user_id, engine_id) for user_id, (_, engine_id) in self._named.items()
                if engine_id not in in_use and engine_id != keep and user_id not in self._pinned]
        for user_id, engine_id in idle[:max(0, len(self._named) - self.max_cpu_loras)]:
            del self._named[user_id]
            self._unload(engine_id)

    def _unload(self, engine_id: int) -> None:
        self.layers.remove(engine_id)
        del self._loaded[engine_id]

    def names(self, engine_ids: Set[int]) -> list[str]:
        """The `lora_name`s of loaded adapters, by engine id, sorted."""
        return sorted({self._loaded[engine_id].lora_name for engine_id in engine_ids})

    @property
    def may_evict(self) -> bool:
        """Whether `evict` may have work: more adapters loaded than max_cpu_loras, or one that
        `remove` forgot still loaded (for the requests that used it)."""
        loaded = self.layers.loaded_ids
        return len(loaded) > self.max_cpu_loras or bool(loaded - {e for _, e in self._named.values()})
