"""`slipstream bench serve` against vLLM 0.32's `vllm bench serve` definitions: token events,
peaks, input lengths, arrival times, and its flags and result file, checked against a fake
streaming server with a known chunk timeline and against numbers vLLM's own code gave."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from slipstream.cli import main as cli_main
from slipstream.serve.bench import BenchConfig, RequestResult, SampleRequest, arrival_times, compute_metrics

pytest_plugins = ["train_fixtures"]

PROMPT_TOKENS = 7  # the server's usage.prompt_tokens, unlike the dataset's 8 (a chat template would add some)


class _TimedServer(http.server.BaseHTTPRequestHandler):
    """Streams, at known times after each request arrives: an empty-text first chunk (for chat the
    role-only chunk) at 0.1 s, "a" at 0.4 s, "b" at 0.5 s, an empty finish chunk at 0.6 s, then
    usage. vLLM's definitions give TTFT 0.1 s, ITLs 0.3, 0.1 and 0.1 s, E2EL 0.6 s and TPOT
    (0.6 - 0.1) / (3 - 1) = 0.25 s. Keeps the request bodies it got."""

    bodies: list[dict] = []

    def do_POST(self):
        arrived = time.perf_counter()
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).bodies.append(body)
        chat = self.path == "/v1/chat/completions"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body runs to the closed connection

        def choice(text: str | None, finish: str | None = None) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
                return {"index": 0, "delta": delta if finish is None else {}, "finish_reason": finish}
            return {"index": 0, "text": text or "", "finish_reason": finish}

        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 3, "total_tokens": PROMPT_TOKENS + 3}
        timeline = [(0.1, {"choices": [choice(None)]}), (0.4, {"choices": [choice("a")]}),
                    (0.5, {"choices": [choice("b")]}), (0.6, {"choices": [choice("", "length")]}),
                    (0.6, {"choices": [], "usage": usage})]
        for at, chunk in timeline:
            time.sleep(max(0.0, arrived + at - time.perf_counter()))
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def timed_server():
    handler = type("Handler", (_TimedServer,), {"bodies": []})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield handler, f"http://127.0.0.1:{server.server_address[1]}"
        server.shutdown()


def _bench(url: str, data_dir, *args: str) -> int:
    return cli_main(["bench", "serve", "--base-url", url, "--model", "m", "--tokenizer",
                     str(data_dir / "tokenizer"), "--num-prompts", "2", "--random-input-len", "8",
                     "--random-output-len", "3", "--disable-tqdm", *args])


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_every_chunk_with_choices_is_a_token_event_and_usage_gives_the_input_length(
        endpoint, timed_server, data_dir, tmp_path):
    """As vLLM's clients (completions and chat alike): TTFT runs to the first chunk with choices even
    with empty text (the chat role chunk included), each later one adds an ITL gap, and the input
    length is the server's usage.prompt_tokens. Was TTFT 0.4 s, one ITL, and the dataset's 8."""
    handler, url = timed_server
    assert _bench(url, data_dir, "--endpoint", endpoint, "--percentile-metrics", "ttft,tpot,itl,e2el",
                  "--metric-percentiles", "50,99.9", "--save-result", "--result-dir", str(tmp_path / "out"),
                  "--result-filename", "r.json") == 0
    result = json.loads((tmp_path / "out" / "r.json").read_text())
    slack = 0.09  # the server's sleeps and a loaded machine only ever add delay
    for ttft, itls, latency in zip(result["ttfts"], result["itls"], result["latencies"], strict=True):
        assert 0.1 <= ttft < 0.1 + slack
        assert itls == pytest.approx([0.3, 0.1, 0.1], abs=slack)
        assert 0.6 <= latency < 0.6 + slack
    assert result["median_tpot_ms"] == pytest.approx(250, abs=1000 * slack)
    assert result["input_lens"] == [PROMPT_TOKENS] * 2 and result["total_input_tokens"] == 2 * PROMPT_TOKENS
    assert result["output_lens"] == [3, 3] and result["generated_texts"] == ["ab", "ab"]
    assert {"p50_ttft_ms", "p99.9_ttft_ms", "p50_e2el_ms", "p99.9_itl_ms"} <= result.keys()
    assert "p99_ttft_ms" not in result
    assert len(result["start_times"]) == len(result["queue_times"]) == 2
    assert result["backend"] == ("openai" if endpoint == "/v1/completions" else "openai-chat")
    assert all("temperature" not in body for body in handler.bodies)  # vLLM 0.32 sends none


def test_result_file_flags_percentiles_and_temperature(timed_server, data_dir, tmp_path, monkeypatch, capsys):
    """vLLM's default result name in --result-dir, the older `--save-result FILE`, only the latencies
    asked for (vLLM's default: ttft, tpot, itl at p99), and --temperature sent when given."""
    handler, url = timed_server
    monkeypatch.chdir(tmp_path)
    assert _bench(url, data_dir, "--save-result", "--result-dir", "out", "--temperature", "0.5") == 0
    (path,) = (tmp_path / "out").iterdir()
    assert path.name.startswith("openai-infqps-m-") and path.suffix == ".json"
    result = json.loads(path.read_text())
    assert {"p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "mean_itl_ms"} <= result.keys()
    assert not any("e2el" in key for key in result) and "p90_ttft_ms" not in result
    assert "E2EL" not in capsys.readouterr().out
    assert all(body["temperature"] == 0.5 for body in handler.bodies)
    assert _bench(url, data_dir, "--save-result", "old.json", "--max-concurrency", "1") == 0
    assert json.loads((tmp_path / "old.json").read_text())["completed"] == 2


def _bench_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(cli_main(["bench", "serve", "--model", "m", "--base-url", "http://127.0.0.1:1",
                                   *args]))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("args, expected", [
    (["--percentile-metrics", "ttft,client_queue_time"], "percentile_metrics must be some of"),
    (["--metric-percentiles", "99,x"], "--metric-percentiles takes comma-separated numbers, got '99,x'"),
    (["--metric-percentiles", "101"], "metric_percentiles must be numbers in [0, 100], got (101.0,)"),
    (["--temperature", "-1"], "temperature must be a number >= 0, got -1.0"),
    (["--save-result", "a.json", "--result-filename", "b.json"], "not both ways"),
])
def test_bad_vllm_flag_values_are_errors_naming_them(args, expected, capsys):
    assert expected in _bench_error(capsys, *args)


def _result(start: float, ttft: float, itl: list[float]) -> RequestResult:
    return RequestResult(success=True, output_tokens=len(itl) + 1, start_s=start, ttft_s=ttft, itl_s=itl,
                         latency_s=ttft + sum(itl))


def test_peaks_are_vllms_one_second_buckets_from_the_first_start():
    """Requests sent at 0.5, 1.4 and 2.0 s: vLLM's calculate_metrics (run on the same outputs) gives
    max_output_tokens_per_s 4 and max_concurrent_requests 2 (buckets from 0.5 s; requests active
    at any time within a bucket). Were 3 (buckets from 0 s) and 1 (never two at the same instant)."""
    results = [_result(0.5, 0.1, [0.1, 0.1]), _result(1.4, 0.05, [0.1]), _result(2.0, 0.3, [])]
    requests = [SampleRequest([1, 2, 3, 4], 4, 3)] * 3
    metrics = compute_metrics(requests, results, 3.0, {})
    assert metrics["max_output_tokens_per_s"] == 4.0 and metrics["max_concurrent_requests"] == 2


def test_arrival_times_are_vllms_for_the_same_seed():
    """The send times `vllm bench serve --request-rate 4 --num-prompts 20 --seed 0` measured (from its
    result file's start_times, relative to the first, to 10 ms): it draws the gaps from numpy's
    global legacy generator seeded with --seed. Were another sequence (numpy's default_rng)."""
    vllm = [0.0, 0.27, 0.47, 0.639, 0.757, 0.98, 1.104, 1.584, 2.297, 2.401]
    config = BenchConfig(base_url="http://127.0.0.1:1", model="m", num_prompts=20, request_rate=4.0, seed=0)
    times = arrival_times(config)
    assert times[-1] == pytest.approx(20 / 4.0)
    assert [t - times[0] for t in times[:10]] == pytest.approx(vllm, abs=0.01)


def test_random_chat_prompts_re_encode_to_the_length_asked(data_dir):
    """As vLLM's random dataset: text prompts are trimmed or extended, up to 10 times, toward
    `random_input_len` tokens. Random ids of a byte-level tokenizer decode to broken UTF-8 whose
    replacement characters re-encode longer, so some stay a token or two off, as in vLLM; the
    length reported is the text's. Were 49 to 65 tokens for 32 with this tokenizer."""
    from slipstream.model.tokenizer import Tokenizer
    from slipstream.serve.bench import random_requests

    tokenizer = Tokenizer.from_pretrained(data_dir / "tokenizer")
    config = BenchConfig(base_url="http://127.0.0.1:1", model="m", num_prompts=20, random_input_len=32)
    requests = random_requests(config, tokenizer, as_text=True)
    assert all(len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len for r in requests)
    assert all(32 <= r.prompt_len <= 34 for r in requests) and sum(r.prompt_len == 32 for r in requests) >= 5
