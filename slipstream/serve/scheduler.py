"""The scheduler: which requests run each step, and how many tokens each. Plain Python, no torch.

One token budget per step, as in vLLM v1, with no prefill or decode phase: every scheduled request
catches up from `num_computed_tokens` towards `num_tokens`, so a long prompt is chunked over steps
and decodes ride in the same step as prefills.

Every request has one place in a total order: arrival (FCFS; `Request.priority` is ignored), or
(priority, arrival) under the priority policy, ties broken by the order of `add`. Running requests
are scheduled in that order; when the KV pool runs out of blocks, the running request that comes
last is preempted by recompute: its blocks are freed and it waits again, keeping its place in the
order (so it is re-admitted before later arrivals), to be recomputed with help from the prefix
cache. Then waiting requests are admitted in that order while the budget, `max_num_seqs` and the
pool allow; the first that does not fit stops admission (no overtaking), and a step that had to
preempt admits nobody. The one exception, as in vLLM: a request under a LoRA adapter
(`Request.lora_id`) that would make more distinct adapters run than `max_loras` is passed over,
keeping its place, and later ones may be admitted past it. Under the priority policy a waiting
request short of blocks may preempt running requests of strictly lower priority: the fewest, from
the tail, whose blocks make room for its chunk, and none at all when not even all of them would
(vLLM v1 never preempts for a waiting request).

The engine calls `schedule()`, runs the returned `StepPlan`, then calls `update()` with the sampled
tokens; `update()` advances the requests, applies stop conditions and frees finished requests. To run
several decode steps of a plan at once, the engine first takes blocks for all of them
(`reserve_lookahead`), then updates once per step, each time with that step's single-token chunks.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import logging
import math
from collections.abc import Collection, Iterable, Sequence

from slipstream.serve.kv_cache import BlockTables, CachedPrefix, KVCacheManager, check_windows
from slipstream.serve.request import FINISH_REASONS, Request, RequestStatus

logger = logging.getLogger(__name__)

POLICIES = ("fcfs", "priority")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Limits of one scheduling step and of the KV pool (whose size the engine computes)."""

    max_num_seqs: int
    """Most requests running at once."""
    max_num_batched_tokens: int
    """Token budget of one step, prompt chunks and decodes together."""
    block_size: int
    """Tokens per KV block."""
    num_blocks: int
    """Blocks in the KV pool."""
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    """"fcfs": arrival order; "priority": lower `Request.priority` first, then arrival."""
    long_prefill_token_threshold: int = 0
    """Most tokens one request may compute in a step; 0 means no cap beyond the budget."""
    max_loras: int = 1
    """Most distinct LoRA adapters among the running requests (vLLM's max_loras: per batch)."""
    kv_cache_windows: tuple[int | None, ...] = (None,)
    """Each KV cache group's sliding window, None for full attention (`KVCacheGroups.windows`):
    a sliding group releases the blocks its window no longer reaches."""
    disable_chunked_mm_input: bool = False
    """vLLM's option: every image's placeholders are computed in one chunk. A chunk that would end
    inside an image ends before it instead (nothing, where it starts inside one: the request waits
    for a step with budget for the rest of the image). Needed where an image's tokens attend to
    each other both ways (Gemma 3): a token cannot see keys not yet computed."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "max_loras"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, minimum=0)
        for name in ("enable_prefix_caching", "disable_chunked_mm_input"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_windows("kv_cache_windows", self.kv_cache_windows)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of one request, to compute this step."""

    request: Request
    start: int
    """The request's num_computed_tokens before this step: position of the first token."""
    num_tokens: int
    block_ids: BlockTables
    """The request's whole block table in each KV cache group, covering start + num_tokens tokens."""
    samples: bool
    """True iff the chunk reaches the end of the known tokens, so a new token must be sampled."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """What the runner executes in one step."""

    chunks: tuple[ScheduledChunk, ...]
    num_batched_tokens: int
    preempted_request_ids: tuple[str, ...]


@dataclasses.dataclass(slots=True)
class _StepBuilder:
    budget: int
    chunks: dict[str, ScheduledChunk] = dataclasses.field(default_factory=dict)
    preempted_ids: list[str] = dataclasses.field(default_factory=list)

    def add(self, request: Request, num_tokens: int, block_ids: BlockTables) -> None:
        start = request.num_computed_tokens
        samples = start + num_tokens == request.num_tokens
        self.chunks[request.request_id] = ScheduledChunk(request, start, num_tokens, block_ids, samples)
        self.budget -= num_tokens

    def preempted(self, request: Request) -> None:
        chunk = self.chunks.pop(request.request_id, None)
        if chunk is not None:
            self.budget += chunk.num_tokens
        self.preempted_ids.append(request.request_id)

    def build(self) -> StepPlan:
        chunks = tuple(self.chunks.values())
        return StepPlan(chunks, sum(chunk.num_tokens for chunk in chunks), tuple(self.preempted_ids))


class _WaitingQueue:
    """Waiting requests by their order key. Removal is lazy: entries of requests that are no
    longer waiting (aborted) are dropped when they reach the head."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Request]] = []
        self._num_waiting = 0

    def __len__(self) -> int:
        return self._num_waiting

    def push(self, key: tuple, request: Request) -> None:
        heapq.heappush(self._heap, (key, request))
        self._num_waiting += 1

    def peek(self) -> Request | None:
        while self._heap and self._heap[0][1].status is not RequestStatus.WAITING:
            heapq.heappop(self._heap)
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        request = self.peek()
        assert request is not None
        heapq.heappop(self._heap)
        self._num_waiting -= 1
        return request

    def discard(self, request: Request) -> None:
        """Forget a waiting request whose status already changed from WAITING."""
        assert request.status is not RequestStatus.WAITING
        self._num_waiting -= 1


