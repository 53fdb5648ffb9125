"""The server under load and faults: hundreds of concurrent streams with a third cancelled
mid-stream, the bounded waiting queue (503 with Retry-After), draining on SIGTERM, and
`slipstream bench serve` against a live server."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import random
import signal
import threading
import time

import httpx
import pytest
from server_process import API_KEY, ENGINE_ARGS, MODEL_NAME, ServerProcess, metric_values, wait_for_idle

from slipstream.cli import main as cli_main
from slipstream.serve.served_models import http_timeout_keep_alive

pytest_plugins = ["serve_fixtures", "server_process"]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_LOAD_REQUESTS = 200
LOAD_TIMEOUT_S = 60.0


async def stream_request(client: httpx.AsyncClient, index: int, cancel_after: int | None) -> str:
    """One streamed completion; with `cancel_after`, hang up after that many chunks. Returns
    "completed", "cancelled" or what went wrong. A stream to be cancelled asks for ten times the
    tokens, so that the server is still generating it when the client hangs up, however late a
    loaded machine runs the client (at 24 tokens, the server once finished every such stream
    first, and nothing was aborted)."""
    max_tokens = 24 if cancel_after is None else 240
    body = {"model": MODEL_NAME, "prompt": f"request {index}:", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 1.0, "seed": index}
    chunks = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {(await response.aread()).decode()}"
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunks.append(json.loads(line[6:]))
            if cancel_after is not None and len(chunks) >= cancel_after:
                return "cancelled"  # leaving the block closes the connection mid-stream
    finished = chunks and chunks[-1]["choices"][0]["finish_reason"] == "length"
    return "completed" if finished else f"stream ended without a finish: {chunks[-1:]}"


async def cancelled_plain_request(client: httpx.AsyncClient, index: int) -> str:
    """A non-streaming request whose client gives up after a few milliseconds."""
    body = {"model": MODEL_NAME, "prompt": f"plain {index}", "max_tokens": 200, "ignore_eos": True}
    try:
        response = await client.post("/v1/completions", json=body, timeout=0.005 * (1 + index % 5))
    except httpx.TimeoutException:
        return "cancelled"
    return "completed" if response.status_code == 200 else f"HTTP {response.status_code}"


async def load(url: str) -> list[str]:
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, limits=limits, timeout=LOAD_TIMEOUT_S) as client:
        tasks = [stream_request(client, i, rng.randint(1, 6) if rng.random() < 1 / 3 else None)
                 for i in range(NUM_LOAD_REQUESTS)]
        tasks += [cancelled_plain_request(client, i) for i in range(10)]
        return await asyncio.wait_for(asyncio.gather(*tasks), LOAD_TIMEOUT_S)


def test_load_with_cancellations_frees_every_block(server):
    """200 concurrent streams, a third hung up mid-stream, plus non-streaming requests abandoned by
    their clients: each completes or is cancelled cleanly, nothing answers 5xx, and afterwards no
    request runs or waits and the KV cache holds zero blocks."""
    before = metric_values(server)
    outcomes = asyncio.run(load(server.url))
    unexpected = [o for o in outcomes if o not in ("completed", "cancelled")]
    assert not unexpected, unexpected[:5]
    assert outcomes.count("cancelled") >= NUM_LOAD_REQUESTS // 5
    values = wait_for_idle(server)
    assert values["slipstream:num_requests_running"] == 0
    assert values["slipstream:num_requests_waiting"] == 0
    assert values["slipstream:kv_cache_used_blocks"] == 0
    assert values["slipstream:kv_cache_usage_perc"] == 0
    aborted = values.get("slipstream:request_success_total:abort", 0) - before.get(
        "slipstream:request_success_total:abort", 0)
    assert aborted > 0
    assert httpx.post(server.url + "/v1/completions", headers=AUTH,
                      json={"prompt": "still there?", "max_tokens": 2}).status_code == 200


async def burst(url: str, num: int) -> list[httpx.Response]:
    body = {"model": MODEL_NAME, "prompt": "queue", "max_tokens": 96, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(num)])


@pytest.fixture(scope="module")
def small_queue_server(model_dir, tmp_path_factory) -> ServerProcess:
    log_path = tmp_path_factory.mktemp("small-queue") / "server.log"
    process = ServerProcess(model_dir, log_path, "--max-waiting", "2", "--max-num-seqs", "1",
                            *ENGINE_ARGS).wait_ready()
    yield process
    process.stop()


def test_full_waiting_queue_answers_503(small_queue_server):
    """Past --max-waiting, requests get 503 with Retry-After and an OpenAI error body at once; the
    admitted ones complete, and the server serves again once the queue drains."""
    responses = asyncio.run(burst(small_queue_server.url, 12))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 6 and statuses.count(200) >= 1, statuses
    rejected = next(r for r in responses if r.status_code == 503)
    assert int(rejected.headers["Retry-After"]) >= 1
    assert rejected.json()["error"]["code"] == "overloaded"
    assert all(r.json()["usage"]["completion_tokens"] == 96 for r in responses if r.status_code == 200)
    assert [r.status_code for r in asyncio.run(burst(small_queue_server.url, 1))] == [200]


def test_sigterm_drains_in_flight_requests_and_exits_0(model_dir, tmp_path):
    """On SIGTERM the server stops accepting (new connections are refused), lets a request in
    flight finish, answers 503 to one that outlives --drain-timeout (aborting it), and exits 0."""
    server = ServerProcess(model_dir, tmp_path / "server.log", "--drain-timeout", "3", "--max-num-seqs", "2",
                           *ENGINE_ARGS).wait_ready()
    try:
        asyncio.run(drain_scenario(server))
        assert server.process.wait(timeout=30) == 0, server.log()
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def stream_and_queued(client: httpx.AsyncClient, stream_n: int, queued_n: int):
    """A streamed request of `stream_n` completions that has sent its first event, and a
    non-streamed one of `queued_n` queued behind it (200 tokens each, two sequences at a time:
    far longer than the tests): (the stream's remaining lines, the queued request's task)."""
    body = {"prompt": "short", "max_tokens": 200, "n": stream_n, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        queued = asyncio.create_task(client.post("/v1/completions", json={
            "prompt": "long", "max_tokens": 200, "n": queued_n, "ignore_eos": True}))
        await asyncio.sleep(0.3)
        yield lines, queued


def assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "unavailable"


async def drain_scenario(server: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        async with stream_and_queued(client, stream_n=1, queued_n=128) as (lines, endless):
            server.terminate()
            await asyncio.sleep(0.3)
            with pytest.raises(httpx.ConnectError):
                async with httpx.AsyncClient(timeout=5) as other:
                    await other.post(server.url + "/v1/completions", json={"prompt": "new"})
            events = [line async for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert_unavailable(await endless)


def test_second_ctrl_c_aborts_in_flight_requests_cleanly(model_dir, tmp_path):
    """A second SIGINT while draining aborts what is in flight at once, long before the drain
    timeout: the stream ends with finish reason "abort" and [DONE], the waiting client gets the
    503 JSON, no handler fails, and the server exits 0."""
    server = ServerProcess(model_dir, tmp_path / "server.log", "--drain-timeout", "60", "--max-num-seqs", "2",
                           *ENGINE_ARGS).wait_ready()
    try:
        start = time.monotonic()
        asyncio.run(second_interrupt_scenario(server))
        assert server.process.wait(timeout=30) == 0, server.log()
        assert time.monotonic() - start < 30
        assert "Exception in ASGI application" not in server.log()
    finally:
        server.stop()


async def second_interrupt_scenario(server: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        # 64 completions of 200 tokens, two at a time: on a fast CPU 16 could all end before the
        # second interrupt (a Zen 5 did), leaving nothing in flight to abort.
        async with stream_and_queued(client, stream_n=64, queued_n=64) as (lines, waiting):
            server.process.send_signal(signal.SIGINT)
            await asyncio.sleep(0.3)
            server.process.send_signal(signal.SIGINT)
            events = [line async for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        reasons = [c["finish_reason"] for e in events[:-1] for c in json.loads(e[6:])["choices"]]
        assert "abort" in reasons
        assert_unavailable(await waiting)


def test_bench_serve_reports_vllm_metrics(server, model_dir, tmp_path, capsys):
    """`slipstream bench serve` against a live server writes vLLM's result fields (and prints its
    table), for completions with token-id prompts and for chat with text prompts."""
    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        path = tmp_path / "result.json"
        code = cli_main(["bench", "serve", "--base-url", server.url, "--model", MODEL_NAME,
                         "--tokenizer", str(model_dir), "--endpoint", endpoint, "--num-prompts", "6",
                         "--random-input-len", "20", "--random-output-len", "8", "--ignore-eos",
                         "--request-rate", "40", "--goodput", "ttft:60000", "tpot:60000", "--seed", "1",
                         "--api-key", API_KEY, "--save-result", "--result-dir", str(tmp_path),
                         "--result-filename", path.name, "--percentile-metrics", "ttft,tpot,itl,e2el",
                         "--metric-percentiles", "90,99", "--temperature", "0", "--disable-tqdm"])
        assert code == 0
        result = json.loads(path.read_text())
        assert result["completed"] == 6 and result["failed"] == 0
        assert result["total_output_tokens"] == 6 * 8
        if endpoint == "/v1/completions":
            assert result["total_input_tokens"] == 6 * 20
        assert result["request_goodput"] == pytest.approx(result["request_throughput"])
        for name in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "std", "p90", "p99"):
                assert result[f"{stat}_{name}_ms"] >= 0
        assert result["mean_e2el_ms"] >= result["mean_ttft_ms"] > 0
        assert 0 < result["output_throughput"] < result["total_token_throughput"]
        # One token event per chunk with choices: up to 8 tokens, and for chat the role chunk first.
        most = 7 + (endpoint == "/v1/chat/completions")
        assert len(result["itls"]) == 6 and all(len(itl) <= most for itl in result["itls"])
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_bench_serve_sharegpt(server, model_dir, tmp_path):
    """The ShareGPT dataset: the first human turn is the prompt, the reply's token count the output
    length, conversations too short dropped; results count the prompts asked for."""
    conversations = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    for i in range(3):
        conversations += [
            {"conversations": [{"from": "human", "value": f"question number {i} about caches and queues"},
                               {"from": "gpt", "value": f"answer {i}: " + "tokens " * (4 + i)}]},
            {"conversations": [{"from": "human", "value": "an unanswered question"}]},
        ]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    path = tmp_path / "result.json"
    code = cli_main(["bench", "serve", "--base-url", server.url, "--model", MODEL_NAME, "--tokenizer",
                     str(model_dir), "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
                     "--num-prompts", "3", "--api-key", API_KEY, "--save-result", str(path),
                     "--disable-tqdm"])
    assert code == 0
    result = json.loads(path.read_text())
    assert result["completed"] == 3 and result["num_prompts"] == 3
    assert result["total_input_tokens"] == sum(result["input_lens"]) > 3 * 4



class _FlakyServer(http.server.BaseHTTPRequestHandler):
    """Streams two text chunks, except every third request: a 400; or, with `streams` off, one plain
    JSON completion as a server that ignores "stream" answers."""

    streams = True
    count = 0

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).count += 1
        if self.count % 3 == 0:
            self.send_response(400)
            self.end_headers()
            return
        choice = {"index": 0, "text": "hello", "finish_reason": None}
        chunks = [{"choices": [choice]}, {"choices": [choice | {"finish_reason": "length"}]},
                  {"choices": [], "usage": {"completion_tokens": 2}}]
        body = ("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n" if self.streams
                else json.dumps({"choices": [choice | {"finish_reason": "length"}]}))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream" if self.streams else "application/json")
        self.send_header("content-length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("streams", [True, False])
def test_bench_serve_counts_what_the_server_streamed(streams, model_dir, tmp_path):
    """As vLLM's: a 200 with no streamed chunk is a failure (it counted as a success with TTFT 0,
    so a server ignoring "stream" scored any goodput), and the result file has one entry per
    request in every per-request list (failed ones 0 or ""), so that they line up."""
    handler = type("Handler", (_FlakyServer,), {"streams": streams, "count": 0})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as fake:
        thread = threading.Thread(target=fake.serve_forever, daemon=True)
        thread.start()
        path = tmp_path / "result.json"
        code = cli_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{fake.server_address[1]}",
                         "--model", MODEL_NAME, "--tokenizer", str(model_dir), "--num-prompts", "6",
                         "--random-input-len", "8", "--random-output-len", "2", "--save-result", str(path),
                         "--disable-tqdm"])
        fake.shutdown()
    if not streams:  # the test request before the run fails: nothing is measured
        assert code != 0 and not path.exists()
        return
    assert code == 0
    result = json.loads(path.read_text())
    assert (result["completed"], result["failed"]) == (4, 2)
    for name in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"):
        assert len(result[name]) == 6, name
    failed = [i for i, error in enumerate(result["errors"]) if error]
    assert len(failed) == 2 and all(result["output_lens"][i] == 0 for i in failed)


def test_bench_arrival_times_are_finite_or_refused():
    """A burstiness of inf is refused by name; one so small that every gamma gap is 0 sends all at
    once (both gave NaN send times, read as "now")."""
    from slipstream.serve.bench import BenchConfig, arrival_times

    with pytest.raises(ValueError, match="burstiness"):
        BenchConfig(base_url="http://127.0.0.1:1", model="m", num_prompts=3, burstiness=float("inf"))
    tiny = BenchConfig(base_url="http://127.0.0.1:1", model="m", num_prompts=3, request_rate=5,
                       burstiness=1e-300)
    assert all(t == t and t >= 0 for t in arrival_times(tiny))


def test_keep_alive_timeout_is_read_as_vllm_reads_it():
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE: whole seconds, default 5 (vLLM's and uvicorn's)."""
    assert http_timeout_keep_alive({}) == 5
    assert http_timeout_keep_alive({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": " 30 "}) == 30


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "five"])
def test_a_bad_keep_alive_timeout_stops_serve_naming_it(value, model_dir, monkeypatch, capsys):
    """A VLLM_HTTP_TIMEOUT_KEEP_ALIVE that is no positive whole number stops `serve` with status 2
    and an error naming the variable and the value, before any model is loaded."""
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", value)
    assert cli_main(["serve", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" in err and repr(value) in err
