"""Paged KV cache bookkeeping: a pool of fixed-size blocks, per-request block tables and a prefix
cache of full blocks. Plain Python, no torch: the runner owns the tensors, this module decides
which block ids hold which tokens.

Prefix cache. A full block is known by its key, (key id of the block before it, its token ids):
the parent's key id (0 for a sequence's first block) and the tuple of its `block_size` token ids.
Key ids are handed out when a key is cached where no group caches it yet (a group caching a key
another group holds takes that group's id) and never name another key, so equal keys mean equal
token ids over the whole prefix. The dict compares keys by value, so a hash collision costs a probe,
never wrong KV. (vLLM and nano-vllm chain hashes of (parent hash, tokens) and compare one block's
tokens on a hit; comparing keys by value makes the whole chain exact at the same cost.) A request
with a cache salt (vLLM's `cache_salt`) puts the salt, a string, in its first block's key in place
of the parent's 0, as vLLM mixes it into the first block's hash only: through the chain every block
of the request differs from those of requests with another salt or none, so they share nothing,
while requests with the same salt share their prefixes as usual. A request under a LoRA adapter
(`Request.lora_id`) puts the pair (adapter id, salt) there: its keys and values are the adapter's,
shared only with requests under the same adapter and salt. A block holding image placeholders
(`Request.images`) adds each such image's content hash after its token ids, so two prompts with
the same text and different images share nothing from that block on, and the same image hits (as
vLLM mixes the images' hashes into the block hashes).

Free blocks wait in one LRU queue (an OrderedDict: O(1) at both ends and in the middle). A freed
block that holds a key joins the tail and stays hittable until allocation takes it from the head,
which is when its key is evicted; a freed block without a key joins the head, since reusing it
first loses nothing. A request's blocks are freed tail first, so a prefix outlives its suffixes.
`reset_prefix_cache` drops every key and moves the blocks that held one to the head, in ascending
order: reused before blocks never written, whose pages the first write must fault in.

Placement. A request's blocks are kept next to each other in memory where the pool allows, since
the CPU decode attention streams each sequence's rows block after block and the hardware
prefetcher follows ascending addresses only (benchmarks/decode_attention.py's shuffled tables;
the batch-64 bf16 decode of serve_offline.py, block tables taken from the engine at its 125th
step against the same blocks laid out per sequence: 0.50 against 0.40 ms per layer on a Zen 5).
Decoding sequences each take a block every block_size steps, so without care their blocks
interleave. A request starting a run of blocks takes the first of `want` neighbouring free,
keyless blocks (`want`: what its prompt and max output need, at most MAX_RUN_BLOCKS) and softly
reserves the rest for itself: it grows into the block after its last one while that block is
free, and other runs are placed past its reservation. A reservation holds no memory: blocks are
taken from the queue's head when no run is found nearby, reserved or not.

Groups (kv_groups.py; vLLM v1's hybrid KV cache manager). Each KV cache group of layers has its own
block table per request, all drawn from the one pool. A group whose layers attend within a
sliding window of W tokens never reads a key more than W - 1 positions before the token it
computes, so once a request's first uncomputed token is at position c, its blocks wholly before
c - W + 1 are released (vLLM's `remove_skipped_blocks`, done as each step's computed tokens are
recorded, which is before the next step is planned): they go back to the free queue as a freed
block does, keeping their key, and the table holds the null block in their place, an id one past
the pool's that is never allocated, free or owned, and whose pages the runner zero-fills, so that
an attention path that gathers it and masks it stays finite. A request needs as many blocks in
each group at a time as its table holds past its released ones: every block of its tokens in a
full-attention group, the window plus the step's chunk in a sliding one.

Keys across groups. A key id names a prefix, not a block: all groups that cache the same key use
the same key id (a registration takes the id another group holds for that key, if any), and a
request's `key_ids` are shared by its groups. A lookup walks the chain of keys from the root; a
key is found where some group still caches a block under it. The hit is the longest prefix, in
whole blocks, that every group can serve: a full-attention group needs every block of it, a
sliding group only the blocks that the window of the first token after the hit reads (vLLM's
`find_longest_cache_hit` per group, the hybrid coordinator taking the shortest). Where we differ
from vLLM: vLLM hashes tokens, so it can find a window's blocks even when every group evicted the
blocks before them; our chain of keys needs each block of the prefix still cached in some group,
so a model whose layers all have windows (Mistral) hits only prefixes that some group still
holds in full, from the first block on.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Iterator, Sequence

from slipstream.serve.request import Request

Root = int | str | tuple[int, str]
"""What a first block's key holds in place of a parent's key id (`_root`)."""
BlockKey = tuple[int | Root, tuple[int, ...]]
"""(key id of the parent block, or for a first block its root; token ids of the block)."""
BlockTables = tuple[tuple[int, ...], ...]
"""A request's block table in each group, in group order."""


