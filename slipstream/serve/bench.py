"""`slipstream bench serve`: a load generator for any OpenAI-compatible server, with the metric
definitions of vLLM's `vllm bench serve` (../../docs/serving.md), so that its numbers compare with
vLLM's and it can measure vLLM itself.

Every request streams. Its clock starts just before the POST; as in vLLM, every chunk with
`choices` counts as a token event, even with empty text (the chat role chunk, a special token, the
finish chunk): TTFT is the time of the first, ITL the gaps between successive ones, pooled over
requests; E2EL runs to the last; TPOT = (E2EL - TTFT) / (output tokens - 1) per request with more
than one output token. Input and output tokens come from the server's `usage` (requested with
`stream_options.include_usage`), else from the dataset and the tokenized output text. Throughputs
divide by the wall time of the whole run. Arrivals follow a gamma process (shape `burstiness`,
1 = Poisson) drawn, as vLLM's, from numpy's legacy generator seeded with `seed` and rescaled so
that N requests span exactly N / rate seconds (the same send times as vLLM's for the same seed);
rate inf sends them all at once.

Datasets: `random` draws prompt token ids uniformly from the tokenizer's non-special ids and sends
them as token ids to /v1/completions (lengths exact), or decoded to text for chat, adjusted as
vLLM's (re-encode, trim or extend, up to 10 times) so that the text re-encodes to the length asked.
`sharegpt` takes the first human turn of each conversation as the prompt and the reply's token
count as the output length, with vLLM's filters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import math
import random
import time
import urllib.parse
from pathlib import Path

import httpx
import numpy as np
from tqdm.auto import tqdm

from slipstream.model.tokenizer import Tokenizer

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One benchmark run; names follow `vllm bench serve`'s flags."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    tokenizer: str | None = None
    """Model directory with tokenizer.json; default: `model`."""
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    sharegpt_output_len: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    goodput: tuple[str, ...] = ()
    """SLOs as "ttft:MS", "tpot:MS", "e2el:MS"."""
    seed: int = 0
    ignore_eos: bool = False
    temperature: float | None = None
    """Sent only when set, as vLLM 0.32 (which no longer sends 0): else the server's default."""
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    """The latencies whose mean, median, std and percentiles are reported (vLLM's default)."""
    metric_percentiles: tuple[float, ...] = (99.0,)
    api_key: str | None = None
    disable_tqdm: bool = False
    ready_timeout_s: float = 60.0
    """Seconds the initial test request may wait to connect and for each piece of its response:
    a server that accepts but never answers fails the run instead of hanging it."""

    def __post_init__(self) -> None:
        _check_base_url(self.base_url)
        if not (math.isfinite(self.ready_timeout_s) and self.ready_timeout_s > 0):
            raise ValueError(f"ready_timeout_s must be a number > 0, got {self.ready_timeout_s}")
        if self.endpoint not in ("/v1/completions", "/v1/chat/completions"):
            raise ValueError(
                f"endpoint must be /v1/completions or /v1/chat/completions, got {self.endpoint!r}"
            )
        if self.dataset_name not in ("random", "sharegpt"):
            raise ValueError(f"dataset_name must be random or sharegpt, got {self.dataset_name!r}")
        if self.dataset_name == "sharegpt" and not self.dataset_path:
            raise ValueError("the sharegpt dataset needs dataset_path")
        for name in ("num_prompts", "random_input_len", "random_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if not self.request_rate > 0 or not 0 < self.burstiness < math.inf:
            raise ValueError(f"request_rate must be > 0 and burstiness a finite number > 0, got "
                             f"{self.request_rate}, {self.burstiness}")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError(f"sharegpt_output_len must be >= 1, got {self.sharegpt_output_len}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.temperature is not None and not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        object.__setattr__(self, "goodput", tuple(self.goodput))
        parse_goodput(self.goodput)
        object.__setattr__(self, "percentile_metrics", tuple(self.percentile_metrics))
        object.__setattr__(self, "metric_percentiles", tuple(self.metric_percentiles))
        unknown = [m for m in self.percentile_metrics if m not in LATENCY_METRICS]
        if unknown or not self.percentile_metrics:
            raise ValueError(f"percentile_metrics must be some of {LATENCY_METRICS}, "
                             f"got {self.percentile_metrics}")
        if not self.metric_percentiles or not all(0 <= p <= 100 for p in self.metric_percentiles):
            raise ValueError(f"metric_percentiles must be numbers in [0, 100], got {self.metric_percentiles}")


def _check_base_url(base_url: str) -> None:
    try:
        parts = urllib.parse.urlsplit(base_url)
        port = parts.port
    except ValueError as e:  # an unclosed IPv6 bracket, a port out of 0-65535 or not a number
        raise ValueError(f"base_url {base_url!r} is not a valid URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"base_url must look like http://HOST:PORT, got {base_url!r}")
    if port == 0:
        raise ValueError(f"base_url {base_url!r}: port 0 is not a server's port")


def parse_goodput(specs: tuple[str, ...] | list[str]) -> dict[str, float]:
    """{"ttft": ms, ...} from ["ttft:500", ...]."""
    slos = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLOs look like ttft:MS, got {spec!r}") from None
        if name not in SLO_METRICS or not 0 < slos[name] < math.inf:
            raise ValueError(f"goodput SLOs are {SLO_METRICS} with a positive value in ms, got {spec!r}")
    return slos


@dataclasses.dataclass(frozen=True, slots=True)
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclasses.dataclass(slots=True)
class RequestResult:
    """What the client saw of one request (seconds from its own start unless said otherwise)."""

    success: bool = False
    error: str = ""
    generated_text: str = ""
    output_tokens: int = 0
    prompt_tokens: int | None = None
    """The server's `usage.prompt_tokens` (its chat template included), when it reports it."""
    ttft_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)
    latency_s: float = 0.0
    start_s: float = 0.0
    """When it was sent, on the run's clock."""
    queue_s: float = 0.0
    """How long it waited for a `max_concurrency` slot after its arrival time."""


# ---- datasets -------------------------------------------------------------------------------


def random_requests(config: BenchConfig, tokenizer: Tokenizer, *, as_text: bool) -> list[SampleRequest]:
    """Random prompts of about `random_input_len` tokens (+- the range ratio), as vLLM's dataset."""
    rng = np.random.default_rng(config.seed)
    special = set(tokenizer.backend.get_added_tokens_decoder())
    allowed = np.array([i for i in range(len(tokenizer)) if i not in special])
    input_lens = _lengths(rng, config.random_input_len, config.random_range_ratio, config.num_prompts)
    output_lens = _lengths(rng, config.random_output_len, config.random_range_ratio, config.num_prompts)
    requests = []
    for input_len, output_len in zip(input_lens, output_lens, strict=True):
        token_ids = rng.choice(allowed, size=input_len).tolist()
        if as_text:
            text, num_tokens = _text_of_length(tokenizer, token_ids, input_len, rng, allowed)
            requests.append(SampleRequest(text, num_tokens, output_len))
        else:
            requests.append(SampleRequest(token_ids, input_len, output_len))
    return requests


def _text_of_length(tokenizer: Tokenizer, token_ids: list[int], length: int, rng: np.random.Generator,
                    allowed: np.ndarray, tries: int = 10) -> tuple[str, int]:
    """Text that re-encodes to `length` tokens where `tries` rounds get there, and its token count.

    Decoding and re-encoding can merge or split tokens, so as vLLM's random dataset the ids are
    trimmed, or extended with random ones, and the text decoded again, until the lengths agree.
    """
    for _ in range(tries + 1):
        text = tokenizer.decode(token_ids)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        num_tokens = len(token_ids)
        if num_tokens == length:
            break
        if num_tokens > length:
            token_ids = token_ids[:length]
        else:
            token_ids += rng.choice(allowed, size=length - num_tokens).tolist()
    return text, num_tokens


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, num: int) -> list[int]:
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=num).tolist()


