"""The server's engine loop: `Engine.step()` in a background thread, asyncio on the outside.

The event loop never runs engine code. Requests and aborts cross into the engine thread through a
thread-safe command queue, which the thread drains before every step (and blocks on when it has
nothing to do). After each iteration the thread hands the step's outputs and a snapshot of the
engine's load to the event loop in one `call_soon_threadsafe` call; there each output goes to the
asyncio queue of its `RequestStream`. torch releases the GIL inside its kernels, so the event loop
keeps serving HTTP while a step runs.

The thread survives anything a step raises: it logs the exception, fails the requests in flight
(their streams raise `EngineError`) and aborts them, freeing their KV blocks, then keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import PIL.Image

from slipstream.serve.engine import Engine
from slipstream.serve.lora import LoRARequest
from slipstream.serve.multimodal import ProcessedImage
from slipstream.serve.pooling import EmbeddingRequestOutput, PoolingParams
from slipstream.serve.request import RequestOutput, RequestStatus, SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while serving a request (a bug, logged in full where it happened)."""


class Overloaded(RuntimeError):
    """The waiting queue is full."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's load, taken in the engine thread at the end of an iteration."""

    time_s: float
    """When the iteration ended (monotonic); the time its new tokens count as produced."""
    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    num_blocks: int = 1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    """Speculative guesses checked so far, and of them the confirmed ones."""
    num_accepted_tokens: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    """Names of the LoRA adapters running requests use, and waiting ones (sorted)."""
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks


@dataclasses.dataclass(frozen=True, slots=True)
class _Add:
    prompts: dict[str, list[int]]
    params: SamplingParams | PoolingParams
    """PoolingParams: prompts to embed (a pooling engine's)."""
    arrival_time_s: float
    accepted: concurrent.futures.Future
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    images: Sequence[ProcessedImage] = ()
    """Every prompt's images (a chat's: it has one prompt), preprocessed off the engine thread."""

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * (self.params.n if isinstance(self.params, SamplingParams) else 1)


@dataclasses.dataclass(frozen=True, slots=True)
class _Profile:
    """Start (with `Engine.start_profile`'s arguments) or stop profiling, in the engine thread: torch's
    profiler records the thread that starts it."""

    start: bool
    done: concurrent.futures.Future
    profile_prefix: str | None = None
    delay_iterations: int | None = None
    max_iterations: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Call:
    """Run `function` in the engine thread, between steps; its result or exception goes to `done`."""

    function: Callable[[], Any]
    done: concurrent.futures.Future


@dataclasses.dataclass(frozen=True, slots=True)
class _Abort:
    request_ids: list[str] | None
    """None: every request the engine holds."""


_STOP = object()

Output = RequestOutput | EmbeddingRequestOutput
StepCallback = Callable[[list[Output], EngineStats], None]


class RequestStream:
    """The outputs of the prompts of one API call, in order, as the engine produces them.

    Outputs are cumulative, so the stream keeps only the newest one of each prompt until the
    consumer reads it: a reader slower than the engine (a client that stops reading its socket)
    costs one output per prompt, not every step's copy of the whole text and token ids so far."""

    def __init__(self, request_ids: Sequence[str], engine: AsyncEngine) -> None:
        self.request_ids = list(request_ids)
        self._engine = engine
        self._pending: dict[str, Output] = {}
        """The newest unread output of each prompt that changed since the last `get`."""
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._unfinished = set(request_ids)

    @property
    def finished(self) -> bool:
        """Whether the consumer has seen the final output of every prompt."""
        return not self._unfinished

    def put(self, item: Output | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._pending[item.request_id] = item  # replaces an older, unread output
        self._ready.set()

    async def get(self) -> list[Output]:
        """The newest output of every prompt that changed since the last call (waits for one);
        raises the error the stream failed with (then on every later call too)."""
        if self._error is None:
            await self._ready.wait()
            self._ready.clear()
        if self._error is not None:
            raise self._error
        newest, self._pending = self._pending, {}
        self._unfinished.difference_update(o.request_id for o in newest.values() if o.finished)
        return list(newest.values())

    async def __aiter__(self) -> AsyncIterator[list[Output]]:
        """Each `get` until every prompt has finished. Leaving early (a break, an exception, a
        cancelled task) closes the stream, so its unfinished prompts are aborted, as vLLM's
        `AsyncLLM.generate` aborts its request; a caller of `get` must call `close` itself."""
        try:
            while not self.finished:
                yield await self.get()
        finally:
            self.close()

    def close(self) -> None:
        """Abort the prompts that are not finished, whose outputs no one will read any more (the
        client went away or the server stops)."""
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished), notify=False)
            self._unfinished.clear()


