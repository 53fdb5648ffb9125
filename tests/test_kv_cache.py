"""KVCacheManager: block accounting, prefix-cache hits and eviction order, through its public API."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slipstream.serve.kv_cache import NO_HIT, KVCacheManager
from slipstream.serve.request import Request, SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=8))


def compute(
    kv: KVCacheManager, request: Request, num_tokens: int, cache_salt: str | None = None
) -> tuple[int, ...]:
    """What the scheduler and runner do for one chunk: allocate, compute, register full blocks."""
    if not kv.block_ids(request.request_id):
        cached = kv.lookup(request, cache_salt)
        block_ids = kv.allocate(request, num_tokens, cached, cache_salt)
        request.num_computed_tokens = len(cached) * kv.block_size
    else:
        block_ids = kv.allocate(request, num_tokens)
    assert block_ids is not None
    request.num_computed_tokens += num_tokens
    kv.cache_full_blocks(request)
    kv.release_skipped_blocks(request)
    kv.check_invariants()
    return block_ids[0]


def test_import_does_not_load_torch():
    """kv_cache.py stays plain Python: importing it must not import torch."""
    code = "import sys, slipstream.serve.kv_cache; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_and_free_account_for_every_block():
    """Allocation takes ceil(tokens / block_size) blocks; free returns them all; counters agree."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", range(9))
    block_ids = compute(kv, request, 9)
    assert len(block_ids) == 3 and kv.num_used_blocks == 3 and kv.num_free_blocks == 7
    assert kv.usage == pytest.approx(0.3)
    assert kv.block_ids("a") == block_ids
    kv.free(request)
    kv.check_invariants()
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 10 and kv.block_ids("a") == ()


def test_allocation_failure_changes_nothing():
    """A request the pool cannot hold gets None and leaves every count as it was."""
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    compute(kv, make_request("a", range(8)), 8)
    request = make_request("b", range(100, 109))
    assert kv.allocate(request, 9) is None
    kv.check_invariants()
    assert kv.num_used_blocks == 2 and kv.block_ids("b") == () and kv.prefix_cache_queries == 8


def test_prefix_hit_shares_blocks_and_counts_tokens():
    """Two prompts sharing 3 full blocks: the second takes the first's blocks (ref count 2) and
    its 3 * block_size tokens count as hits; queries count every prompt token."""
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    shared = list(range(12))
    first = make_request("a", shared + [50, 51])
    first_blocks = compute(kv, first, first.num_tokens)
    second = make_request("b", shared + [60, 61, 62])
    cached = kv.lookup(second)
    assert cached.groups == (first_blocks[:3],)
    second_blocks = compute(kv, second, second.num_tokens - 12)
    assert second.num_computed_tokens == second.num_tokens
    assert second_blocks[:3] == first_blocks[:3] and second_blocks[3] != first_blocks[3]
    assert kv.prefix_cache_queries == 14 + 15 and kv.prefix_cache_hits == 12
    assert kv.num_used_blocks == 5  # 4 + the second's own tail block
    kv.free(first)
    kv.check_invariants()
    assert kv.num_used_blocks == 4  # shared blocks are still held by the second


def test_hit_never_covers_every_token():
    """A prompt whose every block is cached backs off one block, so its last token is computed."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    compute(kv, make_request("a", range(8)), 8)
    assert len(kv.lookup(make_request("b", range(8)))) == 1
    assert len(kv.lookup(make_request("c", range(9)))) == 2
    assert len(kv.lookup(make_request("d", range(7)))) == 1


def test_hit_needs_the_whole_prefix_identical():
    """A block with the same token ids after a different prefix is a miss: the chain is exact."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    compute(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]), 9)
    assert len(kv.lookup(make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))) == 0
    assert len(kv.lookup(make_request("c", [1, 2, 3, 4, 0, 6, 7, 8, 9]))) == 1


