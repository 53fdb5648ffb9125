"""Scheduler: token budget, chunking, admission order, preemption, stop conditions, aborts, and a
randomized fuzzer, all on CPU against a fake model over a paged token store."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys

import pytest

from slipstream.serve.request import ImageInput, Request, RequestStatus, SamplingParams
from slipstream.serve.scheduler import Scheduler, SchedulerConfig, StepPlan

EOS = 0


def make_config(**overrides) -> SchedulerConfig:
    values = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=64) | overrides
    return SchedulerConfig(**values)


def make_request(request_id: str, prompt, *, max_tokens=4, priority=0, arrival=0.0, **params) -> Request:
    return Request(
        request_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, ignore_eos=params.pop("ignore_eos", True), **params),
        eos_token_ids=(EOS,),
        arrival_time_s=arrival,
        priority=priority,
    )


class FakeRunner:
    """A stand-in model over a paged token store, shaped like the real KV cache: every computed
    token is written to its slot through the block table, and before sampling the whole context
    is read back the same way, so a wrong block table or a wrong prefix hit shows up as a context
    differing from the request's tokens. The sampled token is a function of the context (so
    recomputation after preemption must reproduce it), or random when `rng` is given.

    With KV cache groups (`kv_cache_windows`), each group writes through its own table, and a
    sliding group's context is read back from the window of the chunk's first token on (what its
    layers read); no token is written to the null block, one past the pool."""

    def __init__(self, config: SchedulerConfig, *, rng: random.Random | None = None, eos_prob=0.0):
        self.block_size = config.block_size
        self.windows = config.kv_cache_windows
        self.num_blocks = config.num_blocks
        self.slots: list[tuple[int, int] | None] = [None] * (config.num_blocks * config.block_size)
        self.rng = rng
        self.eos_prob = eos_prob

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Writes each token's KV as (LoRA adapter, token): a block computed under one adapter
        holds other keys and values than under another, so reading it under another is wrong KV."""
        for chunk in plan.chunks:
            token_ids = chunk.request.token_ids_range(chunk.start, chunk.start + chunk.num_tokens)
            for table in chunk.block_ids:
                for position, token_id in enumerate(token_ids, start=chunk.start):
                    self.slots[self._slot(table, position)] = (chunk.request.lora_id, token_id)
        sampled = {}
        for chunk in plan.chunks:
            end = chunk.start + chunk.num_tokens
            expected = [(chunk.request.lora_id, token_id) for token_id in chunk.request.all_token_ids]
            for table, window in zip(chunk.block_ids, self.windows, strict=True):
                first = 0 if window is None else max(0, chunk.start - window + 1)
                context = [self.slots[self._slot(table, p)] for p in range(first, end)]
                assert context == expected[first:end], f"{chunk.request.request_id} read wrong KV"
            if chunk.samples:
                sampled[chunk.request.request_id] = self._sample([token_id for _, token_id in expected[:end]])
        return sampled

    def _slot(self, block_ids: tuple[int, ...], position: int) -> int:
        block = block_ids[position // self.block_size]
        assert block < self.num_blocks, f"position {position} is in the null block {block}"
        return block * self.block_size + position % self.block_size

    def _sample(self, context: list[int]) -> int:
        if self.rng is None:
            return 1 + (sum(context) * 31 + len(context)) % 97
        return EOS if self.rng.random() < self.eos_prob else self.rng.randrange(1, 50)


def step(
    scheduler: Scheduler, runner: FakeRunner, *, steps_at_once: int = 1
) -> tuple[StepPlan, list[Request]]:
    """One engine step, with every check that must hold after any step. With `steps_at_once`, a
    plan of decodes only runs that many steps (fewer near a request's max_tokens) when the pool
    has their blocks, as the engine's multi-step decoding does."""
    plan = scheduler.schedule()
    scheduler.check_invariants()
    config = scheduler.config
    assert plan.num_batched_tokens == sum(chunk.num_tokens for chunk in plan.chunks)
    assert plan.num_batched_tokens <= config.max_num_batched_tokens
    assert len(plan.chunks) <= config.max_num_seqs and scheduler.num_running <= config.max_num_seqs
    for chunk in plan.chunks:
        assert chunk.num_tokens >= 1 and chunk.start == chunk.request.num_computed_tokens
        assert chunk.samples == (chunk.start + chunk.num_tokens == chunk.request.num_tokens)
        if config.long_prefill_token_threshold:
            assert chunk.num_tokens <= config.long_prefill_token_threshold
    finished = None
    if steps_at_once > 1 and plan.chunks and not plan.preempted_request_ids and all(
            chunk.num_tokens == 1 and chunk.samples for chunk in plan.chunks):
        finished = run_steps_at_once(scheduler, runner, plan, steps_at_once)
    if finished is None:
        finished = scheduler.update(plan, runner.execute(plan))
    scheduler.check_invariants()
    for request in finished:
        assert request.is_finished and scheduler.kv_cache.block_ids(request.request_id) == ()
    return plan, finished


def run_steps_at_once(
    scheduler: Scheduler, runner: FakeRunner, plan: StepPlan, steps_at_once: int
) -> list[Request] | None:
    """Blocks for the next steps of every request of a decode plan, then one update per step with
    the plan's chunks moved on by one token (dropping requests that finished); None, with only
    blocks taken, if the pool is short."""
    num_steps = min(steps_at_once, *(c.request.max_output_tokens - len(c.request.output_token_ids)
                                     for c in plan.chunks))
    tables = scheduler.reserve_lookahead(plan, num_steps)
    scheduler.check_invariants()
    if tables is None:
        return None
    for chunk, table in zip(plan.chunks, tables, strict=True):
        assert all(len(group) * scheduler.config.block_size >= chunk.start + num_steps for group in table)
    finished = []
    for offset in range(num_steps):
        chunks = tuple(dataclasses.replace(chunk, start=chunk.start + offset, block_ids=table)
                       for chunk, table in zip(plan.chunks, tables, strict=True)
                       if not chunk.request.is_finished)
        sub_plan = StepPlan(chunks, len(chunks), ())
        finished += scheduler.update(sub_plan, runner.execute(sub_plan))
        scheduler.check_invariants()
    return finished


def run_to_completion(
    scheduler: Scheduler, runner: FakeRunner, max_steps=10_000, steps_at_once: int = 1
) -> list[StepPlan]:
    plans = []
    while scheduler.has_unfinished():
        assert len(plans) < max_steps, "requests never finished: livelock or starvation"
        plans.append(step(scheduler, runner, steps_at_once=steps_at_once)[0])
    assert scheduler.kv_cache.num_used_blocks == 0
    return plans


def scheduled_ids(plan: StepPlan) -> list[str]:
    return [chunk.request.request_id for chunk in plan.chunks]


def chunk_sizes(plan: StepPlan) -> list[tuple[str, int]]:
    return [(chunk.request.request_id, chunk.num_tokens) for chunk in plan.chunks]


def test_import_does_not_load_torch():
    """scheduler.py stays plain Python: importing it must not import torch."""
    code = "import sys, slipstream.serve.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", -1),
        ("block_size", 0),
        ("num_blocks", 1.5),
        ("long_prefill_token_threshold", -1),
        ("policy", "lifo"),
        ("enable_prefix_caching", "yes"),
        ("max_num_seqs", True),
    ],
)
def test_bad_config_values_are_value_errors_naming_the_field(field, value):
    """Each invalid SchedulerConfig value is a ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        make_config(**{field: value})


def test_config_is_frozen_and_keyword_only():
    """The config cannot be changed after construction nor built positionally."""
    config = make_config()
    with pytest.raises(AttributeError):
        config.num_blocks = 3
    with pytest.raises(TypeError):
        SchedulerConfig(8, 64, 4, 64)


def test_add_rejects_a_request_that_can_never_fit_in_the_pool():
    """A request needing more KV than the whole pool is refused at add (naming the sizes) rather
    than livelocking; one that exactly fits is accepted and completes."""
    config = make_config(num_blocks=4, block_size=4)  # 16 tokens of KV
    scheduler = Scheduler(config)
    with pytest.raises(ValueError, match=r"17 tokens .* 4 blocks x 4 tokens = 16"):
        scheduler.add(make_request("big", range(1, 11), max_tokens=8))
    scheduler.add(make_request("fits", range(1, 11), max_tokens=7))  # the last token needs no KV
    run_to_completion(scheduler, FakeRunner(config))


def test_add_rejects_duplicates_and_non_new_requests():
    """Duplicate ids, empty prompts and requests already started are ValueErrors."""
    scheduler = Scheduler(make_config())
    scheduler.add(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="already queued"):
        scheduler.add(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.add(make_request("b", []))
    started = make_request("c", [1, 2])
    started.num_computed_tokens = 1
    with pytest.raises(ValueError, match="not new"):
        scheduler.add(started)


def test_long_prompt_is_chunked_and_decodes_ride_along():
    """A 100-token prompt under a 16-token budget takes 7 steps, while a decoding request gets
    its token in every one of those steps."""
    config = make_config(max_num_batched_tokens=16)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    scheduler.add(make_request("decoder", [1, 2, 3], max_tokens=20, arrival=0.0))
    step(scheduler, runner)
    scheduler.add(make_request("long", range(1, 101), max_tokens=1, arrival=1.0))
    steps = 0
    while scheduler.has_unfinished() and steps < 20:
        plan, finished = step(scheduler, runner)
        steps += 1
        chunks = {chunk.request.request_id: chunk for chunk in plan.chunks}
        assert chunks["decoder"].num_tokens == 1 and chunks["decoder"].samples
        assert chunks["long"].samples == bool(finished and finished[-1].request_id == "long")
        if finished:
            break
    assert steps == 7 and finished[0].finish_reason == "length"


def test_long_prefill_threshold_caps_each_chunk():
    """long_prefill_token_threshold caps one request's tokens per step below the budget."""
    config = make_config(max_num_batched_tokens=64, long_prefill_token_threshold=10)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    scheduler.add(make_request("a", range(1, 36), max_tokens=1))
    scheduler.add(make_request("b", range(1, 6), max_tokens=1))
    plan, _ = step(scheduler, runner)
    assert [chunk.num_tokens for chunk in plan.chunks] == [10, 5]
    assert len(run_to_completion(scheduler, runner)) == 3


