"""A real `slipstream serve` process for the server tests, and the session fixture that shares one;
`in_process`, a server's app under uvicorn on a thread of the test's own process, and
`serve_in_process`, the server a `slipstream serve` command line configures, on such a thread.

The server runs as `python -m slipstream.cli serve` on a free port of 127.0.0.1 over the small
model of serve_fixtures.py, with one torch thread (the model's ops take microseconds; a second
thread only waits on a loaded machine). Its output goes to a log file that a failing start-up
prints. PYTEST_DONT_REWRITE: this module holds no asserts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

API_KEY = "test-key"
MODEL_NAME = "tiny-test"
MAX_MODEL_LEN = 256
ENGINE_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--block-size", "8")
START_TIMEOUT_S = 90.0
KEEP_ALIVE_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(local address, port) of each TCP socket process `pid` listens on: the LISTEN entries of
    /proc/net/tcp and tcp6 whose inodes are among its descriptors (the address in hex, as those
    tables write it: 0100007F is 127.0.0.1)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].rsplit(":", 1)
                sockets.add((address, int(port, 16)))
    return sockets


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` listens on TCP `port` of 127.0.0.1 or of every address."""
    return bool({("0100007F", port), ("00000000", port)} & listening_sockets(pid))


class ServerProcess:
    """`slipstream serve MODEL_DIR --port P ARGS...` in a subprocess."""

    def __init__(self, model_dir: Path, log_path: Path, *args: str) -> None:
        self.log_path = log_path
        self._args = [str(model_dir), "--served-model-name", MODEL_NAME, *args]
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "slipstream.cli", "serve", "--port", str(self.port), *self._args]
        # Idle connections outlive the clients' (httpx keeps them 5 s, as the server would by
        # default), so a client never reuses one that the server is closing at that moment.
        env = os.environ | {"OMP_NUM_THREADS": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(KEEP_ALIVE_S)}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> ServerProcess:
        """Wait for /health to answer 200 from this server; fail with its log if it never does.
        The free port may be taken by another test's server before this one binds it (another
        pytest worker's, which then answers here): this one is then started again on another."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for _ in range(3):
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    answered = httpx.get(self.url + "/health", timeout=1.0).status_code == 200
                except httpx.HTTPError:
                    answered = False
                if answered and listens_on(self.process.pid, self.port):
                    return self
                if answered:  # another process's server on this port
                    break
                time.sleep(0.1)
            else:
                break
            self.stop()
            self._start()
        self.stop()
        pytest.fail(f"the server did not start; its log:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def metric_values(server: ServerProcess) -> dict[str, float]:
    """The unlabelled-by-reason samples of /metrics, by metric name."""
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_and_labels, value = line.rsplit(" ", 1)
            values[name_and_labels.split("{")[0] + _reason(name_and_labels)] = float(value)
    return values


def wait_for_idle(server: ServerProcess, timeout_s: float = 10.0) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds KV blocks (aborts land within a step or two)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = metric_values(server)
        idle = all(values[f"slipstream:{name}"] == 0 for name in
                   ("num_requests_running", "num_requests_waiting", "kv_cache_used_blocks"))
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def _reason(name_and_labels: str) -> str:
    marker = 'finished_reason="'
    if marker not in name_and_labels:
        return ""
    return ":" + name_and_labels.split(marker)[1].split('"')[0]


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory) -> ServerProcess:
    """One server for the functional, bad-input, load and bench tests, with an API key."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    process = ServerProcess(model_dir, log_path, "--api-key", API_KEY, *ENGINE_ARGS).wait_ready()
    yield process
    process.stop()


@dataclasses.dataclass(frozen=True)
class Served:
    """A server on a thread of this process, as `serve_in_process` yields it."""

    url: str


@contextlib.contextmanager
def serve_in_process(model_dir: Path, *args: str) -> Iterator[Served]:
    """`slipstream serve MODEL_DIR ARGS...` as the CLI configures it (its parser and
    `serve_configs`), served by `in_process`: for the tests of a flag, which need no process of
    their own (a `ServerProcess` costs ~3 s of imports more, and the model loads either way)."""
    from slipstream.cli import build_parser, serve_configs
    from slipstream.serve.engine import Engine
    from slipstream.serve.server import OpenAIServer, served_engine_config

    parsed = build_parser().parse_args(["serve", str(model_dir), "--served-model-name", MODEL_NAME, *args])
    engine_config, config = serve_configs(parsed)
    engine = Engine(served_engine_config(engine_config, config))  # OpenAIServer checks the LoRA modules
    try:
        with in_process(OpenAIServer(engine, config)) as url:
            yield Served(url)
    finally:
        engine.shutdown()


@contextlib.contextmanager
def in_process(api) -> Iterator[str]:
    """The app of `api` (an OpenAIServer) under uvicorn on a thread of this process; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=0, log_level="critical",
                                           timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)