def sharegpt_requests(config: BenchConfig, tokenizer: Tokenizer) -> list[SampleRequest]:
    """First human turn and reply length of ShareGPT conversations, shuffled by the seed; as vLLM,
    drops pairs under 4 tokens and prompts over 1024 or pairs over 2048 tokens."""
    pairs = _sharegpt_pairs(config.dataset_path)
    random.Random(config.seed).shuffle(pairs)
    requests = []
    for human, reply in pairs:
        prompt_len = len(tokenizer.encode(human["value"]))
        output_len = config.sharegpt_output_len or len(tokenizer.encode(reply["value"]))
        too_short = prompt_len < 4 or (config.sharegpt_output_len is None and output_len < 4)
        if too_short or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        requests.append(SampleRequest(human["value"], prompt_len, output_len))
        if len(requests) == config.num_prompts:
            return requests
    raise ValueError(f"{config.dataset_path} has only {len(requests)} usable conversations, "
                     f"fewer than num_prompts={config.num_prompts}")


def _sharegpt_pairs(path: str) -> list[tuple[dict, dict]]:
    """(human, reply) turns of each conversation with at least two, each turn with a text
    `value`; any other shape is an error naming the file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no ShareGPT dataset file at {path}")
    try:
        conversations = json.loads(Path(path).read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    entry = "{'conversations': [{'value': TEXT}, ...]}"
    if not isinstance(conversations, list):
        raise ValueError(f"{path} must hold a JSON list of {entry}, got {type(conversations).__name__}")
    pairs = []
    for number, c in enumerate(conversations):
        turns = c.get("conversations", []) if isinstance(c, dict) else None
        if not isinstance(turns, list) or not all(
                isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            raise ValueError(f"{path}: entry {number} is not {entry}: {str(c)[:80]}")
        if len(turns) >= 2:
            pairs.append((turns[0], turns[1]))
    return pairs


def arrival_times(config: BenchConfig) -> list[float]:
    """Send times from the run's start: gamma gaps rescaled to span num_prompts / rate, vLLM's for
    the same seed (it seeds numpy's global legacy generator and draws the gaps from it first)."""
    if math.isinf(config.request_rate):
        return [0.0] * config.num_prompts
    rng = np.random.RandomState(config.seed)
    theta = 1.0 / (config.request_rate * config.burstiness)
    times = np.cumsum(rng.gamma(shape=config.burstiness, scale=theta, size=config.num_prompts))
    if not times[-1] > 0:  # every gap drawn as 0 (a tiny burstiness): all at once, as vLLM
        return [0.0] * config.num_prompts
    return (times * (config.num_prompts / config.request_rate / times[-1])).tolist()


# ---- requests --------------------------------------------------------------------------------


def _payload(config: BenchConfig, request: SampleRequest) -> dict:
    payload = {"model": config.model, "stream": True, "stream_options": {"include_usage": True}}
    if config.temperature is not None:
        payload["temperature"] = config.temperature
    if config.endpoint == "/v1/completions":
        payload |= {"prompt": request.prompt, "max_tokens": request.output_len}
    else:
        payload |= {"messages": [{"role": "user", "content": request.prompt}],
                    "max_completion_tokens": request.output_len}
    if config.ignore_eos:
        payload["ignore_eos"] = True
    return payload


async def send_request(client: httpx.AsyncClient, config: BenchConfig, request: SampleRequest,
                       run_start: float, *, timeout_s: float | None = None) -> RequestResult:
    """Stream one request and time its chunks (`timeout_s`: to connect and per read, instead of
    the client's)."""
    result = RequestResult()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    start = time.perf_counter()
    result.start_s = start - run_start
    most_recent = start
    streamed = False  # a chunk with choices came
    try:
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s)
        async with client.stream("POST", config.base_url.rstrip("/") + config.endpoint,
                                 json=_payload(config, request), headers=headers,
                                 timeout=timeout) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body}"
                return result
            async for line in response.aiter_lines():
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {chunk['error']}"
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens") or 0
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens")
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if streamed:
                    result.itl_s.append(now - most_recent)
                else:
                    result.ttft_s = now - start
                most_recent = now
                streamed = True
                result.generated_text += _chunk_text(chunk["choices"][0])
    except httpx.TimeoutException as error:
        result.error = f"{type(error).__name__}: no response within {timeout_s or 'the client timeout'} s"
        return result
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    if not streamed:  # as vLLM: no chunk to time the first token by
        result.error = "no streamed chunk with choices came (does the server stream?)"
        return result
    result.latency_s = most_recent - start
    result.success = True
    return result


