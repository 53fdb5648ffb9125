"""Paged KV cache bookkeeping: a pool of fixed-size blocks, per-request block tables and a prefix
cache of full blocks. Plain Python, no torch: the runner owns the tensors, this module decides
which block ids hold which tokens.

Prefix cache. A full block is known by its key, (key id of the block before it, its token ids):
the parent's key id (0 for a sequence's first block) and the tuple of its `block_size` token ids.
Key ids are handed out once per registered block and never reused, so equal keys mean equal token
ids over the whole prefix. The dict compares keys by value, so a hash collision costs a probe,
never wrong KV. (vLLM and nano-vllm chain hashes of (parent hash, tokens) and compare one block's
tokens on a hit; comparing keys by value makes the whole chain exact at the same cost.) A request
with a cache salt (vLLM's `cache_salt`) puts the salt, a string, in its first block's key in place
of the parent's 0, as vLLM mixes it into the first block's hash only: through the chain every block
of the request differs from those of requests with another salt or none, so they share nothing,
while requests with the same salt share their prefixes as usual. A request under a LoRA adapter
(`Request.lora_id`) puts the pair (adapter id, salt) there: its keys and values are the adapter's,
shared only with requests under the same adapter and salt.

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
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from slipstream.serve.request import Request

Root = int | str | tuple[int, str]
"""What a first block's key holds in place of a parent's key id (`_root`)."""
BlockKey = tuple[int | Root, tuple[int, ...]]
"""(key id of the parent block, or for a first block its root; token ids of the block)."""


@dataclasses.dataclass(slots=True)
class _Allocation:
    """The blocks one request holds."""

    request: Request
    block_ids: list[int]
    """The block table: block i holds the request's tokens [i * block_size, (i + 1) * block_size)."""
    key_ids: list[int] = dataclasses.field(default_factory=list)
    """Key id of each leading full, computed block (the request's own or an equal cached one)."""
    reserved_end: int = 0
    """The blocks after the last one, up to this id (exclusive), are softly reserved for it."""
    root: Root = 0
    """What the first block's key holds in place of a parent's key id (`_root`)."""


MAX_RUN_BLOCKS = 64
"""The most blocks a request reserves ahead of itself at a time."""


