"""Clients that go away: hang-ups at every point of a request leave no KV blocks, no running or
waiting requests and no traceback in the server's log, and a client that stops reading its stream
does not make the server keep every step's output for it."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import weakref

import httpx
import pytest
from server_process import API_KEY, MODEL_NAME, metric_values, wait_for_idle

from slipstream.serve.async_engine import EngineError, RequestStream
from slipstream.serve.request import CompletionOutput, RequestMetrics, RequestOutput

pytest_plugins = ["serve_fixtures", "server_process"]

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def raw_post(server, path: str, body: dict) -> tuple[bytes, bytes]:
    """The head and the body of a POST, as bytes for a socket."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    return head.encode(), data


def test_hangups_at_every_point_free_everything_and_log_no_traceback(server):
    """Clients that hang up mid-body, right after the request (streamed or not: completions, chat
    with n=3 and responses, to the end of the context) or after the first bytes of a stream: their
    requests are aborted, nothing runs, waits or holds KV blocks, the log has no traceback (a
    hang-up is no bug: a body cut short used to log "Exception in ASGI application" with one), and
    the server serves on."""
    long = {"model": MODEL_NAME, "prompt": "hang up", "max_tokens": None, "ignore_eos": True}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "n": 3, "ignore_eos": True}
    response = {"model": MODEL_NAME, "input": "hang up", "ignore_eos": True}
    requests = [(path, body | {"stream": stream}) for path, body in (
        ("/v1/completions", long), ("/v1/chat/completions", chat), ("/v1/responses", response))
        for stream in (False, True)]
    log_before = server.log()
    before = metric_values(server)
    sockets = []
    for path, body in requests * 3:
        head, data = raw_post(server, path, body)
        for sent, read_first in ((head + data[:10], False), (head + data, False), (head + data, True)):
            if read_first and not body["stream"]:
                continue
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(sent)
            if read_first:
                assert sock.recv(1)
            sockets.append(sock)
    for sock in sockets:
        sock.close()
    values = wait_for_idle(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_used_blocks"):
        assert values[f"slipstream:{name}"] == 0, name
    aborted = "slipstream:request_success_total:abort"
    assert values[aborted] > before.get(aborted, 0)  # (on a slow machine some may finish before the hang-up)
    response = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"prompt": "still there?",
                                                                            "max_tokens": 2})
    assert response.status_code == 200
    new_log = server.log()[len(log_before):]
    assert "Traceback" not in new_log and "Exception in ASGI" not in new_log, new_log[-3000:]


def output(request_id: str, num_tokens: int, *, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(index=0, text="x" * num_tokens, token_ids=[7] * num_tokens,
                                  finish_reason="length" if finished else None)
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[1], outputs=[completion],
                         finished=finished, metrics=RequestMetrics(arrival_time_s=0.0))


class _NoEngine:
    def abort(self, request_ids):
        pass


def test_unread_stream_keeps_only_the_newest_output_of_each_prompt():
    """A consumer that does not read (a client that stopped reading its socket) costs one output
    per prompt: older cumulative outputs are dropped as newer ones arrive, not queued (they were:
    every step's copy of the text and token ids, quadratic in the length, ~300 MB for one stalled
    n=128 stream of a 512-token context). The next read gets the newest of each prompt; an error
    is raised on that read and every later one."""
    async def main():
        stream = RequestStream(["a", "b"], _NoEngine())
        older = []
        for num_tokens in range(1, 50):
            item = output("a", num_tokens)
            older.append(weakref.ref(item))
            stream.put(item)
        del item
        stream.put(output("b", 3))
        stream.put(output("a", 50, finished=True))
        gc.collect()
        assert all(ref() is None for ref in older)  # nothing holds the outputs superseded unread
        newest = {o.request_id: len(o.outputs[0].token_ids) for o in await stream.get()}
        assert newest == {"a": 50, "b": 3}
        assert not stream.finished
        stream.put(EngineError("injected"))
        for _ in range(2):
            with pytest.raises(EngineError):
                await asyncio.wait_for(stream.get(), 1.0)

    asyncio.run(main())