def test_budget_and_max_num_seqs_are_never_exceeded():
    """Many requests: no step batches more tokens than the budget or runs more than max_num_seqs,
    and admissions beyond the limit wait."""
    config = make_config(max_num_seqs=3, max_num_batched_tokens=10)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    for i in range(10):
        scheduler.add(make_request(f"r{i}", range(1, 8 + i), max_tokens=3))
    plan, _ = step(scheduler, runner)
    assert scheduler.num_running <= 3 and scheduler.num_waiting >= 7
    plans = run_to_completion(scheduler, runner)
    assert max(plan.num_batched_tokens for plan in plans) == 10
    assert max(len(plan.chunks) for plan in plans) == 3


def test_prefix_hit_skips_shared_blocks_and_counts_hits():
    """A second prompt sharing 3 full blocks with a computed one starts at 3 * block_size tokens,
    reports them as cached prompt tokens, and the hit counters count them."""
    config = make_config(block_size=4)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    shared = list(range(1, 13))
    scheduler.add(make_request("a", shared + [20, 21], max_tokens=2))
    run_to_completion(scheduler, runner)
    scheduler.add(make_request("b", shared + [30], max_tokens=2))
    plan, _ = step(scheduler, runner)
    (chunk,) = plan.chunks
    assert chunk.start == 12 and chunk.num_tokens == 1
    assert chunk.request.num_cached_prompt_tokens == 12
    assert scheduler.kv_cache.prefix_cache_hits == 12
    assert scheduler.kv_cache.prefix_cache_queries == 14 + 13
    run_to_completion(scheduler, runner)