class KVCacheManager:
    """Reference-counted blocks, block tables per request id, and the prefix cache."""

    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0
        """Tokens of requests looked up in the prefix cache (first admissions only, as in vLLM; a
        request that skips the lookup, one that wants prompt logprobs, is not counted either)."""
        self.prefix_cache_hits = 0
        """Of those, tokens found in the cache."""
        self._ref_counts = [0] * num_blocks
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        self._block_key_ids = [0] * num_blocks
        self._cache: dict[BlockKey, int] = {}
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self._allocations: dict[str, _Allocation] = {}
        self._next_key_id = 1
        self._reserved_for: dict[int, str] = {}
        """Free blocks softly reserved for a request's growth: block id -> request id."""
        self._run_cursor = 0
        """Where the next search for a run of free blocks starts (next fit)."""

    # ----- metrics -----

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
        """Full blocks registered in the prefix cache, held or evictable."""
        return len(self._cache)

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table; empty if it holds no blocks."""
        allocation = self._allocations.get(request_id)
        return tuple(allocation.block_ids) if allocation else ()

    # ----- the scheduler's calls -----

    def lookup(self, request: Request, cache_salt: str | None = None) -> list[int]:
        """Cached blocks holding the longest prefix of the request's tokens, among those cached
        under the same cache salt (or none). Takes no references.

        Never all of its tokens: the last one must be computed to have logits to sample from, so
        a request whose tokens fill whole blocks backs off by one block (as vLLM does). A request
        that wants prompt logprobs gets no hits: every prompt position must be computed.
        """
        if not self._looks_up(request):
            return []
        block_ids: list[int] = []
        parent_key_id = _root(cache_salt, request.lora_id)
        for i in range((request.num_tokens - 1) // self.block_size):
            block = self._cache.get((parent_key_id, self._block_token_ids(request, i)))
            if block is None:
                break
            block_ids.append(block)
            parent_key_id = self._block_key_ids[block]
        return block_ids

    def allocate(
        self, request: Request, num_new_tokens: int, cached_block_ids: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> tuple[int, ...] | None:
        """Grow the request's block table to hold `num_new_tokens` more tokens; None if the pool
        is short of blocks, in which case nothing changed.

        A request holding no blocks starts from `cached_block_ids` (the result of `lookup`, taken
        with a reference each); its computed tokens are then those blocks' tokens, and its full
        blocks are cached under `cache_salt` (the one given to `lookup`). A request that holds
        blocks has `request.num_computed_tokens` computed.
        """
        num_needed = self._num_blocks_needed(request, num_new_tokens, cached_block_ids)
        if num_needed > self._num_available_blocks(cached_block_ids):
            return None
        allocation = self._allocations.get(request.request_id)
        if allocation is None:
            allocation = self._start_allocation(request, cached_block_ids, cache_salt)
        for _ in range(num_needed):
            allocation.block_ids.append(self._take_block_for(allocation))
        return tuple(allocation.block_ids)

    def max_new_tokens(self, request: Request, cached_block_ids: Sequence[int] = ()) -> int:
        """Most new tokens `allocate(request, ..., cached_block_ids)` would find blocks for now."""
        num_computed_tokens, num_held_blocks = self._progress(request, cached_block_ids)
        num_blocks = num_held_blocks + self._num_available_blocks(cached_block_ids)
        return num_blocks * self.block_size - num_computed_tokens

    def num_to_free(
        self, request: Request, num_new_tokens: int, cached_block_ids: Sequence[int],
        holders: Sequence[Request],
    ) -> int | None:
        """How many of `holders`, taken in order, must free all their blocks (as `free` does)
        before `allocate(request, num_new_tokens, cached_block_ids)` finds room: 0 if it does
        already, None if not even all of them would make enough. A block makes room only when
        every reference to it is among those dropped, and not when it is one of the cached blocks
        the request takes (it is then a hit rather than a block to write)."""
        num_short = (self._num_blocks_needed(request, num_new_tokens, cached_block_ids)
                     - self._num_available_blocks(cached_block_ids))
        if num_short <= 0:
            return 0
        taken = set(cached_block_ids)
        num_dropped: collections.Counter[int] = collections.Counter()
        for count, holder in enumerate(holders, start=1):
            allocation = self._allocations.get(holder.request_id)
            for block in allocation.block_ids if allocation else ():
                num_dropped[block] += 1
                if num_dropped[block] == self._ref_counts[block] and block not in taken:
                    num_short -= 1
            if num_short <= 0:
                return count
        return None

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache (prompt or output).

        A block whose key is already cached (a twin computed by another request in the same step)
        stays uncached; the request's chain continues through the cached twin's key id.
        """
        allocation = self._allocations.get(request.request_id)
        if allocation is None or not self.enable_prefix_caching:
            return
        key_ids = allocation.key_ids
        for i in range(len(key_ids), request.num_computed_tokens // self.block_size):
            key = (key_ids[-1] if key_ids else allocation.root, self._block_token_ids(request, i))
            twin = self._cache.get(key)
            if twin is not None:
                key_ids.append(self._block_key_ids[twin])
                continue
            block = allocation.block_ids[i]
            self._cache[key] = block
            self._block_keys[block] = key
            self._block_key_ids[block] = self._next_key_id
            key_ids.append(self._next_key_id)
            self._next_key_id += 1

    def free(self, request: Request) -> None:
        """Drop all the request's references at once; unheld blocks join the free queue."""
        allocation = self._allocations.pop(request.request_id, None)
        if allocation is None:
            return
        self._release_reservation(allocation)
        for block in reversed(allocation.block_ids):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._block_keys[block] is None:
                    self._free.move_to_end(block, last=False)

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
        self._cache.clear()
        self._block_keys = [None] * self.num_blocks
        self._block_key_ids = [0] * self.num_blocks
        self._run_cursor = 0
        return True

    # ----- internals -----

    def _block_token_ids(self, request: Request, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(request.token_ids_range(start, start + self.block_size))

    def _looks_up(self, request: Request) -> bool:
        """Whether `lookup` searches the cache for the request (as vLLM, a request that wants
        prompt logprobs skips it: every prompt position must be computed)."""
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def _progress(self, request: Request, cached_block_ids: Sequence[int]) -> tuple[int, int]:
        """(computed tokens, blocks held) of the request, once it holds `cached_block_ids` if it
        holds no blocks yet."""
        allocation = self._allocations.get(request.request_id)
        if allocation is None:
            return len(cached_block_ids) * self.block_size, len(cached_block_ids)
        assert not cached_block_ids, "cached blocks are only taken by a request's first allocation"
        return request.num_computed_tokens, len(allocation.block_ids)

    def _num_available_blocks(self, cached_block_ids: Sequence[int]) -> int:
        """Free blocks left to write once the free ones among `cached_block_ids` are taken as hits."""
        return len(self._free) - sum(1 for block in cached_block_ids if self._ref_counts[block] == 0)

    def _num_blocks_needed(
        self, request: Request, num_new_tokens: int, cached_block_ids: Sequence[int]
    ) -> int:
        """Blocks to add to the request's table for `num_new_tokens` more tokens."""
        num_computed_tokens, num_held_blocks = self._progress(request, cached_block_ids)
        return -(-(num_computed_tokens + num_new_tokens) // self.block_size) - num_held_blocks

    def _start_allocation(
        self, request: Request, cached_block_ids: Sequence[int], cache_salt: str | None
    ) -> _Allocation:
        for block in cached_block_ids:
            assert self._block_keys[block] is not None, "a cached block was evicted before it was taken"
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        allocation = _Allocation(
            request, list(cached_block_ids), [self._block_key_ids[block] for block in cached_block_ids],
            root=_root(cache_salt, request.lora_id),
        )
        self._allocations[request.request_id] = allocation
        if self._looks_up(request) and request.num_preemptions == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(cached_block_ids) * self.block_size
        return allocation

    def _take_block_for(self, allocation: _Allocation) -> int:
        """The block to append to the allocation's table: the one after its last block when that
        is free, keyless and not reserved for another request; else the start of a new run."""
        request_id = allocation.request.request_id
        if allocation.block_ids:
            block = allocation.block_ids[-1] + 1
            if block < self.num_blocks and self._placeable(block, request_id):
                return self._take(block)
        self._release_reservation(allocation)
        request = allocation.request
        num_tokens = request.num_prompt_tokens + request.max_output_tokens
        want = max(1, min(-(-num_tokens // self.block_size) - len(allocation.block_ids), MAX_RUN_BLOCKS))
        start = self._find_run(want)
        if start is None:
            return self._take_free_block()
        for block in range(start + 1, start + want):
            self._reserved_for[block] = request_id
        allocation.reserved_end = start + want
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

    def _placeable(self, block: int, request_id: str | None) -> bool:
        """Whether the block is free, keyless (taking it evicts nothing) and reserved for no one
        but `request_id` (for no one at all when it is None)."""
        return (block in self._free and self._block_keys[block] is None
                and self._reserved_for.get(block, request_id) == request_id)

    def _release_reservation(self, allocation: _Allocation) -> None:
        """Drop what remains of the allocation's reservation."""
        request_id = allocation.request.request_id
        first = allocation.block_ids[-1] + 1 if allocation.block_ids else allocation.reserved_end
        for block in range(first, allocation.reserved_end):
            if self._reserved_for.get(block) == request_id:
                del self._reserved_for[block]
        allocation.reserved_end = 0

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
            del self._cache[key]
            self._block_keys[block] = None
            self._block_key_ids[block] = 0
        self._ref_counts[block] = 1
        return block

    # ----- checks -----

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. O(tokens held): tests and debug."""
        holders = [0] * self.num_blocks
        for request_id, allocation in self._allocations.items():
            blocks = allocation.block_ids
            _expect(len(set(blocks)) == len(blocks), f"{request_id} holds a block twice: {blocks}")
            for block in blocks:
                holders[block] += 1
            self._check_allocation(request_id, allocation)
        _expect(holders == self._ref_counts, "reference counts differ from the block tables holding them")
        unheld = {block for block, count in enumerate(holders) if count == 0}
        _expect(set(self._free) == unheld, "the free queue is not exactly the blocks no request holds")
        num_held = sum(1 for count in holders if count)
        _expect(len(self._free) + num_held == self.num_blocks, "free + used != total")
        for key, block in self._cache.items():
            _expect(self._block_keys[block] == key, f"cached key maps to block {block} holding another key")
            _expect(len(key[1]) == self.block_size, f"cached block {block} is not full")
        num_keyed = sum(key is not None for key in self._block_keys)
        _expect(num_keyed == len(self._cache), "a block holds a key the cache does not map to it")
        key_ids = [key_id for key_id in self._block_key_ids if key_id]
        _expect(len(set(key_ids)) == len(key_ids) == num_keyed, "key ids are not unique per cached block")
        for block, request_id in self._reserved_for.items():
            _expect(block in self._free and self._block_keys[block] is None,
                    f"block {block} is reserved for {request_id} but held or cached")
            allocation = self._allocations.get(request_id)
            _expect(allocation is not None and allocation.block_ids[-1] < block < allocation.reserved_end,
                    f"block {block} is reserved for {request_id}, outside its reservation")

    def _check_allocation(self, request_id: str, allocation: _Allocation) -> None:
        """The table covers the computed tokens, and each of its cached blocks holds exactly the
        request's token ids at that position after exactly the request's prefix."""
        request = allocation.request
        _expect(request.request_id == request_id, f"allocation of {request_id} names another request")
        num_covered = len(allocation.block_ids) * self.block_size
        _expect(num_covered >= request.num_computed_tokens, f"{request_id}'s blocks miss computed tokens")
        _expect(len(allocation.key_ids) <= len(allocation.block_ids), f"{request_id}: keys past its blocks")
        for i, key_id in enumerate(allocation.key_ids):
            block = allocation.block_ids[i]
            key = self._block_keys[block]
            if key is None:  # an uncached twin of a block computed in the same step
                continue
            parent_key_id = allocation.key_ids[i - 1] if i else allocation.root
            _expect(
                key == (parent_key_id, self._block_token_ids(request, i)),
                f"{request_id}'s block {i} holds other token ids than the request",
            )
            _expect(self._block_key_ids[block] == key_id, f"{request_id}'s key id {i} is stale")


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
