"""The server's engine loop in-process: outputs reach their streams, an abort frees KV blocks before
the next step, and a failing engine step fails only the requests in flight while the loop keeps
serving."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest

from slipstream.serve.async_engine import AsyncEngine, EngineError
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.request import SamplingParams

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), max_model_len=128, block_size=8))


async def run_to_end(loop_engine: AsyncEngine, request_id: str, prompt: list[int]):
    stream = await loop_engine.add({request_id: prompt}, PARAMS, arrival_time_s=time.monotonic())
    while not stream.finished:
        [output] = await stream.get()
    return output


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_outputs_match_the_engine_run_directly(engine):
    """Concurrent requests through the loop thread give the same greedy tokens as Engine.step()."""
    prompts = {f"r{i}": [11 + i, 12, 13, 14 + i] for i in range(4)}

    async def main():
        loop_engine = AsyncEngine(engine, max_waiting=16)
        loop_engine.start()
        outputs = await asyncio.gather(*[run_to_end(loop_engine, rid, p) for rid, p in prompts.items()])
        await loop_engine.stop()
        return outputs

    served = asyncio.run(main())
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, PARAMS)
    direct = {}
    while engine.has_unfinished_requests():
        direct |= {o.request_id: o for o in engine.step() if o.finished}
    for output in served:
        assert output.outputs[0].token_ids == direct[output.request_id].outputs[0].token_ids


def test_closing_a_stream_aborts_and_frees_blocks(engine):
    """A consumer that closes its stream mid-generation aborts the request: its blocks are free
    and nothing runs by the next load snapshot."""
    async def main():
        loop_engine = AsyncEngine(engine, max_waiting=16)
        loop_engine.start()
        stream = await loop_engine.add({"a": [5, 6, 7]}, PARAMS, arrival_time_s=time.monotonic())
        [first] = await stream.get()
        assert not first.finished
        stream.close()
        stats = lambda: loop_engine.stats  # noqa: E731
        await wait_until(lambda: stats().num_running == 0 and stats().num_used_blocks == 0)
        await loop_engine.stop()

    asyncio.run(main())
    assert not engine.has_unfinished_requests()


async def collect(stream) -> list:
    return [output async for outputs in stream for output in outputs]


def test_abort_ends_the_stream_with_finish_reason_abort(engine):
    """AsyncEngine.abort, as vLLM's: whoever reads the request's stream gets a final output of
    finish reason "abort" rather than waiting forever."""
    async def main():
        loop_engine = AsyncEngine(engine, max_waiting=16)
        loop_engine.start()
        stream = await loop_engine.add({"a": [5, 6, 7]}, PARAMS, arrival_time_s=time.monotonic())
        [first] = await stream.get()
        loop_engine.abort(["a"])
        outputs = await asyncio.wait_for(collect(stream), timeout=10)
        await loop_engine.stop()
        return first, outputs[-1]

    first, last = asyncio.run(main())
    assert not first.finished
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert 0 < len(last.outputs[0].token_ids) < PARAMS.max_tokens


def test_cancelling_the_task_that_iterates_a_stream_aborts_the_request(engine):
    """`async for` over a stream aborts its request when the reading task is cancelled, as vLLM's
    AsyncLLM.generate does: the blocks come back without anyone calling close()."""
    async def main():
        loop_engine = AsyncEngine(engine, max_waiting=16)
        loop_engine.start()
        stream = await loop_engine.add({"a": [5, 6, 7]}, PARAMS, arrival_time_s=time.monotonic())
        first_output = asyncio.Event()

        async def read():
            async for _ in stream:
                first_output.set()

        reader = asyncio.create_task(read())
        await first_output.wait()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        stats = lambda: loop_engine.stats  # noqa: E731
        await wait_until(lambda: stats().num_running == 0 and stats().num_used_blocks == 0)
        await loop_engine.stop()

    asyncio.run(main())
    assert not engine.has_unfinished_requests()


def test_failing_step_fails_requests_in_flight_and_the_loop_goes_on(engine, monkeypatch):
    """An exception inside Engine.step() is logged, the requests in flight get EngineError and lose
    their blocks (their final outputs, for the metrics, end as "error", vLLM's finish reason for
    a request an engine error ended), and the next request is served normally."""
    real_step = engine.step
    calls = []

    def step_failing_once():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(engine, "step", step_failing_once)

    seen = []

    async def main():
        loop_engine = AsyncEngine(engine, max_waiting=16, on_step=lambda outputs, _: seen.extend(outputs))
        loop_engine.start()
        with pytest.raises(EngineError):
            await run_to_end(loop_engine, "doomed", [8, 9, 10])
        await wait_until(lambda: loop_engine.stats.num_used_blocks == 0)
        output = await run_to_end(loop_engine, "fine", [8, 9, 10])
        await loop_engine.stop()
        return output

    output = asyncio.run(main())
    assert output.finished and len(output.outputs[0].token_ids) == PARAMS.max_tokens
    [doomed] = [o for o in seen if o.request_id == "doomed" and o.finished]
    assert doomed.outputs[0].finish_reason == "error"


def test_metrics_count_a_chunked_prompt_with_prompt_logprobs_once(model_dir):
    """A prompt prefilled in several chunks with prompt logprobs gets an output per chunk before
    its first token: its prompt tokens and time to first token are counted at the first token,
    once (they were never counted), and the finish reasons are exported at 0 from the start."""
    from slipstream.serve.async_engine import EngineStats
    from slipstream.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    sample = functools.partial(metrics.registry.get_sample_value, labels={"model_name": "m"})
    assert metrics.registry.get_sample_value("slipstream:request_success_total",
                                             {"model_name": "m", "finished_reason": "abort"}) == 0
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=128, block_size=8,
                                 max_num_batched_tokens=16))
    prompt = list(range(5, 65))
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, prompt_logprobs=1, ignore_eos=True))
    num_outputs = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_outputs += len(outputs)
        metrics.observe(outputs, EngineStats(time_s=time.monotonic()))
    assert num_outputs > 3  # outputs with prompt logprobs only came before the first token
    assert sample("slipstream:prompt_tokens_total") == len(prompt)
    assert sample("slipstream:time_to_first_token_seconds_count") == 1
    assert sample("slipstream:generation_tokens_total") == 3


def test_metrics_count_each_of_n_completions_as_vllm_counts_its_child_requests(model_dir):
    """vLLM runs a request's n completions as n requests: prompt tokens, TTFT, end-to-end latency,
    the per-request token histograms and successes are counted once per completion, so that
    successes equal the end-to-end count and throughput panels read as on vLLM."""
    from slipstream.serve.async_engine import EngineStats
    from slipstream.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m", max_model_len=128)
    sample = functools.partial(metrics.registry.get_sample_value, labels={"model_name": "m"})
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=128, block_size=8))
    prompt = [5, 6, 7, 8, 9, 10, 11]
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=7,
                                                   ignore_eos=True))
    engine.add_request("s", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        metrics.observe(engine.step(), EngineStats(time_s=time.monotonic()))
    assert sample("slipstream:prompt_tokens_total") == 4 * len(prompt)
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_prompt_tokens_count", "request_generation_tokens_count",
                 "request_inference_time_seconds_count", "request_decode_time_seconds_count"):
        assert sample(f"slipstream:{name}") == 4, name
    generated = 3 * 7 + 3
    assert sample("slipstream:generation_tokens_total") == generated
    assert sample("slipstream:request_generation_tokens_sum") == generated
    assert sample("slipstream:inter_token_latency_seconds_count") == 3 * 6 + 2
    assert metrics.registry.get_sample_value("slipstream:request_success_total",
                                             {"model_name": "m", "finished_reason": "length"}) == 4


def test_priorities_order_the_waiting_requests(model_dir):
    """With room for one sequence under the priority policy, of two requests queued behind a long
    one, the one of lower priority value runs first though it came later (as vLLM's priority)."""
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=128, block_size=8, max_num_seqs=1,
                                 scheduling_policy="priority"))
    finished = []

    async def run(loop_engine: AsyncEngine, name: str, priority: int, max_tokens: int, started=None):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        stream = await loop_engine.add({name: [5, 6, 7]}, params, arrival_time_s=time.monotonic(),
                                       priority=priority)
        async for _ in stream:
            if started is not None:
                started.set()
        finished.append(name)

    async def main():
        loop_engine = AsyncEngine(engine, max_waiting=16)
        loop_engine.start()
        started = asyncio.Event()
        long = asyncio.create_task(run(loop_engine, "long", 0, 100, started))
        await started.wait()
        later = asyncio.create_task(run(loop_engine, "later", 5, 2))
        await wait_until(lambda: loop_engine.stats.num_waiting == 1)
        urgent = asyncio.create_task(run(loop_engine, "urgent", -1, 2))
        await asyncio.gather(long, later, urgent)
        await loop_engine.stop()

    asyncio.run(main())
    assert finished == ["long", "urgent", "later"]