def test_generated_tokens_fill_cacheable_blocks():
    """Blocks filled by generated tokens are registered too, so a follow-up turn hits them."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", range(6))
    compute(kv, request, 6)
    for token_id in (100, 101, 102):  # decode: each sampled token is fed back next step
        request.output_token_ids.append(token_id)
        compute(kv, request, 1)
    assert kv.num_cached_blocks == 2
    kv.free(request)
    follow_up = make_request("b", list(range(6)) + [100, 101, 102, 7, 8])
    assert len(kv.lookup(follow_up)) == 2


def test_cached_blocks_survive_free_and_evict_least_recently_freed_first():
    """Freed cached blocks stay hittable; allocation reuses uncached blocks first, then evicts
    cached ones in the order they were freed, each request's tail block before its head."""
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    older = make_request("a", range(0, 9))  # 2 full blocks + 1 partial
    newer = make_request("b", range(100, 109))
    compute(kv, older, 9)
    compute(kv, newer, 9)
    kv.free(older)
    kv.free(newer)
    kv.check_invariants()
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 4
    filler = make_request("c", range(200, 212))
    kv.allocate(filler, 4)  # takes a partial (uncached) block: nothing evicted
    assert kv.num_cached_blocks == 4
    kv.allocate(make_request("d", range(300, 304)), 4)
    assert kv.num_cached_blocks == 4  # the other partial block
    kv.allocate(make_request("e", range(400, 404)), 4)  # evicts the older request's tail block
    assert len(kv.lookup(make_request("a2", range(0, 9)))) == 1
    assert len(kv.lookup(make_request("b2", range(100, 109)))) == 2
    kv.allocate(make_request("f", range(500, 508)), 8)  # the older head, then the newer tail
    assert len(kv.lookup(make_request("a3", range(0, 9)))) == 0
    assert len(kv.lookup(make_request("b3", range(100, 109)))) == 1
    kv.check_invariants()


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    """A hit revives an evictable block: it is held again and allocation cannot reuse it."""
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    first = make_request("a", range(9))
    compute(kv, first, 9)
    kv.free(first)
    second = make_request("b", list(range(8)) + [77])
    cached = kv.lookup(second)
    assert len(cached) == 2
    assert kv.allocate(second, 2, cached) is not None  # one new block; the two hits are held
    assert kv.num_free_blocks == 0
    assert kv.allocate(make_request("c", range(50, 54)), 4) is None


def test_twin_blocks_from_the_same_step_stay_consistent():
    """Two identical prompts computed before either is cached: the first's blocks are cached, the
    second's twins stay private, and a third request hits the first's blocks."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    first, second = make_request("a", range(9)), make_request("b", range(9))
    for request in (first, second):
        assert len(kv.lookup(request)) == 0 and kv.allocate(request, 9) is not None
    for request in (first, second):
        request.num_computed_tokens = 9
        kv.cache_full_blocks(request)
        kv.check_invariants()
    assert kv.num_cached_blocks == 2
    third = make_request("c", range(9))
    assert kv.lookup(third).groups[0] == kv.block_ids("a")[:2]
    kv.free(first)
    kv.free(second)
    kv.check_invariants()
    assert kv.num_used_blocks == 0


def test_a_request_that_skips_the_lookup_is_not_counted():
    """A request that wants prompt logprobs skips the lookup (every prompt position must be
    computed), and, as in vLLM, counts as neither a query nor a hit."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    compute(kv, make_request("a", range(9)), 9)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0)
    wants_logprobs = Request("b", list(range(9)), SamplingParams(max_tokens=8, prompt_logprobs=1))
    assert len(kv.lookup(wants_logprobs)) == 0
    compute(kv, wants_logprobs, 9)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0)
    compute(kv, make_request("c", range(9)), 1)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (18, 8)


def test_cache_salt_keys_the_first_block():
    """A salted request's blocks are hit only under the same salt, and unsalted blocks never under
    a salt: the salt takes the place of the first block's parent, so the whole chain differs."""
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prompt = list(range(13))  # 3 full blocks can hit
    compute(kv, make_request("plain", prompt), 13)
    compute(kv, make_request("salted", prompt), 13, cache_salt="tenant-1")
    assert kv.num_cached_blocks == 6  # equal token ids, two chains
    for salt, expected in ((None, "plain"), ("tenant-1", "salted"), ("tenant-2", None)):
        hits = kv.lookup(make_request("probe", prompt), salt)
        assert hits.groups == ((kv.block_ids(expected)[:3],) if expected else ()), salt
    follow_up = make_request("follow-up", prompt + [7, 7, 7])
    compute(kv, follow_up, 4, cache_salt="tenant-1")  # the whole chain continues under the salt
    assert kv.block_ids("follow-up")[:3] == kv.block_ids("salted")[:3]