def _chunk_text(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def _run(config: BenchConfig, requests: list[SampleRequest]) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=config.max_concurrency,
                          max_keepalive_connections=config.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0), limits=limits) as client:
        test = await send_request(client, config, requests[0], time.perf_counter(),
                                  timeout_s=config.ready_timeout_s)
        if not test.success:
            raise ValueError(f"the initial test request to {config.base_url} failed: {test.error}")
        semaphore = asyncio.Semaphore(config.max_concurrency or len(requests))
        bar = tqdm(total=len(requests), desc="requests", disable=config.disable_tqdm)

        async def limited(request: SampleRequest) -> RequestResult:
            arrived = time.perf_counter()
            async with semaphore:
                result = await send_request(client, config, request, start)
            result.queue_s = result.start_s - (arrived - start)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for request, send_at in zip(requests, arrival_times(config), strict=True):
            await asyncio.sleep(max(0.0, start + send_at - time.perf_counter()))
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - start
        bar.close()
    return results, duration_s


def run_benchmark(config: BenchConfig) -> dict:
    """Run the benchmark; returns vLLM's result JSON fields (the config's included)."""
    tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model)
    if config.dataset_name == "sharegpt":
        requests = sharegpt_requests(config, tokenizer)
    else:
        requests = random_requests(config, tokenizer, as_text=config.endpoint == "/v1/chat/completions")
    results, duration_s = asyncio.run(_run(config, requests))
    for r in results:  # no `usage`: count the text's tokens, as vLLM
        if r.success and not r.output_tokens:
            r.output_tokens = len(tokenizer.encode(r.generated_text, add_special_tokens=False))
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": backend_name(config), "endpoint_type": backend_name(config), "label": backend_name(config),
        "endpoint": config.endpoint, "model_id": config.model,
        "tokenizer_id": config.tokenizer or config.model,
        "dataset_name": config.dataset_name, "num_prompts": config.num_prompts,
        "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
        "burstiness": config.burstiness, "max_concurrency": config.max_concurrency,
    } | compute_metrics(requests, results, duration_s, parse_goodput(config.goodput),
                        percentile_metrics=config.percentile_metrics,
                        metric_percentiles=config.metric_percentiles)