class AsyncEngine:
    """Runs an `Engine` in a thread of its own and serves it to coroutines on one event loop.

    `on_step` (called on the event loop) sees every output and every load snapshot, for metrics.
    """

    def __init__(self, engine: Engine, *, max_waiting: int, on_step: StepCallback | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.stats = EngineStats(time_s=time.monotonic(), num_blocks=engine.limits.num_blocks)
        self._on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._num_in_transit = 0
        """Sequences sent to the engine thread that it has not queued yet (event loop only)."""
        self._active: set[str] = set()
        """Requests the engine holds (engine thread only)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- the event loop's side ------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="slipstream-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever is still running and end the engine thread."""
        self._stopping = True
        if self._thread is not None:
            self._commands.put(_STOP)
            await asyncio.to_thread(self._thread.join)

    @property
    def is_alive(self) -> bool:
        """Whether the loop runs and the engine can step (a dead tensor-parallel worker stops it)."""
        return self._thread is not None and self._thread.is_alive() and self.engine.is_healthy

    @property
    def num_waiting(self) -> int:
        """Sequences not yet scheduled, those still on their way to the engine included."""
        return self.stats.num_waiting + self._num_in_transit

    async def add(
        self, prompts: dict[str, list[int]], params: SamplingParams | PoolingParams, *, arrival_time_s: float,
        priority: int = 0, cache_salt: str | None = None, lora_request: LoRARequest | None = None,
        chat_template_kwargs: dict[str, Any] | None = None, images: Sequence[PIL.Image.Image] = (),
    ) -> RequestStream:
        """Queue the prompts of one API call (request id -> prompt token ids) under one stream: to
        generate from (with `Engine.add_request`'s priority, cache salt, LoRA adapter, chat
        template variables and images), or with PoolingParams to embed.

        Raises `Overloaded` when they would take the waiting queue past `max_waiting`, ValueError
        when they could never fit in it, and the engine's ValueError for input it rejects (then
        none of them is queued). Images are checked and preprocessed in a worker thread
        (`Engine.process_images`), so that the engine thread's steps never wait on them."""
        if self._stopping:
            raise Overloaded("the engine is stopping")
        if images:
            truncate = params.truncate_prompt_tokens if isinstance(params, SamplingParams) else None
            images = await asyncio.to_thread(self.engine.process_images, list(prompts.values()), images,
                                             truncate)
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        command = _Add(prompts, params, arrival_time_s, accepted, priority, cache_salt, lora_request,
                       chat_template_kwargs, tuple(images))
        num_sequences = command.num_sequences
        if num_sequences > self.max_waiting:
            per_prompt = num_sequences // len(prompts)
            raise ValueError(f"{'n' if per_prompt > 1 else 'prompt'} makes {num_sequences} sequences "
                             f"({len(prompts)} prompts x n={per_prompt}), more than the server queues "
                             f"({self.max_waiting})")
        if self.num_waiting + num_sequences > self.max_waiting:
            raise Overloaded(f"{self.num_waiting} sequences are waiting (at most {self.max_waiting})")
        stream = RequestStream(list(prompts), self)
        for request_id in prompts:
            self._streams[request_id] = stream
        self._num_in_transit += num_sequences
        self._commands.put(command)
        try:
            await asyncio.wrap_future(accepted)
        except BaseException:
            stream.close()
            raise
        return stream

    def abort(self, request_ids: list[str], *, notify: bool = True) -> None:
        """Abort requests (their KV blocks are freed before the next step); unknown ids are ignored.
        Their streams end with an output of finish reason "abort", or, with notify=False, hear
        nothing more."""
        if not notify:
            for request_id in request_ids:
                self._streams.pop(request_id, None)
        self._commands.put(_Abort(request_ids))

    def abort_all(self) -> None:
        """Abort every request; their streams end with finish reason "abort"."""
        self._commands.put(_Abort(None))

    async def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                            max_iterations: int | None = None) -> None:
        """`Engine.start_profile` in the engine thread, before its next step; raises what it raises."""
        await self._profile(_Profile(True, concurrent.futures.Future(), profile_prefix, delay_iterations,
                                     max_iterations))

    async def stop_profile(self) -> None:
        """`Engine.stop_profile` in the engine thread; returns once the trace is written."""
        await self._profile(_Profile(False, concurrent.futures.Future()))

    async def _profile(self, command: _Profile) -> None:
        self._commands.put(command)
        await asyncio.wrap_future(command.done)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """`Engine.add_lora` in the engine thread: the adapter loaded (False: it was already), or
        the engine's ValueError."""
        return await self._call(functools.partial(self.engine.add_lora, lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """`Engine.remove_lora` in the engine thread."""
        return await self._call(functools.partial(self.engine.remove_lora, lora_int_id))

    async def _call(self, function: Callable[[], Any]) -> Any:
        if self._stopping:
            raise Overloaded("the engine is stopping")
        command = _Call(function, concurrent.futures.Future())
        self._commands.put(command)
        return await asyncio.wrap_future(command.done)

    def _deliver(
        self, outputs: list[Output], failed: list[str], stats: EngineStats, num_taken: int
    ) -> None:
        """Runs on the event loop: route one iteration's outputs to their streams."""
        self._num_in_transit -= num_taken
        self.stats = stats
        for request_id in failed:  # before their abort outputs, which they must not see
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(EngineError("the engine failed while running this request; see the server log"))
        if self._on_step is not None:
            try:
                self._on_step(outputs, stats)
            except Exception:  # metrics must never stop outputs from reaching their streams
                logger.exception("the on_step callback failed")
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
                if output.finished:
                    del self._streams[output.request_id]

    # ---- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        """The engine thread: take commands, step, deliver; until told to stop."""
        while True:
            commands = self._take_commands(block=not self._active)
            stopping = _STOP in commands
            num_taken = sum(c.num_sequences for c in commands if isinstance(c, _Add))
            try:
                outputs, failed = self._iterate([c for c in commands if c is not _STOP], step=not stopping)
                if stopping:
                    outputs += self._abort(None)
            except Exception:  # a bug outside step(): keep serving the other requests
                logger.exception("engine loop iteration failed")
                outputs, failed = [], []
            if stopping and self.engine.is_profiling:  # as vLLM's shutdown: the session's trace is kept
                try:  # after the aborts, so that no failure here can cost their outputs
                    self.engine.stop_profile()
                except Exception:
                    logger.exception("stopping the profiler at shutdown failed")
            self._post(outputs, failed, num_taken)
            if stopping:
                return

    def _take_commands(self, *, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _iterate(self, commands: list, *, step: bool) -> tuple[list[Output], list[str]]:
        """Apply the commands, then step: (outputs, ids of requests that failed in the step)."""
        outputs: list[Output] = []
        for command in commands:
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Profile):
                self._apply_profile(command)
            elif isinstance(command, _Call):
                _run_call(command)
            else:
                outputs += self._abort(command.request_ids)
        failed: list[str] = []
        if step and self._active:
            step_outputs, failed = self._step()
            outputs += step_outputs
        for output in outputs:
            if output.finished:
                self._active.discard(output.request_id)
        return outputs, failed

    def _add(self, command: _Add) -> None:
        """Queue all prompts of one call, or none; the caller learns which through `accepted`."""
        if not command.accepted.set_running_or_notify_cancel():
            return  # the client left before the engine saw the request
        added = []
        try:
            for request_id, token_ids in command.prompts.items():
                if isinstance(command.params, PoolingParams):
                    self.engine.add_embedding_request(request_id, token_ids, command.params,
                                                      arrival_time_s=command.arrival_time_s)
                else:
                    self.engine.add_request(request_id, token_ids, command.params,
                                            arrival_time_s=command.arrival_time_s, priority=command.priority,
                                            cache_salt=command.cache_salt, lora_request=command.lora_request,
                                            chat_template_kwargs=command.chat_template_kwargs,
                                            images=command.images)
                added.append(request_id)
        except Exception as error:
            if not isinstance(error, ValueError):
                logger.exception("add_request failed")
            command.accepted.set_exception(error)
            self.engine.abort_request(added)
            return
        self._active.update(added)
        command.accepted.set_result(None)

    def _apply_profile(self, command: _Profile) -> None:
        try:
            if command.start:
                self.engine.start_profile(command.profile_prefix, delay_iterations=command.delay_iterations,
                                          max_iterations=command.max_iterations)
            else:
                self.engine.stop_profile()
        except Exception as error:  # the caller's to report (a bad prefix, a session already open)
            command.done.set_exception(error)
        else:
            command.done.set_result(None)

    def _abort(self, request_ids: list[str] | None, reason: str = "abort") -> list[Output]:
        request_ids = sorted(self._active) if request_ids is None else request_ids
        outputs = self.engine.abort_request(request_ids, reason)
        self._active.difference_update(request_ids)
        return outputs

    def _step(self) -> tuple[list[Output], list[str]]:
        """One engine step; when it raises, the requests in flight fail (their final outputs, of
        finish reason "error", still go out, for the metrics) and the loop goes on."""
        try:
            return self.engine.step(), []
        except Exception:
            logger.exception("engine step failed; failing the %d requests in flight", len(self._active))
            failed = sorted(self._active)
            try:
                return self._abort(failed, reason="error"), failed
            except Exception:
                logger.exception("aborting the failed requests failed too")
                self._active.clear()
                return [], failed

    def _post(self, outputs: list[Output], failed: list[str], num_taken: int) -> None:
        kv_cache = self.engine.scheduler.kv_cache
        stats = EngineStats(
            time_s=time.monotonic(), num_running=self.engine.num_running, num_waiting=self.engine.num_waiting,
            num_used_blocks=kv_cache.num_used_blocks, num_blocks=kv_cache.num_blocks,
            prefix_cache_queries=kv_cache.prefix_cache_queries, prefix_cache_hits=kv_cache.prefix_cache_hits,
            num_preemptions=self.engine.scheduler.num_preemptions,
            num_draft_tokens=self.engine.num_draft_tokens,
            num_accepted_tokens=self.engine.num_accepted_tokens,
            running_lora_adapters=tuple(self.engine.lora_names(RequestStatus.RUNNING)),
            waiting_lora_adapters=tuple(self.engine.lora_names(RequestStatus.WAITING)),
        )
        try:
            self._loop.call_soon_threadsafe(self._deliver, outputs, failed, stats, num_taken)
        except RuntimeError:  # the event loop is closed: nobody is left to deliver to
            pass


def _run_call(command: _Call) -> None:
    if not command.done.set_running_or_notify_cancel():
        return  # the caller left
    try:
        result = command.function()
    except Exception as error:  # the caller's to report (a bad adapter)
        if not isinstance(error, ValueError):
            logger.exception("an engine call failed")
        command.done.set_exception(error)
    else:
        command.done.set_result(result)