def test_num_to_free_counts_only_blocks_that_would_become_writable():
    """How many holders must free their blocks before an allocation fits: a block counts once
    every holder of it is freed, and not when the request takes it as a cache hit."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_request("a", range(12))
    compute(kv, a, 12)  # 3 blocks, all cached
    b = make_request("b", [*range(8), 50, 51, 52])
    compute(kv, b, 3)  # a's first 2 blocks + 1 of its own
    assert kv.num_free_blocks == 6
    hitting = make_request("hitting", [*range(8), *range(100, 132)])  # 40 tokens: 8 new blocks
    hits = kv.lookup(hitting)
    assert hits.groups == (kv.block_ids("a")[:2],)
    assert kv.max_new_tokens(hitting, hits) == (2 + 6) * BLOCK_SIZE - 8
    assert kv.num_to_free(hitting, 24, hits, [b]) == 0  # fits already
    assert kv.num_to_free(hitting, 32, hits, [b]) is None  # b frees only its own block
    assert kv.num_to_free(hitting, 32, hits, [b, a]) == 2  # a's third block; the hits stay taken
    assert kv.num_to_free(hitting, 32, hits, [a, b]) == 2
    assert kv.num_to_free(hitting, 33, hits, [b, a]) is None
    other = make_request("other", range(200, 240))  # 10 new blocks, no hits
    assert kv.num_to_free(other, 40, NO_HIT, [b, a]) == 2  # 1 + 3, the shared two once both are freed
    assert kv.num_to_free(other, 40, NO_HIT, [b]) is None
    kv.free(b)
    kv.free(a)
    assert kv.allocate(other, 40) is not None
    kv.check_invariants()


def test_prefix_caching_disabled_never_hits():
    """With prefix caching off nothing is registered, looked up or counted."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    request = make_request("a", range(9))
    compute(kv, request, 9)
    kv.free(request)
    assert len(kv.lookup(make_request("b", range(9)))) == 0
    assert kv.num_cached_blocks == 0 and kv.prefix_cache_queries == 0


def test_reset_prefix_cache_only_when_idle():
    """reset_prefix_cache refuses while blocks are held and forgets every cached block after."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", range(9))
    compute(kv, request, 9)
    assert not kv.reset_prefix_cache()
    kv.free(request)
    assert kv.reset_prefix_cache()
    kv.check_invariants()
    assert kv.num_cached_blocks == 0 and len(kv.lookup(make_request("b", range(9)))) == 0


def test_blocks_used_before_a_reset_are_taken_before_fresh_ones():
    """After reset_prefix_cache the blocks that held keys are reused first (their memory is already
    mapped), in ascending order as the pool starts, before blocks no request has used."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    first = make_request("a", range(9))
    compute(kv, first, 9)
    used = kv.block_ids("a")
    kv.free(first)
    assert kv.reset_prefix_cache()
    second = make_request("b", range(100, 109))
    compute(kv, second, 9)
    assert kv.block_ids("b") == tuple(sorted(used))
    kv.check_invariants()


def decode_in_turns(kv: KVCacheManager, requests: list[Request], num_steps: int) -> None:
    """Every request takes one generated token per step, as a decode batch does."""
    for step in range(num_steps):
        for request in requests:
            request.output_token_ids.append(1000 + step)
            compute(kv, request, 1)