@dataclasses.dataclass(frozen=True, slots=True)
class CachedPrefix:
    """A prefix-cache hit (`lookup`): its whole blocks, in each group."""

    groups: BlockTables
    """Each group's table of the hit: a cached block, or the null block where the group's window
    does not reach back to it."""
    key_ids: tuple[int, ...]
    """The key id of each block of the hit."""

    def __len__(self) -> int:
        """Blocks of the hit."""
        return len(self.key_ids)


NO_HIT = CachedPrefix((), ())


@dataclasses.dataclass(slots=True)
class _Allocation:
    """The blocks one request holds."""

    request: Request
    tables: list[list[int]]
    """Each group's block table: block i holds the request's tokens [i * block_size, (i + 1) *
    block_size), or is the null block where a sliding group released it."""
    key_ids: list[int]
    """Key id of each leading full, computed block (the request's own or an equal cached one)."""
    num_released: list[int]
    """Per group, how many leading blocks of the table are released (the null block)."""
    num_registered: list[int]
    """Per group, how many leading blocks have had their chance to join the prefix cache."""
    reserved: list[range]
    """Per group, the free blocks softly reserved for the table's growth (those still free)."""
    root: Root = 0
    """What the first block's key holds in place of a parent's key id (`_root`)."""
    view: BlockTables | None = None
    """The tables as tuples, made when asked for and dropped when they change (a decode step
    mostly changes nothing)."""


MAX_RUN_BLOCKS = 64
"""The most blocks a request reserves ahead of itself at a time."""


