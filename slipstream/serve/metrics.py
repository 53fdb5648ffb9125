"""Prometheus metrics of the server, with vLLM's names under `slipstream:` and its definitions.

Intervals come from the engine's per-request timestamps (../../docs/serving.md): queue =
arrival -> first scheduled, prefill = first scheduled -> first token, decode = first token ->
finished, TTFT = arrival -> first token, end-to-end = arrival -> finished. The arrival time is
taken when the HTTP handler starts, before tokenization, as vLLM's frontend does. Inter-token
latency is observed per completion and engine step that gave it new tokens: the time since the
step that gave it its previous ones. A request's `n` completions count as `n` requests, as vLLM
runs them (its prompt, TTFT, latencies and lengths once per completion). Every metric carries a
`model_name` label. Everything here runs on the event loop, off the engine thread.
"""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from slipstream.serve.async_engine import EngineStats
from slipstream.serve.pooling import EmbeddingRequestOutput
from slipstream.serve.records import request_intervals
from slipstream.serve.request import CompletionOutput, RequestOutput

PREFIX = "slipstream:"

# vLLM's buckets, with finer ones below 10 ms for CPU-sized models.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)




def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """vLLM's buckets of token counts: 1, 2, 5, 10, 20, 50, ... up to `max_tokens`."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_tokens:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclasses.dataclass(slots=True)
class _Progress:
    """What metrics have already counted of one request, per completion."""

    num_tokens: list[int]
    """Tokens seen so far."""
    last_token_time_s: list[float]
    finished: list[bool]


class ServerMetrics:
    """The server's metrics, in a registry of their own (`render()` is the /metrics body)."""

    def __init__(self, model_name: str, max_model_len: int = 2**20, max_loras: int | None = None) -> None:
        """`max_loras`: the engine's, where it serves LoRA adapters (then `lora_requests_info`
        is exported)."""
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between a request's successive "
                                   "new tokens.", ITL_BUCKETS)
        self.tpot = self._histogram("request_time_per_output_token_seconds", "Per request: decode time "
                                    "over output tokens after the first.", ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = self._histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                     REQUEST_BUCKETS)
        self.prefill = self._histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                       REQUEST_BUCKETS)
        self.inference = self._histogram("request_inference_time_seconds", "First scheduled to finish.",
                                         REQUEST_BUCKETS)
        self.request_prompt_tokens = self._histogram("request_prompt_tokens", "Prompt tokens per request.",
                                                     token_buckets(max_model_len))
        self.request_generation_tokens = self._histogram("request_generation_tokens", "Generated tokens "
                                                         "per request.", token_buckets(max_model_len))
        self.decode = self._histogram("request_decode_time_seconds", "First token to finish.",
                                      REQUEST_BUCKETS)
        self.running = self._gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = self._gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests "
                                    "(1 = full).")
        self.kv_used_blocks = self._gauge("kv_cache_used_blocks", "KV-cache blocks held by requests.")
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.prefix_queries = self._counter("prefix_cache_queries", "Prompt tokens looked up in the "
                                            "prefix cache.")
        self.prefix_hits = self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = self._counter("num_preemptions", "Requests preempted to free KV blocks.")
        self.draft_tokens = self._counter("spec_decode_num_draft_tokens", "Speculative guesses checked.")
        self.accepted_tokens = self._counter("spec_decode_num_accepted_tokens", "Speculative guesses the "
                                             "model's own choice confirmed.")
        self.success = Counter(PREFIX + "request_success", "Finished completions by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort", "error"):  # exported at 0 from the start, as vLLM's
            self.success.labels(model_name, reason)
        self.lora_info = None if max_loras is None else Gauge(
            PREFIX + "lora_requests_info", "The LoRA adapters of the running and the waiting requests (as "
            "comma-separated labels; the value is when they were taken, in seconds since the epoch).",
            ["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry)
        self._max_loras = max_loras
        self._progress: dict[str, _Progress] = {}
        self._last_stats = EngineStats(time_s=0.0)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]):
        return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self._model_name)

    def _gauge(self, name: str, doc: str):
        return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self._model_name)

    def _counter(self, name: str, doc: str):
        return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self._model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, outputs: list[RequestOutput | EmbeddingRequestOutput], stats: EngineStats) -> None:
        """Record one engine iteration: its outputs (every one, in order) and the load after it."""
        for output in outputs:
            if isinstance(output, EmbeddingRequestOutput):
                self._observe_embedding(output)
            else:
                self._observe_output(output, stats.time_s)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_used_blocks.set(stats.num_used_blocks)
        last = self._last_stats
        self.prefix_queries.inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_hits.inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.draft_tokens.inc(max(0, stats.num_draft_tokens - last.num_draft_tokens))
        self.accepted_tokens.inc(max(0, stats.num_accepted_tokens - last.num_accepted_tokens))
        if self.lora_info is not None:
            # vLLM's gauge: one series, labelled with the adapters, set to the time. Only the current
            # one is kept (vLLM keeps every past combination, each at its last time).
            self.lora_info.clear()
            waiting, running = ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters)
            labels = self.lora_info.labels(self._model_name, str(self._max_loras), waiting, running)
            labels.set_to_current_time()
        self._last_stats = stats

    def _observe_output(self, output: RequestOutput, now: float) -> None:
        progress = self._progress.get(output.request_id)
        num = len(output.outputs)
        # A request is followed from its first token: outputs before it (prompt logprobs of a
        # chunked prefill) have no tokens to count.
        if progress is None and output.metrics.first_token_time_s is not None:
            progress = _Progress(num_tokens=[0] * num, last_token_time_s=[now] * num, finished=[False] * num)
            self._progress[output.request_id] = progress
            self.prompt_tokens.inc(len(output.prompt_token_ids) * num)
            for _ in range(num):
                self.request_prompt_tokens.observe(len(output.prompt_token_ids))
                self.ttft.observe(output.metrics.time_to_first_token_s)
        for i, completion in enumerate(output.outputs):
            if progress is not None:
                num_new = len(completion.token_ids) - progress.num_tokens[i]
                if num_new > 0:
                    if progress.num_tokens[i] > 0:
                        self.itl.observe(now - progress.last_token_time_s[i])
                    self.generation_tokens.inc(num_new)
                    progress.num_tokens[i] = len(completion.token_ids)
                    progress.last_token_time_s[i] = now
                if completion.finish_reason is None or progress.finished[i]:
                    continue
                progress.finished[i] = True
            elif not output.finished:
                continue
            self._observe_finished(output, completion, now)
        if output.finished:
            self._progress.pop(output.request_id, None)

    def _observe_embedding(self, output: EmbeddingRequestOutput) -> None:
        """An embedding (always final): its prompt, its request and its times, as vLLM counts a
        pooling request's."""
        if output.finish_reason not in ("abort", "error"):
            self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.success.labels(self._model_name, output.finish_reason).inc()
        if output.metrics.e2e_latency_s is not None:
            self.e2e.observe(output.metrics.e2e_latency_s)
        if output.metrics.queue_time_s is not None:
            self.queue.observe(output.metrics.queue_time_s)

    def _observe_finished(self, output: RequestOutput, completion: CompletionOutput, now: float) -> None:
        """One completion that finished (at the end of the iteration at `now`)."""
        finished_s = output.metrics.finished_time_s if output.finished else None
        intervals = request_intervals(output.metrics, now if finished_s is None else finished_s,
                                      len(completion.token_ids))
        self.success.labels(self._model_name, completion.finish_reason).inc()
        self.e2e.observe(intervals["e2e_request_latency_seconds"])
        if output.metrics.first_token_time_s is not None:
            self.request_generation_tokens.observe(len(completion.token_ids))
        for histogram, name in ((self.queue, "request_queue_time_seconds"),
                                (self.prefill, "request_prefill_time_seconds"),
                                (self.inference, "request_inference_time_seconds"),
                                (self.decode, "request_decode_time_seconds"),
                                (self.tpot, "request_time_per_output_token_seconds")):
            if intervals[name] is not None:
                histogram.observe(intervals[name])
