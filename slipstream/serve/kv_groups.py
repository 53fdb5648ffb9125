"""KV cache groups: which layers share a block table, and which cache tensor each layer uses.

A layer with a sliding window of W tokens only ever reads the last W keys, so the blocks it holds
wholly before the window can go back to the pool while its request runs (vLLM v1's hybrid KV cache
manager). Layers are sorted into kinds by window (None: full attention), and each kind is cut into
groups of the same number S of layers; each group has its own block table per request, and the
cache holds S key/value tensor pairs, each of the pool's blocks: the j-th layer of every group
uses pair j, so one block id is one page in each of S layers, whichever group holds it.

S is vLLM's choice (`_get_kv_cache_groups_uniform_page_size`): the fewest layers of any kind, or
the most where that is under 1.5 times the fewest (12 windowed + 13 full layers make two groups
of 13, one slot idle, rather than three groups of 12, one windowed and two full, with 11 slots
idle: vLLM's "(12 sw, 24 full)"); the last group of a kind may then have fewer layers than
S, its missing slots idle. A kind of n layers makes ceil(n / S) groups, group i taking its layers
i, i + k, i + 2k, ... (k groups), as in vLLM. A model of one kind, or any model when the hybrid
manager is disabled, has one group of all its layers, windowless when disabled (every block kept):
today's layout, pair l for layer l.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheGroups:
    """The grouping of a model's layers (see the module docstring)."""

    windows: tuple[int | None, ...]
    """Each group's sliding window in tokens; None for full attention (nothing released)."""
    layer_groups: tuple[int, ...]
    """Each layer's group."""
    layer_slots: tuple[int, ...]
    """Each layer's key/value tensor pair."""

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """Key/value tensor pairs the cache holds (S): the bytes of a block are those of S layers."""
        return max(self.layer_slots) + 1

    @property
    def has_windows(self) -> bool:
        """Whether some group releases blocks (the pool then keeps a null block, see kv_cache.py)."""
        return any(window is not None for window in self.windows)

    def describe(self) -> str:
        """One line for the start-up log."""
        kinds = [f"{'full' if w is None else f'window {w}'}: layers "
                 f"{[i for i, g in enumerate(self.layer_groups) if g == group]}"
                 for group, w in enumerate(self.windows)]
        return f"{self.num_groups} KV cache group(s) of {self.num_slots} layer(s): " + "; ".join(kinds)


def group_layers(
    layer_windows: Sequence[int | None], *, hybrid: bool = True, max_model_len: int | None = None,
    block_size: int = 1,
) -> KVCacheGroups:
    """The groups of a model whose layer i has sliding window `layer_windows[i]` (None: full).
    Without `hybrid` (vLLM's disable_hybrid_kv_cache_manager), one windowless group of all.

    Given `max_model_len`, a window of more than `max_model_len - block_size` tokens counts as
    full attention: no position a request reaches puts a whole block of `block_size` before it,
    so its group would never release one, and would only cost a group (Gemma 2's window of 4096
    at max_model_len 4096 leaves one group, not two)."""
    for i, window in enumerate(layer_windows):
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"layer {i}'s sliding window must be a positive integer or None, got {window!r}")
    if not layer_windows:
        raise ValueError("a model needs at least one layer to cache")
    if max_model_len is not None:
        longest = max_model_len - block_size  # a longer window never has a whole block before it
        layer_windows = [None if w is not None and w > longest else w for w in layer_windows]
    num_layers = len(layer_windows)
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window if hybrid else None, []).append(layer)
    if len(kinds) == 1:
        (window, layers), = kinds.items()
        return KVCacheGroups((window,), (0,) * num_layers, tuple(range(num_layers)))
    sizes = [len(layers) for layers in kinds.values()]
    size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    windows: list[int | None] = []
    layer_groups, layer_slots = [0] * num_layers, [0] * num_layers
    for window, layers in kinds.items():
        num_kind_groups = -(-len(layers) // size)
        for i in range(num_kind_groups):
            for slot, layer in enumerate(layers[i::num_kind_groups]):
                layer_groups[layer], layer_slots[layer] = len(windows), slot
            windows.append(window)
    return KVCacheGroups(tuple(windows), tuple(layer_groups), tuple(layer_slots))