class KVCacheManager:
    """Reference-counted blocks, block tables per request id and group, and the prefix cache."""

    def __init__(
        self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        """`windows`: each KV cache group's sliding window in tokens, None for full attention
        (`KVCacheGroups.windows`); one windowless group by default."""
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        windows = tuple(windows)
        check_windows("windows", windows)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = windows
        self._num_groups = len(windows)
        self.null_block: int | None = num_blocks if any(w is not None for w in windows) else None
        """Stands for a released block in a sliding group's table: one past the pool, never
        allocated (the runner's cache has a zero-filled page for it); None without windows."""
        self.prefix_cache_queries = 0
        """Tokens of requests looked up in the prefix cache (first admissions only, as in vLLM; a
        request that skips the lookup, one that wants prompt logprobs, is not counted either)."""
        self.prefix_cache_hits = 0
        """Of those, tokens found in the cache."""
        self._ref_counts = [0] * num_blocks
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        self._block_key_ids = [0] * num_blocks
        self._block_groups = [0] * num_blocks
        """The group whose cache a keyed block is in."""
        self._caches: list[dict[BlockKey, int]] = [{} for _ in windows]
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self._allocations: dict[str, _Allocation] = {}
        self._next_key_id = 1
        self._reserved_for: dict[int, tuple[str, int]] = {}
        """Free blocks softly reserved for a request's growth: block id -> (request id, group)."""
        self._run_cursor = 0
        """Where the next search for a run of free blocks starts (next fit)."""

    # ----- metrics -----

    @property
    def num_groups(self) -> int:
        return self._num_groups

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached (evictable) ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks registered in the prefix cache, held or evictable, in every group."""
        return sum(len(cache) for cache in self._caches)

    def block_ids(self, request_id: str, group: int = 0) -> tuple[int, ...]:
        """The request's block table in `group`; empty if it holds no blocks."""
        allocation = self._allocations.get(request_id)
        return tuple(allocation.tables[group]) if allocation else ()

    def block_tables(self, request_id: str) -> BlockTables:
        """The request's block table in each group; empty if it holds no blocks."""
        allocation = self._allocations.get(request_id)
        return tuple(map(tuple, allocation.tables)) if allocation else ()

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks of the pool the request holds, over all its groups (released ones not counted)."""
        allocation = self._allocations.get(request_id)
        return len(self._held(allocation)) if allocation else 0

    def held_block_ids(self) -> set[int]:
        """The pool's blocks some request holds (the others' pages may hold anything: tests
        poison them)."""
        return {block for allocation in self._allocations.values() for block in self._held(allocation)}

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens of KV may hold at once when computed
        in chunks of at most `max_chunk_tokens` (whole from the first token, or from a prefix hit):
        every block of them in a full-attention group; in a sliding group of window W, at most the
        blocks from the window's start before a chunk to its end, which are
        ceil((c + n) / B) - floor((c - W + 1) / B) <= (n + W + 2B - 3) // B for block size B."""
        return blocks_held(self.windows, self.block_size, num_tokens, max_chunk_tokens)

    # ----- the scheduler's calls -----

    def lookup(self, request: Request, cache_salt: str | None = None) -> CachedPrefix:
        """The longest prefix of the request's tokens, in whole blocks, that every group can serve
        from cached blocks (see the module docstring), among those cached under the same cache
        salt (or none). Takes no references.

        Never all of its tokens: the last one must be computed to have logits to sample from, so
        a request whose tokens fill whole blocks backs off by one block (as vLLM does). A request
        that wants prompt logprobs gets no hits: every prompt position must be computed.
        """
        if not self._looks_up(request):
            return NO_HIT
        key_ids: list[int] = []
        found: list[list[int | None]] = []
        parent_key_id = _root(cache_salt, request.lora_id)
        for i in range((request.num_tokens - 1) // self.block_size):
            key = (parent_key_id, self._block_token_ids(request, i))
            blocks = [cache.get(key) for cache in self._caches]
            holder = next((block for block in blocks if block is not None), None)
            if holder is None:
                break
            found.append(blocks)
            parent_key_id = self._block_key_ids[holder]
            key_ids.append(parent_key_id)
        # runs[g][i]: how many blocks up to i (inclusive) group g has cached without a gap.
        runs = [list(_runs(blocks[g] is not None for blocks in found)) for g in range(self.num_groups)]
        num_hit = len(found)
        while num_hit and not all(runs[g][num_hit - 1] >= num_hit - self._first_read(g, num_hit)
                                  for g in range(self.num_groups)):
            num_hit -= 1
        tables = tuple(
            tuple(found[i][g] if i >= self._first_read(g, num_hit) else self.null_block
                  for i in range(num_hit))
            for g in range(self.num_groups)
        )
        return CachedPrefix(tables, tuple(key_ids[:num_hit])) if num_hit else NO_HIT

    def allocate(
        self, request: Request, num_new_tokens: int, cached: CachedPrefix = NO_HIT,
        cache_salt: str | None = None,
    ) -> BlockTables | None:
        """Grow the request's block tables to hold `num_new_tokens` more tokens; None if the pool
        is short of blocks, in which case nothing changed but the release of blocks its windows
        no longer reach (`release_skipped_blocks`).

        A request holding no blocks starts from `cached` (the result of `lookup`, taken with a
        reference each); its computed tokens are then those blocks' tokens, and its full blocks
        are cached under `cache_salt` (the one given to `lookup`). A request that holds blocks has
        `request.num_computed_tokens` computed.
        """
        self.release_skipped_blocks(request)
        num_needed = self._num_blocks_needed(request, num_new_tokens, cached)
        if num_needed * self._num_groups > self._num_available_blocks(cached):
            return None
        allocation = self._allocations.get(request.request_id)
        if allocation is None:
            allocation = self._start_allocation(request, cached, cache_salt)
        if num_needed:
            allocation.view = None
            for group, table in enumerate(allocation.tables):
                for _ in range(num_needed):
                    table.append(self._take_block_for(allocation, group))
        if allocation.view is None:
            allocation.view = tuple(map(tuple, allocation.tables))
        return allocation.view

    def max_new_tokens(self, request: Request, cached: CachedPrefix = NO_HIT) -> int:
        """Most new tokens `allocate(request, ..., cached)` would find blocks for now."""
        num_computed_tokens, num_held_blocks = self._progress(request, cached)
        num_blocks = num_held_blocks + self._num_available_blocks(cached) // self._num_groups
        return num_blocks * self.block_size - num_computed_tokens

    def num_to_free(
        self, request: Request, num_new_tokens: int, cached: CachedPrefix, holders: Sequence[Request],
    ) -> int | None:
        """How many of `holders`, taken in order, must free all their blocks (as `free` does)
        before `allocate(request, num_new_tokens, cached)` finds room: 0 if it does already, None
        if not even all of them would make enough. A block makes room only when every reference
        to it is among those dropped, and not when it is one of the cached blocks the request
        takes (it is then a hit rather than a block to write)."""
        num_short = (self._num_blocks_needed(request, num_new_tokens, cached) * self._num_groups
                     - self._num_available_blocks(cached))
        if num_short <= 0:
            return 0
        taken = self._taken(cached)
        num_dropped: collections.Counter[int] = collections.Counter()
        for count, holder in enumerate(holders, start=1):
            allocation = self._allocations.get(holder.request_id)
            for block in self._held(allocation) if allocation else ():
                num_dropped[block] += 1
                if num_dropped[block] == self._ref_counts[block] and block not in taken:
                    num_short -= 1
            if num_short <= 0:
                return count
        return None

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache (prompt or output),
        in every group.

        A block whose key is already cached in its group (a twin computed by another request in
        the same step) stays uncached; the request's chain continues through the twin's key id.
        """
        allocation = self._allocations.get(request.request_id)
        if allocation is None or not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        first = min(allocation.num_registered)
        if first >= num_full:  # most steps of a decode: no block filled up
            return
        key_ids, keys = allocation.key_ids, []
        for i in range(first, num_full):
            key = (key_ids[i - 1] if i else allocation.root, self._block_token_ids(request, i))
            keys.append(key)
            if i == len(key_ids):
                key_ids.append(self._key_id_of(key))
        for group, (table, cache) in enumerate(zip(allocation.tables, self._caches, strict=True)):
            for i in range(allocation.num_registered[group], num_full):
                block, key = table[i], keys[i - first]
                if block == self.null_block or key in cache:
                    continue
                cache[key] = block
                self._block_keys[block] = key
                self._block_key_ids[block] = key_ids[i]
                self._block_groups[block] = group
            allocation.num_registered[group] = max(allocation.num_registered[group], num_full)

    def release_skipped_blocks(self, request: Request) -> None:
        """Release the blocks of the request's sliding groups that lie wholly before the window of
        its first uncomputed token (vLLM's rule): no later token reads them. They join the free
        queue as freed blocks do (their keys kept), and the null block takes their place."""
        allocation = self._allocations.get(request.request_id)
        if allocation is None or self.null_block is None:  # no group has a window
            return
        for group, table in enumerate(allocation.tables):
            num_skipped = min(len(table), self._first_read_block(group, request.num_computed_tokens))
            for i in range(allocation.num_released[group], num_skipped):
                self._drop_reference(table[i])
                table[i] = self.null_block
                allocation.view = None
            allocation.num_released[group] = max(allocation.num_released[group], num_skipped)

    def free(self, request: Request) -> None:
        """Drop all the request's references at once; unheld blocks join the free queue."""
        allocation = self._allocations.pop(request.request_id, None)
        if allocation is None:
            return
        for group in range(self.num_groups):
            self._release_reservation(allocation, group)
        for group in reversed(range(self.num_groups)):
            for block in reversed(allocation.tables[group][allocation.num_released[group]:]):
                self._drop_reference(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (for benchmarks measuring a cold cache). Only possible while
        no request holds blocks; returns whether it was done."""
        if self.num_used_blocks:
            return False
        # Keyless now, the blocks that held keys go to the head as freed keyless blocks do, ahead of
        # blocks never used: their pages are already mapped (a first write to a fresh block's pages
        # faults and zeroes them, ~5% of a bf16 offline round of the bench model when every round
        # took fresh blocks) and may still be in cache. In ascending order, as the pool starts, so
        # that a prompt's blocks are again neighbours in memory.
        held = sorted(block for block in self._free if self._block_keys[block] is not None)
        for block in reversed(held):
            self._free.move_to_end(block, last=False)
        for cache in self._caches:
            cache.clear()
        self._block_keys = [None] * self.num_blocks
        self._block_key_ids = [0] * self.num_blocks
        self._run_cursor = 0
        return True

    # ----- internals -----

    def _block_token_ids(self, request: Request, index: int) -> tuple[int | str, ...]:
        """Block `index`'s token ids, then the content hashes of the images whose placeholders it
        holds (strings, never equal to an id), so that equal placeholders of different images
        never make equal keys."""
        start = index * self.block_size
        tokens = tuple(request.token_ids_range(start, start + self.block_size))
        return tokens + request.image_hashes(start, start + self.block_size) if request.images else tokens

    def _first_read_block(self, group: int, position: int) -> int:
        """The first block that the group's layers read for a token at `position` (0 for full
        attention): the one holding position - window + 1."""
        window = self.windows[group]
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def _first_read(self, group: int, num_blocks: int) -> int:
        """The first block a hit of `num_blocks` blocks needs in the group: the first one the
        window of the token after the hit reads."""
        return self._first_read_block(group, num_blocks * self.block_size)

    def _key_id_of(self, key: BlockKey) -> int:
        """The key id that groups caching `key` hold for it, or a new one if none does."""
        for cache in self._caches:
            block = cache.get(key)
            if block is not None:
                return self._block_key_ids[block]
        self._next_key_id += 1
        return self._next_key_id - 1

    def _taken(self, cached: CachedPrefix) -> set[int]:
        """The pool's blocks a hit takes (the null block is none of them)."""
        return {block for table in cached.groups for block in table if block != self.null_block}

    def _held(self, allocation: _Allocation) -> list[int]:
        """The pool's blocks the allocation holds, in every group."""
        return [block for table, released in zip(allocation.tables, allocation.num_released, strict=True)
                for block in table[released:]]

    def _drop_reference(self, block: int) -> None:
        """One reference fewer; an unheld block joins the free queue, at the tail if it holds a key
        (still hittable), else at the head (reused first, losing nothing)."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None
            if self._block_keys[block] is None:
                self._free.move_to_end(block, last=False)

    def _looks_up(self, request: Request) -> bool:
        """Whether `lookup` searches the cache for the request (as vLLM, a request that wants
        prompt logprobs skips it: every prompt position must be computed)."""
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def _progress(self, request: Request, cached: CachedPrefix) -> tuple[int, int]:
        """(computed tokens, length of each group's table) of the request, once it holds `cached`
        if it holds no blocks yet."""
        allocation = self._allocations.get(request.request_id)
        if allocation is None:
            return len(cached.key_ids) * self.block_size, len(cached.key_ids)
        assert not cached.key_ids, "cached blocks are only taken by a request's first allocation"
        return request.num_computed_tokens, len(allocation.tables[0])

    def _num_available_blocks(self, cached: CachedPrefix) -> int:
        """Free blocks left to write once the free ones among the hit's blocks are taken."""
        if not cached.key_ids:
            return len(self._free)
        return len(self._free) - sum(1 for block in self._taken(cached) if self._ref_counts[block] == 0)

    def _num_blocks_needed(self, request: Request, num_new_tokens: int, cached: CachedPrefix) -> int:
        """Blocks to add to each group's table for `num_new_tokens` more tokens."""
        num_computed_tokens, num_table_blocks = self._progress(request, cached)
        return max(0, -(-(num_computed_tokens + num_new_tokens) // self.block_size) - num_table_blocks)

    def _start_allocation(
        self, request: Request, cached: CachedPrefix, cache_salt: str | None
    ) -> _Allocation:
        tables = [list(table) for table in cached.groups] or [[] for _ in self.windows]
        for block in (block for table in tables for block in table if block != self.null_block):
            assert self._block_keys[block] is not None, "a cached block was evicted before it was taken"
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        num_released = [sum(1 for block in table if block == self.null_block) for table in tables]
        allocation = _Allocation(
            request, tables, list(cached.key_ids), num_released, [len(cached)] * self.num_groups,
            [range(0)] * self.num_groups, root=_root(cache_salt, request.lora_id),
        )
        self._allocations[request.request_id] = allocation
        if self._looks_up(request) and request.num_preemptions == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(cached) * self.block_size
        return allocation

    def _take_block_for(self, allocation: _Allocation, group: int) -> int:
        """The block to append to the group's table: the one after its last block when that is
        free, keyless and not reserved for another request or group; else the start of a new run."""
        owner = (allocation.request.request_id, group)
        table = allocation.tables[group]
        if table and table[-1] != self.null_block:
            block = table[-1] + 1
            if block < self.num_blocks and self._placeable(block, owner):
                return self._take(block)
        self._release_reservation(allocation, group)
        request = allocation.request
        size, window = self.block_size, self.windows[group]
        num_left = -(-(request.num_prompt_tokens + request.max_output_tokens) // size) - len(table)
        if window is not None:  # a sliding group holds about its window's blocks at a time
            num_left = min(num_left, -(-window // size) + 1)
        want = max(1, min(num_left, MAX_RUN_BLOCKS))
        start = self._find_run(want)
        if start is None:
            return self._take_free_block()
        for block in range(start + 1, start + want):
            self._reserved_for[block] = owner
        allocation.reserved[group] = range(start + 1, start + want)
        return self._take(start)

    def _find_run(self, want: int) -> int | None:
        """The first block of `want` neighbouring blocks that are free, keyless and unreserved,
        searching from the run cursor (next fit, wrapping around). A search looks at no more than
        4 * want + 64 ids, so that a pool without such runs costs little per block; the next
        search goes on from where it stopped."""
        run_start, run_length = 0, 0
        num_looked_at = min(self.num_blocks, 4 * want + 64)
        for step in range(num_looked_at):
            block = (self._run_cursor + step) % self.num_blocks
            if block == 0:
                run_length = 0  # a run does not wrap around the pool's end
            if self._placeable(block, None):
                if run_length == 0:
                    run_start = block
                run_length += 1
                if run_length == want:
                    self._run_cursor = (run_start + want) % self.num_blocks
                    return run_start
            else:
                run_length = 0
        self._run_cursor = (self._run_cursor + num_looked_at) % self.num_blocks
        return None

    def _placeable(self, block: int, owner: tuple[str, int] | None) -> bool:
        """Whether the block is free, keyless (taking it evicts nothing) and reserved for no one
        but `owner`, a (request id, group) (for no one at all when it is None)."""
        return (block in self._free and self._block_keys[block] is None
                and self._reserved_for.get(block, owner) == owner)

    def _release_reservation(self, allocation: _Allocation, group: int) -> None:
        """Drop what remains of the group's reservation for the allocation."""
        owner = (allocation.request.request_id, group)
        for block in allocation.reserved[group]:
            if self._reserved_for.get(block) == owner:
                del self._reserved_for[block]
        allocation.reserved[group] = range(0)

    def _take(self, block: int) -> int:
        """Take a free, keyless block out of the queue (and out of its reservation)."""
        del self._free[block]
        self._reserved_for.pop(block, None)
        self._ref_counts[block] = 1
        return block

    def _take_free_block(self) -> int:
        """The least recently freed block, its cached key (if any) evicted."""
        block, _ = self._free.popitem(last=False)
        self._reserved_for.pop(block, None)
        key = self._block_keys[block]
        if key is not None:
            del self._caches[self._block_groups[block]][key]
            self._block_keys[block] = None
            self._block_key_ids[block] = 0
        self._ref_counts[block] = 1
        return block

    # ----- checks -----

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. O(tokens held): tests and debug."""
        holders = [0] * self.num_blocks
        for request_id, allocation in self._allocations.items():
            blocks = self._held(allocation)
            _expect(len(set(blocks)) == len(blocks), f"{request_id} holds a block twice: {blocks}")
            for block in blocks:
                holders[block] += 1
            self._check_allocation(request_id, allocation)
        _expect(holders == self._ref_counts, "reference counts differ from the block tables holding them")
        unheld = {block for block, count in enumerate(holders) if count == 0}
        _expect(set(self._free) == unheld, "the free queue is not exactly the blocks no request holds")
        num_held = sum(1 for count in holders if count)
        _expect(len(self._free) + num_held == self.num_blocks, "free + used != total")
        _expect(self.null_block is None or self.null_block == self.num_blocks,
                "the null block is one past the pool, outside the free queue and the reference counts")
        self._check_cache()
        for block, (request_id, group) in self._reserved_for.items():
            _expect(block in self._free and self._block_keys[block] is None,
                    f"block {block} is reserved for {request_id} but held or cached")
            allocation = self._allocations.get(request_id)
            _expect(allocation is not None and block in allocation.reserved[group],
                    f"block {block} is reserved for {request_id}, outside its reservation")

    def _check_cache(self) -> None:
        """Each cached key maps to a block holding it in that group; a key has one key id in all
        groups, and a key id one key."""
        ids_of_keys: dict[BlockKey, int] = {}
        keys_of_ids: dict[int, BlockKey] = {}
        for group, cache in enumerate(self._caches):
            for key, block in cache.items():
                _expect(self._block_keys[block] == key and self._block_groups[block] == group,
                        f"cached key maps to block {block} holding another key or in another group")
                num_token_ids = sum(not isinstance(item, str) for item in key[1])  # image hashes aside
                _expect(num_token_ids == self.block_size, f"cached block {block} is not full")
                key_id = self._block_key_ids[block]
                _expect(ids_of_keys.setdefault(key, key_id) == key_id, f"a key has two ids ({block})")
                _expect(keys_of_ids.setdefault(key_id, key) == key, f"key id {key_id} names two keys")
        num_keyed = sum(key is not None for key in self._block_keys)
        _expect(num_keyed == self.num_cached_blocks, "a block holds a key the cache does not map to it")

    def _check_allocation(self, request_id: str, allocation: _Allocation) -> None:
        """The tables cover the computed tokens, released blocks are exactly the leading null ones
        (none in a full-attention group), and each cached block holds exactly the request's token
        ids at that position after exactly the request's prefix."""
        request = allocation.request
        _expect(request.request_id == request_id, f"allocation of {request_id} names another request")
        num_table_blocks = len(allocation.tables[0])
        _expect(all(len(table) == num_table_blocks for table in allocation.tables),
                f"{request_id}'s tables cover different tokens")
        _expect(num_table_blocks * self.block_size >= request.num_computed_tokens,
                f"{request_id}'s blocks miss computed tokens")
        _expect(len(allocation.key_ids) <= num_table_blocks, f"{request_id}: keys past its blocks")
        for group, table in enumerate(allocation.tables):
            released = allocation.num_released[group]
            _expect(released == 0 or self.windows[group] is not None, f"{request_id}: a full group released")
            _expect(all(block == self.null_block for block in table[:released])
                    and self.null_block not in table[released:],
                    f"{request_id}'s group {group} table has the null block past its released ones")
            _expect(released <= self._first_read_block(group, request.num_computed_tokens),
                    f"{request_id}'s group {group} released a block its window still reads")
        for i, key_id in enumerate(allocation.key_ids):
            for table in allocation.tables:
                key = None if table[i] == self.null_block else self._block_keys[table[i]]
                if key is None:  # released, or an uncached twin of a block computed in the same step
                    continue
                parent_key_id = allocation.key_ids[i - 1] if i else allocation.root
                _expect(key == (parent_key_id, self._block_token_ids(request, i)),
                        f"{request_id}'s block {i} holds other token ids than the request")
                _expect(self._block_key_ids[table[i]] == key_id, f"{request_id}'s key id {i} is stale")


def check_windows(name: str, windows: object) -> None:
    """ValueError naming `name` unless `windows` is a non-empty tuple of one sliding window (a
    positive integer) or None per KV cache group."""
    if not isinstance(windows, tuple) or not windows or any(
            w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1) for w in windows):
        raise ValueError(f"{name} must be a tuple of one positive integer or None per KV cache group, "
                         f"got {windows!r}")


def blocks_held(
    windows: Sequence[int | None], block_size: int, num_tokens: int, max_chunk_tokens: int
) -> int:
    """`KVCacheManager.max_blocks_held` for groups of these windows."""
    all_blocks = -(-num_tokens // block_size)
    return sum(all_blocks if w is None
               else min(all_blocks, (max_chunk_tokens + w + 2 * block_size - 3) // block_size)
               for w in windows)


def _runs(flags: Iterable[bool]) -> Iterator[int]:
    """For each flag, how many flags up to it (inclusive) are True without a break."""
    run = 0
    for flag in flags:
        run = run + 1 if flag else 0
        yield run


def _root(cache_salt: str | None, lora_id: int) -> Root:
    """What a first block's key holds in place of a parent's key id: the salt, or 0 for none (as in
    vLLM, an empty salt is none); under a LoRA adapter, (its id, the salt or ""). Key ids are
    integers, so a salted key never equals an unsalted one, nor a pair either."""
    if lora_id:
        return lora_id, cache_salt or ""
    return cache_salt or 0


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