def backend_name(config: BenchConfig) -> str:
    """vLLM's `--backend` that sends what this run sends: "openai" or "openai-chat"."""
    return "openai" if config.endpoint == "/v1/completions" else "openai-chat"


def result_filename(config: BenchConfig, date: str) -> str:
    """vLLM's default result file name: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json."""
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency is not None else ""
    model = config.model.rstrip("/").split("/")[-1]
    return f"{backend_name(config)}-{float(config.request_rate)}qps{concurrency}-{model}-{date}.json"


# ---- metrics ---------------------------------------------------------------------------------


def compute_metrics(requests: list[SampleRequest], results: list[RequestResult], duration_s: float,
                    slos: dict[str, float], *, percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl"),
                    metric_percentiles: tuple[float, ...] = (99.0,)) -> dict:
    """vLLM's `calculate_metrics`: totals, throughputs, goodput, and for each of
    `percentile_metrics` its mean, median, std and `metric_percentiles` in ms."""
    input_lens = [q.prompt_len if r.prompt_tokens is None else r.prompt_tokens
                  for q, r in zip(requests, results, strict=True)]
    done = [r for r in results if r.success]
    values = {"ttft": [r.ttft_s for r in done],
              "tpot": [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
              "itl": [gap for r in done for gap in r.itl_s],
              "e2el": [r.latency_s for r in done]}
    total_input = sum(n for n, r in zip(input_lens, results, strict=True) if r.success)
    total_output = sum(r.output_tokens for r in done)
    metrics = {
        "duration": duration_s, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": _num_good(done, slos) / duration_s if slos else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        **_peaks(done),
        # One entry per request, as vLLM's result file (0, [] and "" where a request failed).
        "input_lens": input_lens,
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft_s if r.success else 0.0 for r in results],
        "itls": [r.itl_s if r.success else [] for r in results],
        "latencies": [r.latency_s if r.success else 0.0 for r in results],
        "start_times": [r.start_s for r in results],
        "queue_times": [r.queue_s for r in results],
        "generated_texts": [r.generated_text if r.success else "" for r in results],
        "errors": [r.error or "" for r in results],
    }
    for name in percentile_metrics:
        ms = np.array(values[name] or [0.0]) * 1000
        metrics |= {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                    f"std_{name}_ms": float(ms.std())}
        metrics |= {f"p{_percentile_name(p)}_{name}_ms": float(np.percentile(ms, p))
                    for p in metric_percentiles}
    return metrics