def test_a_request_grows_into_the_blocks_after_its_own():
    """Requests admitted one after another and then decoding in turns each keep their blocks
    side by side (the decode attention streams them in address order): a request starting a run
    reserves, softly, what its prompt and max_tokens need, and other runs go past it."""
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE)
    requests = [Request(f"r{i}", list(range(100 * i, 100 * i + 5 + i)), SamplingParams(max_tokens=12))
                for i in range(4)]
    for request in requests:
        compute(kv, request, request.num_prompt_tokens)
    decode_in_turns(kv, requests, 12)
    for request in requests:
        blocks = kv.block_ids(request.request_id)
        assert len(blocks) == -(-request.num_tokens // BLOCK_SIZE)
        assert list(blocks) == list(range(blocks[0], blocks[0] + len(blocks))), blocks
    for request in requests:
        kv.free(request)
    kv.check_invariants()


def test_a_request_past_its_reservation_still_takes_a_free_neighbour():
    """max_tokens=1 reserves nothing beyond the prompt's block; a request that grows anyway (as a
    preempted one's recomputed output may) takes the free block after its own."""
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=1))
    compute(kv, request, 3)
    other = Request("b", [7, 8], SamplingParams(max_tokens=1))
    assert compute(kv, other, 2) == (1,)  # the next run starts past it ...
    kv.free(other)  # ... and leaves block 1 free again
    request.output_token_ids += [5, 6]
    assert compute(kv, request, 2) == (0, 1)


def test_reservations_give_way_when_the_pool_is_short():
    """A reservation holds no memory: a pool with exactly the blocks the requests need serves
    them all, taking reserved blocks from their would-be owners, and frees them all after."""
    requests = [Request(f"r{i}", list(range(100 * i, 100 * i + 6)), SamplingParams(max_tokens=10))
                for i in range(3)]
    kv = KVCacheManager(num_blocks=3 * 4, block_size=BLOCK_SIZE)  # 16 tokens = 4 blocks each
    for request in requests:
        compute(kv, request, request.num_prompt_tokens)
    decode_in_turns(kv, requests, 9)
    assert kv.num_free_blocks == 0
    for request in requests:
        kv.free(request)
    kv.check_invariants()
    assert kv.num_free_blocks == 12


def test_check_invariants_catches_tokens_changed_under_a_cached_block():
    """A cached block must hold exactly its request's token ids; a mismatch is reported."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", range(9))
    compute(kv, request, 9)
    request.prompt_token_ids[1] = 99
    with pytest.raises(AssertionError, match="other token ids"):
        kv.check_invariants()


@pytest.mark.parametrize("field", ["num_blocks", "block_size"])
def test_bad_sizes_are_value_errors(field):
    """Non-positive pool sizes are rejected with the field's name."""
    sizes = {"num_blocks": 4, "block_size": 4} | {field: 0}
    with pytest.raises(ValueError, match=field):
        KVCacheManager(**sizes)


@pytest.mark.parametrize("windows", [(), (0,), (None, -1), (True,), ("8",)])
def test_bad_windows_are_value_errors(windows):
    with pytest.raises(ValueError, match="windows must be"):
        KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, windows=windows)


def test_a_sliding_group_releases_what_its_window_passed_and_hits_need_only_the_window():
    """A full group and a window of 6 tokens: after 16 tokens the sliding group holds only the
    blocks from position 16 - 6 + 1 = 11 on (block 2 of 4 tokens), the null block before; a
    request sharing the 16-token prefix hits 3 blocks (it must compute its last token), taking
    the full group's 3 and, in the sliding group, only those the window at position 12 reads
    (blocks 1 and 2: position 7 on), the null block for block 0."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, windows=(None, 6))
    first = make_request("a", range(16))
    compute(kv, first, 16)
    null = kv.null_block
    assert null == 16
    assert kv.block_ids("a", 0)[:2] != (null, null) and kv.block_ids("a", 1)[:2] == (null, null)
    assert kv.num_held_blocks("a") == 4 + 2 and kv.num_used_blocks == 6
    hit = kv.lookup(make_request("b", [*range(16), 99]))
    assert len(hit) == 4
    second = make_request("c", [*range(12), 99])
    hit = kv.lookup(second)
    assert len(hit) == 3
    assert hit.groups[0] == kv.block_ids("a", 0)[:3]
    assert hit.groups[1][0] == null and hit.groups[1][2] == kv.block_ids("a", 1)[2]
    kv.free(first)
    kv.check_invariants()
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 16