@pytest.mark.parametrize("prompt_len", [8, 9])
def test_whole_prompt_hit_still_computes_the_last_token(prompt_len):
    """A prompt that is entirely cached still computes at least its last token, so there are
    logits to sample from; it then finishes with the same output as the first time."""
    config = make_config(block_size=4)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    first = make_request("a", range(1, 1 + prompt_len), max_tokens=3)
    scheduler.add(first)
    run_to_completion(scheduler, runner)
    again = make_request("b", range(1, 1 + prompt_len), max_tokens=3)
    scheduler.add(again)
    plan, _ = step(scheduler, runner)
    (chunk,) = plan.chunks
    assert 1 <= chunk.num_tokens <= 4 and chunk.samples
    assert chunk.start == (prompt_len - 1) // 4 * 4
    run_to_completion(scheduler, runner)
    assert again.output_token_ids == first.output_token_ids


def test_identical_prompts_in_one_step_miss_then_later_ones_hit():
    """Two identical prompts admitted in the same step both compute everything (the second cannot
    hit blocks not yet computed); a third one admitted later hits."""
    config = make_config(block_size=4)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    for request_id in ("a", "b"):
        scheduler.add(make_request(request_id, range(1, 11), max_tokens=2))
    plan, _ = step(scheduler, runner)
    assert [chunk.start for chunk in plan.chunks] == [0, 0]
    scheduler.add(make_request("c", range(1, 11), max_tokens=2))
    plan, _ = step(scheduler, runner)
    assert {chunk.request.request_id: chunk.start for chunk in plan.chunks}["c"] == 8
    run_to_completion(scheduler, runner)