def _percentile_name(p: float) -> str:
    """"99" for 99.0, "99.9" for 99.9: vLLM's result keys."""
    return str(int(p)) if int(p) == p else str(p)


def _num_good(done: list[RequestResult], slos: dict[str, float]) -> int:
    """Requests meeting every SLO; as vLLM, one with a single output token has TPOT 0."""
    def meets(r: RequestResult) -> bool:
        tpot = (r.latency_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        values_ms = {"ttft": r.ttft_s * 1000, "tpot": tpot * 1000, "e2el": r.latency_s * 1000}
        return all(values_ms[name] <= limit for name, limit in slos.items())
    return sum(meets(r) for r in done)


def _peaks(done: list[RequestResult]) -> dict:
    """vLLM's peaks over one-second buckets counted from the first request's start: the most token
    events (chunks with choices) in a bucket, and the most requests active at any time within one."""
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    first = min(r.start_s for r in done)
    num_buckets = math.ceil(max(r.start_s + r.latency_s for r in done) - first) + 1
    tokens, active = np.zeros(num_buckets), np.zeros(num_buckets)
    for r in done:
        for t in r.start_s + r.ttft_s + np.cumsum([0.0, *r.itl_s]):
            if 0 <= int(t - first) < num_buckets:
                tokens[int(t - first)] += 1
        active[int(r.start_s - first):int(r.start_s + r.latency_s - first) + 1] += 1
    return {"max_output_tokens_per_s": float(tokens.max()), "max_concurrent_requests": int(active.max())}


def format_result(result: dict) -> str:
    """vLLM's "Serving Benchmark Result" table, with the latencies the result has statistics of."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(label: str, value) -> None:
        spec = "<10.2f" if isinstance(value, float) else "<10"
        lines.append(f"{label:<40} {value:{spec}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        if f"mean_{name}_ms" not in result:
            continue
        lines.append(f"{title:-^50}")
        row(f"Mean {name.upper()} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", result[f"median_{name}_ms"])
        for key in result:
            if key.startswith("p") and key.endswith(f"_{name}_ms"):
                row(f"{key.removesuffix(f'_{name}_ms').upper()} {name.upper()} (ms):", result[key])
    lines.append("=" * 50)
    return "\n".join(lines)