class Scheduler:
    """Continuous batching under one token budget per step, with recompute preemption."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache = KVCacheManager(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            windows=config.kv_cache_windows,
        )
        self.num_preemptions = 0
        """Preemptions so far (vLLM's num_preemptions_total)."""
        self._requests: dict[str, Request] = {}
        self._order_keys: dict[str, tuple] = {}
        self._cache_salts: dict[str, str] = {}
        """Cache salts of the requests that have one (vLLM's cache_salt)."""
        self._waiting = _WaitingQueue()
        self._running: list[Request] = []
        """Sorted by order key, so the last is the one to preempt."""
        self._num_added = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def lora_ids_in_use(self, status: RequestStatus | None = None) -> set[int]:
        """The LoRA adapters (`Request.lora_id`) of the requests not finished, or of those with
        `status` (waiting or running)."""
        return {request.lora_id for request in self._requests.values()
                if request.lora_id and status in (None, request.status)}

    # ----- requests in and out -----

    def add(self, request: Request, *, cache_salt: str | None = None) -> None:
        """Queue a new request; ValueError if it is malformed or could never fit in the KV pool.
        With a `cache_salt` it shares prefix-cache blocks only with requests of the same salt
        (vLLM's cache_salt; as in vLLM, an empty salt is none)."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {cache_salt!r}")
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already queued")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not new (status {request.status.value})")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.max_output_tokens < 1:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens leaves no "
                f"room to generate within max_total_tokens={request.max_total_tokens}"
            )
        self._check_fits(request)
        self._check_images(request)
        order = (request.priority if self.config.policy == "priority" else 0, request.arrival_time_s)
        self._order_keys[request.request_id] = (*order, self._num_added)
        self._num_added += 1
        self._requests[request.request_id] = request
        if cache_salt:
            self._cache_salts[request.request_id] = cache_salt
        self._waiting.push(self._order_keys[request.request_id], request)

    def _check_fits(self, request: Request) -> None:
        """Reject a request that needs more KV than the whole pool: it could only livelock. Each
        KV cache group counts: all its blocks in a full-attention group, its window plus one
        step's chunk in a sliding one (`KVCacheManager.max_blocks_held`)."""
        # The last generated token is never fed back, so its KV is never needed.
        num_kv_tokens = request.num_prompt_tokens + request.max_output_tokens - 1
        config = self.config
        max_chunk = min(config.max_num_batched_tokens, config.long_prefill_token_threshold or num_kv_tokens)
        num_blocks = self.kv_cache.max_blocks_held(num_kv_tokens, max_chunk)
        if num_blocks > config.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} may need KV for {num_kv_tokens} tokens "
                f"({request.num_prompt_tokens} prompt + up to {request.max_output_tokens} output): "
                f"{num_blocks} blocks over {self.kv_cache.num_groups} KV cache group(s), but the KV cache "
                f"holds {config.num_blocks} blocks x {config.block_size} tokens = "
                f"{config.num_blocks * config.block_size} tokens; lower max_tokens or the prompt, or give "
                f"the cache more memory"
            )

    def _check_images(self, request: Request) -> None:
        """Under disable_chunked_mm_input, reject a request with an image longer than the most
        tokens one chunk may hold: it could never be scheduled."""
        if not self.config.disable_chunked_mm_input or not request.images:
            return
        config = self.config
        max_chunk = min(config.max_num_batched_tokens, config.long_prefill_token_threshold or math.inf)
        longest = max(image.length for image in request.images)
        if longest > max_chunk:
            raise ValueError(
                f"request {request.request_id!r} has an image of {longest} tokens, but one step computes at "
                f"most {max_chunk} tokens of a request (max_num_batched_tokens, "
                "long_prefill_token_threshold) "
                "and this model's images are computed whole (disable_chunked_mm_input)")

    def finish(self, request_id: str, reason: str) -> Request | None:
        """End a request the engine found finished (e.g. on a stop string) and free its blocks.
        Returns it, or None if it is unknown or already finished."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason must be one of {FINISH_REASONS}, got {reason!r}")
        request = self._requests.get(request_id)
        if request is None:
            return None
        was_running = request.status is RequestStatus.RUNNING
        self._release(request, reason)
        if was_running:
            self._running.remove(request)
        return request

    def abort(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Finish requests with reason "abort", waiting or running; unknown ids are ignored.
        Returns the requests aborted."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        aborted = [self.finish(request_id, "abort") for request_id in request_ids]
        return [request for request in aborted if request is not None]

    def _release(self, request: Request, reason: str) -> None:
        """Free its blocks, then mark it finished; the caller takes it out of `_running`. Freeing
        first: an exception there (an interrupt) leaves the request as it was, which an abort
        then releases, rather than a finished request still among the running ones."""
        self.kv_cache.free(request)
        was_waiting = request.status is RequestStatus.WAITING
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]
        del self._order_keys[request.request_id]
        self._cache_salts.pop(request.request_id, None)
        if was_waiting:
            self._waiting.discard(request)

    # ----- one step -----

    def schedule(self) -> StepPlan:
        """Plan the next step: running requests first, then admissions, under one token budget."""
        step = _StepBuilder(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted_ids:  # a step short of blocks admits nobody: it would only thrash
            self._schedule_waiting(step)
        return step.build()

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, budget: int) -> int:
        num_tokens = min(request.num_tokens - num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold:
            num_tokens = min(num_tokens, self.config.long_prefill_token_threshold)
        return self._whole_images(request, num_computed_tokens, num_tokens)

    def _whole_images(self, request: Request, start: int, num_tokens: int) -> int:
        """`num_tokens` from `start`, cut back to before the image that a chunk of them would end
        inside of under disable_chunked_mm_input (0 where the chunk starts inside it)."""
        if not self.config.disable_chunked_mm_input or start >= request.images_end:
            return num_tokens
        stop = start + num_tokens
        for image in request.images:
            if image.offset < stop < image.end:
                return max(0, image.offset - start)
        return num_tokens

    def _schedule_running(self, step: _StepBuilder) -> None:
        """Give each running request its tokens, in order, preempting from the tail when the pool
        runs dry. Victims come from behind the current request, so none was scheduled yet."""
        for request in list(self._running):
            if step.budget == 0:
                return
            if request.status is not RequestStatus.RUNNING:  # preempted for an earlier request
                continue
            num_new = self._num_new_tokens(request, request.num_computed_tokens, step.budget)
            if num_new == 0:  # the rest of an image it is inside of needs more budget than is left
                continue
            while (block_ids := self.kv_cache.allocate(request, num_new)) is None:
                victim = self._running[-1]
                self._preempt(victim, step)
                if victim is request:
                    return  # everything behind it is preempted already
            step.add(request, num_new, block_ids)

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        """Admit waiting requests in order until the budget, max_num_seqs or the pool runs out,
        passing over those whose adapter would exceed max_loras."""
        passed_over = []
        running_loras = {r.lora_id for r in self._running if r.lora_id}
        try:
            while step.budget > 0 and len(self._running) < self.config.max_num_seqs:
                request = self._waiting.peek()
                if request is None or request.request_id in step.preempted_ids:
                    return
                lora = request.lora_id
                if lora and lora not in running_loras and len(running_loras) >= self.config.max_loras:
                    passed_over.append(self._waiting.pop())
                    continue
                if not self._admit(request, step):
                    return
                if lora:
                    running_loras.add(lora)
        finally:
            for request in passed_over:
                self._waiting.push(self._order_keys[request.request_id], request)

    def _admit(self, request: Request, step: _StepBuilder) -> bool:
        """Start a waiting request from its longest cached prefix; False if blocks are short."""
        cache_salt = self._cache_salts.get(request.request_id)
        cached = self.kv_cache.lookup(request, cache_salt)
        num_cached_tokens = len(cached) * self.config.block_size
        num_new = self._num_new_tokens(request, num_cached_tokens, step.budget)
        if num_new == 0:  # an image to compute whole needs more budget than is left
            return False
        block_ids = self.kv_cache.allocate(request, num_new, cached, cache_salt)
        if block_ids is None:
            if not self._make_room(request, num_new, cached, step):
                return False
            # Victims planned in this step gave their tokens back: the chunk grows into them as
            # far as the blocks now free allow, never by preempting more (a larger chunk is no
            # reason to take another request's KV).
            num_new = self._whole_images(request, num_cached_tokens, min(
                self._num_new_tokens(request, num_cached_tokens, step.budget),
                self.kv_cache.max_new_tokens(request, cached)))
            if num_new == 0:  # the blocks freed fall short of an image to compute whole
                return False
            block_ids = self.kv_cache.allocate(request, num_new, cached, cache_salt)
            assert block_ids is not None, "the victims' blocks make room for the chunk"
        popped = self._waiting.pop()
        assert popped is request, "victims queue behind the request they make room for"
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached_tokens
        request.num_cached_prompt_tokens = min(num_cached_tokens, request.num_prompt_tokens)
        bisect.insort(self._running, request, key=lambda r: self._order_keys[r.request_id])
        step.add(request, num_new, block_ids)
        return True

    def _make_room(
        self, request: Request, num_new_tokens: int, cached: CachedPrefix, step: _StepBuilder
    ) -> bool:
        """Under the priority policy, preempt for a waiting request short of blocks the fewest
        running requests of strictly lower priority, taken from the tail, whose blocks make room
        for its chunk; when not even all of them would (the blocks they share with others stay
        held), preempt none and return False. Never one admitted this step: admission goes in
        priority order. A full house of max_num_seqs is not a reason to preempt."""
        if self.config.policy != "priority":
            return False
        candidates = list(itertools.takewhile(
            lambda running: running.priority > request.priority, reversed(self._running)))
        num_victims = self.kv_cache.num_to_free(request, num_new_tokens, cached, candidates)
        if not num_victims:
            return False
        for victim in candidates[:num_victims]:
            self._preempt(victim, step)
        return True

    def _preempt(self, request: Request, step: _StepBuilder) -> None:
        """Free all of a running request's blocks and queue it to be recomputed (output kept)."""
        assert self._running[-1] is request, "victims are taken from the tail of the running list"
        self._running.pop()
        self.kv_cache.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.push(self._order_keys[request.request_id], request)
        step.preempted(request)
        logger.debug("preempted %s (%d tokens to recompute)", request.request_id, request.num_tokens)

    def reserve_tokens(self, plan: StepPlan, num_tokens: Sequence[int]) -> list[BlockTables] | None:
        """Blocks for `num_tokens[i]` tokens from the start of chunk i of a plan of single-token
        chunks (several decode steps at once, or a decode plus guesses to check); returns their
        block tables, or None if the pool is short (nothing is preempted for it: the caller runs
        the plan as one step, and blocks already taken stay with their requests for their next
        steps)."""
        if any(chunk.num_tokens != 1 for chunk in plan.chunks):
            raise ValueError("only single-token (decode) chunks can take more tokens at once")
        tables = []
        for chunk, count in zip(plan.chunks, num_tokens, strict=True):
            table = self.kv_cache.allocate(chunk.request, count)
            if table is None:
                return None
            tables.append(table)
        return tables

    def reserve_lookahead(self, plan: StepPlan, num_steps: int) -> list[BlockTables] | None:
        """`reserve_tokens` of `num_steps` tokens for every chunk, for a runner that runs that many
        decode steps at once. For one step these are the tables the plan's chunks already hold."""
        if num_steps == 1 and all(chunk.num_tokens == 1 for chunk in plan.chunks):
            return [chunk.block_ids for chunk in plan.chunks]
        return self.reserve_tokens(plan, [num_steps] * len(plan.chunks))

    # ----- after the step -----

    def update(self, plan: StepPlan, sampled_token_ids: dict[str, int],
               pooled_ids: Collection[str] = ()) -> list[Request]:
        """Advance the requests the plan ran, append their sampled tokens and apply stop
        conditions; a request of `pooled_ids` (an embedding engine's) whose chunk reached the end
        of its prompt ends here with no token. Returns the requests that finished in this step,
        their blocks freed (full ones kept in the prefix cache). Each advanced request's sliding
        groups release the blocks their windows no longer reach."""
        finished = []
        try:
            for chunk in plan.chunks:
                request = chunk.request
                if request.is_finished:  # finished or aborted since schedule()
                    continue
                assert request.num_computed_tokens == chunk.start, "plans must be updated in order"
                request.num_computed_tokens += chunk.num_tokens
                pooled = chunk.samples and request.request_id in pooled_ids
                if chunk.samples and not pooled:
                    request.output_token_ids.append(sampled_token_ids[request.request_id])
                self.kv_cache.cache_full_blocks(request)
                self.kv_cache.release_skipped_blocks(request)
                reason = "stop" if pooled else _stop_reason(request) if chunk.samples else None
                if reason is not None:
                    self._release(request, reason)
                    finished.append(request)
        finally:  # those released before an exception leave the running list all the same
            if finished:
                self._running = [request for request in self._running if not request.is_finished]
        return finished

    def check_invariants(self) -> None:
        """Raise AssertionError if the scheduler's or the KV cache's bookkeeping is inconsistent."""
        self.kv_cache.check_invariants()
        keys = [self._order_keys[request.request_id] for request in self._running]
        _expect(keys == sorted(keys), "running requests are out of order")
        _expect(len(self._running) <= self.config.max_num_seqs, "more running requests than max_num_seqs")
        running_loras = {request.lora_id for request in self._running if request.lora_id}
        _expect(len(running_loras) <= self.config.max_loras, "more running LoRA adapters than max_loras")
        num_waiting = 0
        for request_id, request in self._requests.items():
            _expect(not request.is_finished, f"finished request {request_id} is still tracked")
            holds_blocks = bool(self.kv_cache.block_ids(request_id))
            if request.status is RequestStatus.WAITING:
                num_waiting += 1
                _expect(not (holds_blocks or request.num_computed_tokens), f"waiting {request_id} has KV")
            else:
                _expect(holds_blocks, f"running request {request_id} holds no blocks")
                _expect(request.num_computed_tokens < request.num_tokens, f"{request_id}: nothing to compute")
        _expect(num_waiting == len(self._waiting), "the waiting count is off")
        _expect(num_waiting + len(self._running) == len(self._requests), "requests lost or duplicated")
        _expect(self._cache_salts.keys() <= self._requests.keys(), "a finished request's cache salt is kept")


def _stop_reason(request: Request) -> str | None:
    """Why the request stops after its newest token, or None. A stop token wins over the length
    limit; neither end-of-sequence nor a stop token counts before min_tokens."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    token_id = request.output_token_ids[-1]
    if num_output >= params.min_tokens and (
        token_id in params.stop_token_ids or (not params.ignore_eos and token_id in request.eos_token_ids)
    ):
        return "stop"
    if num_output >= request.max_output_tokens:
        return "length"
    return None


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