def test_n_siblings_share_their_prompt_blocks():
    """n=3 completions of one prompt: the first fills the step's budget, the other two are admitted
    next step and hit its prompt blocks (all but the last block, whose last token must be
    computed); each generates its own output and all blocks return at the end."""
    config = make_config(block_size=4, max_num_batched_tokens=12)
    scheduler, runner = Scheduler(config), FakeRunner(config, rng=random.Random(0))
    prompt = list(range(1, 13))
    siblings = [make_request(f"p-{i}", prompt, max_tokens=5, arrival=float(i)) for i in range(3)]
    for request in siblings:
        scheduler.add(request)
    step(scheduler, runner)
    step(scheduler, runner)
    assert [request.num_cached_prompt_tokens for request in siblings] == [0, 8, 8]
    tables = [scheduler.kv_cache.block_ids(request.request_id) for request in siblings]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    run_to_completion(scheduler, runner)
    assert all(len(request.output_token_ids) == 5 for request in siblings)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_order_follows_the_policy(policy):
    """With one seat: FCFS admits in arrival order, the priority policy lowest priority value
    first (ties by arrival)."""
    config = make_config(max_num_seqs=1, policy=policy)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    for request_id, priority, arrival in (("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0)):
        scheduler.add(make_request(request_id, [1, 2, 3], max_tokens=1, priority=priority, arrival=arrival))
    order = [scheduled_ids(plan)[0] for plan in run_to_completion(scheduler, runner)]
    assert order == (["a", "b", "c", "d"] if policy == "fcfs" else ["b", "d", "c", "a"])


def preemption_setup(policy: str, priorities: dict[str, int]):
    """Three 2-token prompts in a 4-block pool of 2-token blocks: in the second step every request
    needs a second block and only one is free, so the scheduler must preempt."""
    config = make_config(block_size=2, num_blocks=4, policy=policy)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    requests = {}
    for arrival, (request_id, priority) in enumerate(priorities.items()):
        requests[request_id] = make_request(
            request_id, [5, 6], max_tokens=6, priority=priority, arrival=arrival
        )
        scheduler.add(requests[request_id])
    step(scheduler, runner)
    return scheduler, runner, requests


def reference_outputs(request_ids, prompt, max_tokens) -> dict[str, list[int]]:
    """Outputs of the same requests in a pool too roomy for any preemption."""
    config = make_config(num_blocks=256)
    scheduler = Scheduler(config)
    requests = [make_request(request_id, prompt, max_tokens=max_tokens) for request_id in request_ids]
    for request in requests:
        scheduler.add(request)
    run_to_completion(scheduler, FakeRunner(config))
    assert scheduler.num_preemptions == 0
    return {request.request_id: request.output_token_ids for request in requests}


@pytest.mark.parametrize(
    ("policy", "priorities", "victim"),
    [
        ("priority", {"a": 0, "b": 1, "c": 1}, "c"),  # lowest priority, then latest arrival
        ("priority", {"a": 1, "b": 2, "c": 0}, "b"),  # lowest priority beats later arrival
        ("fcfs", {"a": 1, "b": 2, "c": 0}, "c"),  # priority means nothing under FCFS
    ],
)
def test_preemption_picks_lowest_priority_then_latest_arrival(policy, priorities, victim):
    """When blocks run out, the victim is the running request that comes last in the policy's
    order; it waits again, later completes, and produces exactly the output an unpreempted run
    produces (recompute keeps its generated tokens)."""
    scheduler, runner, requests = preemption_setup(policy, priorities)
    plan, _ = step(scheduler, runner)
    assert plan.preempted_request_ids == (victim,) and victim not in scheduled_ids(plan)
    assert scheduler.num_preemptions == 1 and scheduler.num_waiting == 1
    assert requests[victim].status is RequestStatus.WAITING and requests[victim].num_preemptions == 1
    run_to_completion(scheduler, runner)
    expected = reference_outputs(requests, [5, 6], max_tokens=6)
    assert {request_id: r.output_token_ids for request_id, r in requests.items()} == expected
    assert all(request.finish_reason == "length" for request in requests.values())


def test_preemption_of_a_request_in_mid_prefill():
    """A long prompt being chunked is preempted when an earlier request's decode needs its blocks;
    both still complete, with the same outputs as in a roomy pool."""
    config = make_config(block_size=4, num_blocks=8, max_num_batched_tokens=8)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    early = make_request("early", range(1, 9), max_tokens=16, arrival=0.0)
    late = make_request("late", range(20, 44), max_tokens=4, arrival=1.0)
    scheduler.add(early)
    scheduler.add(late)
    progress_when_preempted = []
    while scheduler.has_unfinished():
        progress = late.num_computed_tokens
        plan, _ = step(scheduler, runner)
        if "late" in plan.preempted_request_ids:
            progress_when_preempted.append(progress)
    assert any(0 < progress < late.num_prompt_tokens for progress in progress_when_preempted)
    assert scheduler.kv_cache.num_used_blocks == 0
    assert {"early": early.output_token_ids} == reference_outputs(["early"], range(1, 9), 16)
    assert {"late": late.output_token_ids} == reference_outputs(["late"], range(20, 44), 4)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_arrival_preempts_a_lower_priority_runner(policy):
    """Under the priority policy a waiting request with strictly better priority preempts a
    running lower-priority one when blocks are short, and the victim's already planned decode
    gives its budget back; under FCFS the newcomer waits instead."""
    config = make_config(block_size=4, num_blocks=4, max_num_batched_tokens=8, policy=policy)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    scheduler.add(make_request("low", range(1, 12), max_tokens=5, priority=5))
    plan, _ = step(scheduler, runner)
    plan, _ = step(scheduler, runner)  # the 11-token prompt takes two steps
    scheduler.add(make_request("high", range(30, 38), max_tokens=2, priority=0, arrival=1.0))
    plan, _ = step(scheduler, runner)
    if policy == "priority":
        assert plan.preempted_request_ids == ("low",) and scheduled_ids(plan) == ["high"]
        assert plan.num_batched_tokens == 8 and plan.chunks[0].samples
    else:
        assert plan.preempted_request_ids == () and scheduled_ids(plan) == ["low"]
    run_to_completion(scheduler, runner)


def test_priority_arrival_preempts_no_one_when_the_victims_cannot_make_room():
    """A waiting request that even every lower-priority runner's blocks could not hold preempts
    none of them. The blocks counted are those a victim would free: here "low" shares its first
    two blocks with "top" through the prefix cache, so preempting it frees 1 block, not 3."""
    config = make_config(block_size=4, num_blocks=8, max_num_batched_tokens=64, policy="priority")
    scheduler, runner = Scheduler(config), FakeRunner(config)
    shared = list(range(1, 9))
    scheduler.add(make_request("top", shared + list(range(20, 29)), max_tokens=8, priority=0))
    step(scheduler, runner)  # top's 17 tokens: 5 blocks, its 4 full ones cached
    scheduler.add(make_request("low", [*shared, 40], max_tokens=8, priority=5, arrival=1.0))
    plan, _ = step(scheduler, runner)
    assert scheduled_ids(plan) == ["top", "low"] and scheduler.kv_cache.num_free_blocks == 2
    scheduler.add(make_request("high", range(60, 80), max_tokens=2, priority=1, arrival=2.0))  # 5 blocks
    plan, _ = step(scheduler, runner)
    assert plan.preempted_request_ids == () and scheduled_ids(plan) == ["top", "low"]
    assert scheduler.num_preemptions == 0
    run_to_completion(scheduler, runner)


def test_priority_arrival_preempts_only_the_victims_its_chunk_needs():
    """The victims make room for the chunk the budget left the newcomer; the budget a planned
    victim gives back lets the chunk grow only into blocks already free, never by preempting
    another request. Here preempting "mid" (mid-prefill, its first block shared with "old")
    frees 2 blocks, enough for the newcomer's 6-token chunk; "old" keeps running."""
    config = make_config(block_size=4, num_blocks=7, max_num_batched_tokens=12, policy="priority")
    scheduler, runner = Scheduler(config), FakeRunner(config)
    shared = [1, 2, 3, 4]
    scheduler.add(make_request("old", [*shared, 9], max_tokens=8, priority=5))
    step(scheduler, runner)  # old's 5 tokens: 2 blocks, the first cached
    scheduler.add(make_request("top", range(20, 30), max_tokens=3, priority=0, arrival=1.0))
    scheduler.add(make_request("mid", [*shared, 40, 41, 42, 43, 44], max_tokens=8, priority=5, arrival=2.0))
    plan, _ = step(scheduler, runner)  # old 1, top 10, mid 1 after its 4-token hit
    assert chunk_sizes(plan) == [("old", 1), ("top", 10), ("mid", 1)]
    scheduler.add(make_request("high", range(60, 80), max_tokens=2, priority=1, arrival=3.0))
    plan, _ = step(scheduler, runner)
    assert plan.preempted_request_ids == ("mid",)
    # 12 - 1 - 1 - 4 (mid's planned chunk) left 6 tokens; mid's 4 back would make 10 (3 blocks),
    # but the 2 free blocks hold 8.
    assert chunk_sizes(plan) == [("top", 1), ("old", 1), ("high", 8)]
    run_to_completion(scheduler, runner)


def test_cache_salt_keeps_prefix_blocks_to_requests_with_the_same_salt():
    """As vLLM's cache_salt: the same prompt under another salt (or none) hits nothing, under the
    same salt it hits as usual, and requests without one share as before."""
    config = make_config(block_size=4)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    prompt = list(range(1, 14))  # 3 full blocks can hit
    cached = {}
    for request_id, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", None), ("d", "tenant-1"),
                             ("e", "tenant-2"), ("f", None), ("g", "")):
        request = make_request(request_id, prompt)
        scheduler.add(request, cache_salt=salt)
        run_to_completion(scheduler, runner)
        cached[request_id] = request.num_cached_prompt_tokens
    assert cached == {"a": 0, "b": 0, "c": 0, "d": 12, "e": 12, "f": 12, "g": 12}  # "" is no salt


def test_cache_salt_must_be_a_string():
    scheduler = Scheduler(make_config())
    with pytest.raises(ValueError, match="cache_salt must be a string or None, got 7"):
        scheduler.add(make_request("a", [1, 2, 3]), cache_salt=7)
    assert not scheduler.has_unfinished()


def test_reserve_lookahead_covers_the_steps_ahead_or_takes_nothing():
    """Blocks for several decode steps at once: the table covers them, a pool too small for them
    changes nothing, and a prompt chunk (several tokens) is refused."""
    config = make_config(num_blocks=6, block_size=4)
    scheduler = Scheduler(config)
    scheduler.add(make_request("a", range(1, 8), max_tokens=10))  # 7 prompt tokens
    prefill = scheduler.schedule()
    with pytest.raises(ValueError, match="single-token"):
        scheduler.reserve_lookahead(prefill, 4)
    scheduler.update(prefill, {"a": 9})
    decode = scheduler.schedule()  # position 7, the table's 2 blocks hold 8 tokens
    free = scheduler.kv_cache.num_free_blocks
    assert scheduler.reserve_lookahead(decode, 1) == [decode.chunks[0].block_ids]  # the plan's own
    assert scheduler.kv_cache.num_free_blocks == free
    assert scheduler.reserve_lookahead(decode, 18) is None  # 25 tokens: 7 blocks of 6
    assert scheduler.kv_cache.block_tables("a") == decode.chunks[0].block_ids
    ((table,),) = scheduler.reserve_lookahead(decode, 6)  # positions 7-12: 4 blocks
    assert len(table) == 4 and table[:2] == decode.chunks[0].block_ids[0]
    scheduler.check_invariants()


def test_stop_conditions():
    """EOS stops ("stop") unless ignore_eos, never before min_tokens; stop_token_ids stop; the
    length limit is max_tokens capped by max_total_tokens ("length")."""
    config = make_config()
    scheduler = Scheduler(config)
    cases = {
        "eos": (make_request("eos", [1, 2], max_tokens=10, ignore_eos=False), "stop", 1),
        "ignored": (make_request("ignored", [1, 2], max_tokens=10, ignore_eos=True), "length", 10),
        "min": (make_request("min", [1, 2], max_tokens=10, ignore_eos=False, min_tokens=3), "stop", 3),
        "stop_id": (make_request("stop_id", [1, 2], max_tokens=10, stop_token_ids=[7]), "stop", 1),
    }
    context = Request("ctx", [1, 2, 3], SamplingParams(max_tokens=None), max_total_tokens=6)
    for request, _, _ in cases.values():
        scheduler.add(request)
    scheduler.add(context)
    tokens = {"eos": EOS, "ignored": EOS, "min": EOS, "stop_id": 7, "ctx": 3}
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        scheduler.update(plan, {c.request.request_id: tokens[c.request.request_id] for c in plan.chunks})
        scheduler.check_invariants()
    for request, reason, num_output in cases.values():
        outcome = (request.finish_reason, len(request.output_token_ids))
        assert outcome == (reason, num_output), request.request_id
    assert context.finish_reason == "length" and len(context.output_token_ids) == 3


def test_abort_waiting_running_and_mid_prefill_requests():
    """Abort frees everything at once, whether the request waits, decodes or is mid-prefill;
    unknown ids are ignored; a request aborted between schedule and update is skipped."""
    config = make_config(max_num_seqs=2, max_num_batched_tokens=8)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    requests = [make_request(name, range(1, 21), max_tokens=50) for name in ("a", "b", "c")]
    for request in requests:
        scheduler.add(request)
    step(scheduler, runner)  # a: mid-prefill, b and c waiting (max_num_seqs counts a, budget spent)
    assert requests[0].num_computed_tokens == 8 and scheduler.num_waiting == 2
    aborted = scheduler.abort(["c", "no-such-id"])
    assert aborted == [requests[2]] and scheduler.num_waiting == 1
    assert scheduler.abort("a") == [requests[0]]
    for request in requests[::2]:
        assert request.finish_reason == "abort" and scheduler.kv_cache.block_ids(request.request_id) == ()
    scheduler.check_invariants()
    plan = scheduler.schedule()
    assert scheduled_ids(plan) == ["b"]
    scheduler.abort(["b"])
    assert scheduler.update(plan, runner.execute(plan)) == []
    scheduler.check_invariants()
    assert not scheduler.has_unfinished() and scheduler.kv_cache.num_used_blocks == 0
    assert scheduler.abort(["b"]) == []


def test_finish_frees_blocks_and_keeps_them_cached():
    """finish() (a stop string found by the engine) frees at once; full blocks stay hittable."""
    config = make_config(block_size=4)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    request = make_request("a", range(1, 10), max_tokens=50)
    scheduler.add(request)
    step(scheduler, runner)
    assert scheduler.finish("a", "stop") is request
    assert scheduler.finish("a", "stop") is None
    scheduler.check_invariants()
    assert request.finish_reason == "stop" and scheduler.kv_cache.num_used_blocks == 0
    assert scheduler.kv_cache.num_cached_blocks == 2
    with pytest.raises(ValueError, match="reason"):
        scheduler.finish("a", "done")


def test_follow_up_turn_hits_generated_blocks():
    """Blocks filled with generated tokens are cached, so a follow-up turn whose prompt is the
    previous prompt plus its output hits them."""
    config = make_config(block_size=4)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    first = make_request("turn1", range(1, 7), max_tokens=8)
    scheduler.add(first)
    run_to_completion(scheduler, runner)
    follow_up = make_request("turn2", first.all_token_ids + [3, 4, 5], max_tokens=2)
    scheduler.add(follow_up)
    step(scheduler, runner)
    assert follow_up.num_cached_prompt_tokens == 12  # 13 tokens known, 14 computed: 3 full blocks
    run_to_completion(scheduler, runner)


@pytest.mark.parametrize("where", ["finish", "update"])
def test_an_exception_while_freeing_leaves_requests_an_abort_can_release(where, monkeypatch):
    """An exception out of the KV cache's free (an interrupt landing there) leaves the request it
    was releasing as it was, running and holding its blocks, and every request released before it
    out of the running list: an abort then frees everything and later steps run (the request used
    to be finished yet still running, breaking every later step)."""
    config = make_config()
    scheduler, runner = Scheduler(config), FakeRunner(config)
    for name in ("a", "b", "c"):
        scheduler.add(make_request(name, range(1, 6), max_tokens=1))
    plan = scheduler.schedule()
    sampled = runner.execute(plan)
    free, calls = scheduler.kv_cache.free, []

    def interrupted(request):
        calls.append(request.request_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        free(request)

    monkeypatch.setattr(scheduler.kv_cache, "free", interrupted)
    with pytest.raises(KeyboardInterrupt):
        if where == "finish":
            scheduler.finish("a", "abort")
            scheduler.finish("b", "abort")
        else:
            scheduler.update(plan, sampled)
    monkeypatch.undo()
    scheduler.check_invariants()
    assert [r.request_id for r in scheduler._running] == ["b", "c"]
    scheduler.abort(["a", "b", "c"])
    scheduler.check_invariants()
    assert scheduler.kv_cache.num_free_blocks == config.num_blocks
    scheduler.add(make_request("d", range(1, 6), max_tokens=2))
    run_to_completion(scheduler, runner)


def fuzz_config(rng: random.Random) -> SchedulerConfig:
    block_size = rng.choice([1, 2, 4, 8])
    return SchedulerConfig(
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(1, 48),
        block_size=block_size,
        num_blocks=rng.randint(24, 96) // block_size + 2,
        enable_prefix_caching=rng.random() < 0.8,
        policy=rng.choice(["fcfs", "priority"]),
        long_prefill_token_threshold=rng.choice([0, 0, rng.randint(1, 16)]),
        max_loras=rng.randint(1, 3),
    )


def fuzz_request(rng: random.Random, index: int, prefixes: list[list[int]]) -> Request:
    tail = [rng.randrange(1, 50) for _ in range(rng.randint(1, 12))]
    prompt = rng.choice(prefixes)[: rng.randint(0, 24)] + tail
    request = make_request(
        f"r{index}",
        prompt,
        max_tokens=rng.randint(1, 16),
        priority=rng.randint(0, 3),
        arrival=float(index),
        ignore_eos=rng.random() < 0.5,
        min_tokens=rng.choice([0, 0, 1]),
    )
    request.lora_id = rng.choice([0, 0, 1, 2, 3])
    return request


@pytest.mark.parametrize("steps_at_once", [1, 4])
@pytest.mark.parametrize("seed", range(12))
def test_fuzz_random_adds_aborts_and_finishes(seed, steps_at_once):
    """Random workloads on small pools (forcing preemption), some under cache salts and LoRA
    adapters (never more running than max_loras, never reading another adapter's KV): invariants
    hold after every step, every request finishes (no livelock or starvation) with a consistent
    finish reason, finished requests hold no blocks, and at the end every block is free; also
    when decode plans run several steps at once on blocks taken ahead."""
    rng = random.Random(seed)
    config = fuzz_config(rng)
    scheduler, runner = Scheduler(config), FakeRunner(config, rng=rng, eos_prob=0.1)
    capacity = config.num_blocks * config.block_size
    prefixes = [[rng.randrange(1, 50) for _ in range(24)] for _ in range(3)]
    requests: list[Request] = []
    for step_index in range(250):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            request = fuzz_request(rng, len(requests), prefixes)
            if request.num_prompt_tokens + request.max_output_tokens - 1 > capacity:
                with pytest.raises(ValueError, match="KV cache holds"):
                    scheduler.add(request)
                continue
            cache_salt = rng.choice([None, None, "x", "y"])
            for _ in range(rng.choice([1, 1, 1, 3])):  # sometimes n > 1 siblings
                sibling = dataclasses.replace(  # fresh output list: siblings share only the prompt
                    request, request_id=f"r{len(requests)}", output_token_ids=[], arrival_time_s=step_index
                )
                scheduler.add(sibling, cache_salt=cache_salt)
                requests.append(sibling)
        if requests and rng.random() < 0.05:
            for request in scheduler.abort([rng.choice(requests).request_id]):
                assert scheduler.kv_cache.block_ids(request.request_id) == ()
        if requests and rng.random() < 0.03:
            scheduler.finish(rng.choice(requests).request_id, "stop")
        step(scheduler, runner, steps_at_once=steps_at_once)
    run_to_completion(scheduler, runner, max_steps=5_000, steps_at_once=steps_at_once)
    for request in requests:
        assert request.is_finished and scheduler.kv_cache.block_ids(request.request_id) == ()
        if request.finish_reason == "length":
            assert len(request.output_token_ids) == request.max_output_tokens
    assert scheduler.kv_cache.num_used_blocks == 0 and scheduler.num_waiting == scheduler.num_running == 0


def test_pooled_requests_end_without_a_token_and_leave_their_blocks_cached():
    """An embedding engine's requests end in the step that computes their last prompt token, with
    reason "stop" and no token; their full blocks stay in the prefix cache for the next prompt
    that starts the same way."""
    scheduler = Scheduler(make_config(max_num_batched_tokens=6))
    runner = FakeRunner(scheduler.config)
    request = make_request("a", range(1, 11), max_tokens=1)
    scheduler.add(request)
    plan = scheduler.schedule()  # 6 of the 10 prompt tokens
    assert scheduler.update(plan, runner.execute(plan), pooled_ids={"a"}) == []
    assert not request.is_finished
    plan = scheduler.schedule()
    assert [chunk.samples for chunk in plan.chunks] == [True]
    assert scheduler.update(plan, {}, pooled_ids={"a"}) == [request]
    assert (request.finish_reason, request.output_token_ids) == ("stop", [])
    scheduler.check_invariants()
    assert scheduler.kv_cache.num_used_blocks == 0
    again = make_request("b", range(1, 11), max_tokens=1)
    assert len(scheduler.kv_cache.lookup(again)) == 2  # two full blocks of 4 of the 10 tokens



def check_windows_released(scheduler: Scheduler, requests: list[Request]) -> None:
    """Every request's sliding groups hold the null block for exactly the blocks wholly before
    the window of its first uncomputed token (vLLM's rule), and nowhere else; full groups never."""
    kv, size = scheduler.kv_cache, scheduler.config.block_size
    for request in requests:
        for group, window in enumerate(scheduler.config.kv_cache_windows):
            table = kv.block_ids(request.request_id, group)
            skipped = 0 if window is None else max(0, request.num_computed_tokens - window + 1) // size
            num_null = min(len(table), skipped)
            assert table[:num_null] == (kv.null_block,) * num_null, (request.request_id, group, table)
            assert kv.null_block is None or kv.null_block not in table[num_null:], (request.request_id, table)


WINDOWS = [(5,), (None, 6), (3, None, 9), (None, None, 4, 4), (1, None)]


@pytest.mark.parametrize("steps_at_once", [1, 3])
@pytest.mark.parametrize("seed", range(10))
def test_fuzz_kv_cache_groups_with_windows(seed, steps_at_once):
    """The fuzzer with KV cache groups, some with sliding windows: every group's table reads back
    the right tokens over what its window reads (FakeRunner), sliding groups release exactly the
    blocks before the window, invariants hold after every step (null block never owned or free,
    free + used == total), every request finishes, and a request is refused only if its whole
    history in every group would overflow the pool."""
    rng = random.Random(1000 + seed)
    windows = WINDOWS[seed % len(WINDOWS)]
    config = dataclasses.replace(fuzz_config(rng), kv_cache_windows=windows)
    scheduler, runner = Scheduler(config), FakeRunner(config, rng=rng, eos_prob=0.1)
    prefixes = [[rng.randrange(1, 50) for _ in range(24)] for _ in range(3)]
    requests: list[Request] = []
    for step_index in range(200):
        for _ in range(rng.choice([0, 0, 1, 2])):
            request = fuzz_request(rng, len(requests), prefixes)
            request.arrival_time_s = step_index
            try:
                scheduler.add(request, cache_salt=rng.choice([None, None, "x"]))
            except ValueError:
                num_kv_tokens = request.num_prompt_tokens + request.max_output_tokens - 1
                assert len(windows) * -(-num_kv_tokens // config.block_size) > config.num_blocks
                continue
            requests.append(request)
        if requests and rng.random() < 0.05:
            scheduler.abort([rng.choice(requests).request_id])
        step(scheduler, runner, steps_at_once=steps_at_once)
        check_windows_released(scheduler, requests)
    run_to_completion(scheduler, runner, max_steps=5_000, steps_at_once=steps_at_once)
    assert all(request.is_finished for request in requests)


@pytest.mark.parametrize("windows", [(8,), (None, 8, 8)])
def test_windows_let_more_sequences_run_than_the_pool_holds_whole(windows):
    """A pool too small for 4 sequences' whole history in every group still runs the 4 at once
    when sliding groups release what their windows passed; with every group windowless (the
    hybrid manager disabled) the same pool preempts and never runs them all together."""
    peaks = {}
    for kind in ("windows", "windowless"):
        groups = windows if kind == "windows" else (None,) * len(windows)
        # Each sequence: 8 + 40 tokens = 12 blocks of 4 per group; whole, 4 of them need 48 per group.
        config = make_config(max_num_seqs=4, block_size=4, num_blocks=26 * len(windows),
                             kv_cache_windows=groups)
        scheduler, runner = Scheduler(config), FakeRunner(config)
        for i in range(4):
            scheduler.add(make_request(f"r{i}", range(10 * i + 1, 10 * i + 9), max_tokens=41))
        peak = 0
        while scheduler.has_unfinished():
            plan, _ = step(scheduler, runner)
            peak = max(peak, len(plan.chunks))
        peaks[kind] = (peak, scheduler.num_preemptions)
    assert peaks["windows"] == (4, 0)
    assert peaks["windowless"][1] > 0


def with_images(request: Request, images: list[tuple[int, int, str]]) -> Request:
    """`request` with images at (offset, length, content hash) of its prompt."""
    request.images = tuple(ImageInput(offset=offset, length=length, content_hash=content_hash,
                                      pixel_values=None) for offset, length, content_hash in images)
    return request


def check_whole_images(plan: StepPlan) -> None:
    """A chunk that computes any token of an image computes the rest of it too."""
    for chunk in plan.chunks:
        stop = chunk.start + chunk.num_tokens
        for image in chunk.request.images:
            assert not (chunk.start < image.end and image.offset < stop < image.end), (
                chunk.request.request_id, chunk.start, stop, image)


def test_images_are_computed_whole_under_disable_chunked_mm_input():
    """With disable_chunked_mm_input a chunk that would end inside an image ends before it, and the
    image comes whole in a later chunk (vLLM's rule); without it the budget cuts where it falls.
    A request with an image longer than a chunk may be is refused when added, naming the option."""
    plans = {}
    for whole in (False, True):
        config = make_config(max_num_batched_tokens=8, disable_chunked_mm_input=whole)
        scheduler, runner = Scheduler(config), FakeRunner(config)
        scheduler.add(with_images(make_request("a", range(1, 16), max_tokens=1), [(3, 6, "x"), (10, 2, "y")]))
        plans[whole] = [chunk_sizes(plan)[0] for plan in run_to_completion(scheduler, runner)]
    assert plans[False] == [("a", 8), ("a", 7)]
    assert plans[True] == [("a", 3), ("a", 7), ("a", 5)]  # 3 + 8 would end inside (10, 12)
    scheduler = Scheduler(make_config(max_num_batched_tokens=8, long_prefill_token_threshold=5,
                                      disable_chunked_mm_input=True))
    with pytest.raises(ValueError, match="image of 6 tokens.*disable_chunked_mm_input"):
        scheduler.add(with_images(make_request("b", range(1, 16)), [(3, 6, "x")]))


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_whole_images(seed):
    """The fuzzer's workloads with images under disable_chunked_mm_input, some sharing images and
    prefixes (so that cached prefixes end inside an image, and the rest of it waits for budget):
    no chunk ends inside an image it computes part of, invariants hold after every step, and
    every request finishes with all its blocks freed."""
    rng = random.Random(2000 + seed)
    config = dataclasses.replace(fuzz_config(rng), disable_chunked_mm_input=True)
    longest = min(config.max_num_batched_tokens, config.long_prefill_token_threshold or 48)
    scheduler, runner = Scheduler(config), FakeRunner(config, rng=rng, eos_prob=0.1)
    capacity = config.num_blocks * config.block_size
    prefixes = [[rng.randrange(1, 50) for _ in range(24)] for _ in range(3)]
    requests: list[Request] = []
    for _ in range(150):
        for _ in range(rng.choice([0, 0, 1, 2])):
            request = fuzz_request(rng, len(requests), prefixes)
            request.lora_id = 0
            if requests and rng.random() < 0.3:  # an earlier prompt again: its cached blocks hit
                earlier = rng.choice(requests)
                request.prompt_token_ids, request.images = earlier.prompt_token_ids, earlier.images
            images, position = [], rng.randint(0, 3)
            while not request.images and position < request.num_prompt_tokens and rng.random() < 0.7:
                length = rng.randint(1, min(6, request.num_prompt_tokens - position))
                images.append((position, length, f"image{length}-{rng.randrange(2)}"))
                position += length + rng.randint(0, 4)
            if images:
                with_images(request, images)
            if request.num_prompt_tokens + request.max_output_tokens - 1 > capacity:
                continue
            if any(length > longest for _, length, _ in images):
                with pytest.raises(ValueError, match="disable_chunked_mm_input"):
                    scheduler.add(request)
                continue
            scheduler.add(request)
            requests.append(request)
        plan, _ = step(scheduler, runner)
        check_whole_images(plan)
    while scheduler.has_unfinished():
        plan, _ = step(scheduler, runner)
        check_whole_images(plan)
    for request in requests:
        assert request.is_finished and scheduler.kv_cache.block_ids(request.request_id) == ()
    assert scheduler.kv_cache.num_used_blocks == 0


def test_a_prefix_hit_inside_an_image_waits_for_budget_for_the_rest_of_it():
    """Under disable_chunked_mm_input a request whose cached prefix ends inside an image is admitted
    only with budget for the rest of the image: with 1 token left in a step it waits (no chunk
    inside the image), and the next step, with 7 left, starts it from the hit."""
    config = make_config(max_num_batched_tokens=8, disable_chunked_mm_input=True)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    first = with_images(make_request("a", range(1, 13), max_tokens=1), [(2, 8, "x")])
    scheduler.add(first)
    run_to_completion(scheduler, runner)
    scheduler.add(make_request("b", range(20, 35), max_tokens=2))  # 15 tokens: 8, then 7
    step(scheduler, runner)
    again = with_images(make_request("a2", range(1, 13), max_tokens=1), [(2, 8, "x")])
    scheduler.add(again)
    assert len(scheduler.kv_cache.lookup(again)) * config.block_size == 8  # inside the image (2, 10)
    plan, _ = step(scheduler, runner)
    assert chunk_sizes(plan) == [("b", 7)]  # 1 token left: not enough for positions 8 and 9
    plan, _ = step(scheduler, runner)
    assert chunk_sizes(plan) == [("b", 1), ("a2", 4)] and plan.chunks[1].start == 8
    run_to_completion(scheduler, runner)
