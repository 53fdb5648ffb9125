"""vLLM's torch-profiler interface on the engine (serve/profiler.py): profiler_config, start_profile
and stop_profile on the engine, `LLM` and the server. Each test loads the trace file the run wrote
and checks it holds one `ProfilerStep#N` per engine step of the session and the step's phases."""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from slipstream import LLM, SamplingParams
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.profiler import (
    FORWARD_PHASE,
    PREPARE_INPUTS_PHASE,
    PROCESS_OUTPUTS_PHASE,
    SAMPLE_PHASE,
    SCHEDULE_PHASE,
    STEP_PHASES,
    ProfilerAlreadyActiveError,
    ProfilerConfig,
)
from slipstream.serve.server import OpenAIServer, ServerConfig

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLED = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TRACE_NAME = re.compile(r"(?:(?P<prefix>.+)_)?dp0_pp0_tp0_dcp0_ep0_rank0\.\d+\.pt\.trace\.json(?P<gz>\.gz)?")


def profiler_config(directory: Path, **fields) -> dict:
    return {"profiler": "torch", "torch_profiler_dir": str(directory), "torch_profiler_with_stack": False,
            **fields}


def profiling_engine(model_dir: Path, directory: Path, **fields) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), max_model_len=128, block_size=8,
                               profiler_config=profiler_config(directory, **fields)))


def run_steps(engine: Engine, num_steps: int | None = None) -> int:
    """Step until the engine is idle (or `num_steps` times); the number of steps taken."""
    taken = 0
    while engine.has_unfinished_requests() and (num_steps is None or taken < num_steps):
        engine.step()
        taken += 1
    return taken


def load_trace(directory: Path, prefix: str | None = None, *, gzipped: bool = True) -> list[dict]:
    """The events of the one trace file in `directory` named `prefix`, after checking its name is
    vLLM's."""
    [path] = [p for p in directory.iterdir() if TRACE_NAME.fullmatch(p.name)["prefix"] == prefix]
    assert bool(TRACE_NAME.fullmatch(path.name)["gz"]) == gzipped, path.name
    with (gzip.open(path, "rt") if gzipped else path.open()) as f:
        return json.load(f)["traceEvents"]


def annotations(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("cat") == "user_annotation"]


def step_numbers(events: list[dict]) -> list[int]:
    return sorted(int(e["name"].split("#")[1]) for e in annotations(events)
                  if e["name"].startswith("ProfilerStep#"))


def test_one_profiler_step_per_engine_step_with_the_phases_inside(model_dir, tmp_path):
    """Every engine step of a session is one ProfilerStep#N (N from 0), and each holds the step's
    phases, each once; torch_profiler_record_shapes reaches the profiler."""
    engine = profiling_engine(model_dir, tmp_path, torch_profiler_record_shapes=True)
    engine.add_request("a", "hello world", SAMPLED)
    engine.add_request("b", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], SAMPLED)
    engine.start_profile()
    num_steps = run_steps(engine)
    assert not list(tmp_path.iterdir())  # the trace is written at stop_profile
    engine.stop_profile()
    events = load_trace(tmp_path)
    assert step_numbers(events) == list(range(num_steps)) and num_steps == SAMPLED.max_tokens
    assert any("Input Dims" in e.get("args", {}) for e in events if e.get("cat") == "cpu_op")
    steps = {e["name"]: e for e in annotations(events) if e["name"].startswith("ProfilerStep#")}
    phases = [e for e in annotations(events) if e["name"] in STEP_PHASES]
    for step in steps.values():
        end = step["ts"] + step["dur"]
        inside = [p["name"] for p in phases if step["ts"] <= p["ts"] and p["ts"] + p["dur"] <= end]
        assert sorted(inside) == sorted(STEP_PHASES), (step["name"], inside)


def test_outputs_are_the_same_with_and_without_profiling(model_dir, tmp_path):
    """Profiling changes no token: an LLM without a profiler_config, and one that profiles (through
    its multi-step greedy path and the sampler), give the same outputs."""
    prompts = ["the cat", [3, 1, 4, 1, 5, 9, 2, 6]]
    plain = LLM(str(model_dir), max_model_len=128, block_size=8)
    expected = [[o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
                for params in (GREEDY, SAMPLED)]
    llm = LLM(str(model_dir), max_model_len=128, block_size=8, profiler_config=profiler_config(tmp_path))
    llm.start_profile("port")
    got = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
           for params in (GREEDY, SAMPLED)]
    llm.stop_profile()
    assert got == expected
    names = {e["name"] for e in annotations(load_trace(tmp_path, prefix="port"))}
    assert set(STEP_PHASES) <= names and "ProfilerStep#0" in names


def test_delay_and_max_iterations(model_dir, tmp_path):
    """delay_iterations skips that many steps and max_iterations records at most that many, writing
    the trace as the last one ends; start_profile's values override the config's; the session stays
    open until stop_profile, and the next one writes a trace of its own."""
    engine = profiling_engine(model_dir, tmp_path / "config", delay_iterations=1, max_iterations=2)
    engine.add_request("a", "one two three", GREEDY.replace(max_tokens=20))
    engine.start_profile()
    run_steps(engine, 3)  # the delayed step and the two recorded
    assert step_numbers(load_trace(tmp_path / "config")) == [0, 1]
    run_steps(engine, 2)
    with pytest.raises(ProfilerAlreadyActiveError):
        engine.start_profile()
    engine.stop_profile()
    assert len(list((tmp_path / "config").iterdir())) == 1

    engine = profiling_engine(model_dir, tmp_path / "override", delay_iterations=1, max_iterations=2)
    engine.add_request("a", "one two three", GREEDY.replace(max_tokens=20))
    engine.start_profile("second", delay_iterations=3, max_iterations=4)
    run_steps(engine, 6)
    assert not list((tmp_path / "override").iterdir())  # three delayed, three of four recorded
    run_steps(engine, 1)
    trace = load_trace(tmp_path / "override", prefix="second")
    assert step_numbers(trace) == [0, 1, 2, 3]


def test_wait_warmup_active_schedule(model_dir, tmp_path):
    """As vLLM with wait or warmup iterations: torch's schedule skips `wait` steps, profiles and
    drops `warmup`, records `active` (capped by max_iterations) and writes the trace after them."""
    engine = profiling_engine(model_dir, tmp_path, wait_iterations=1, warmup_iterations=1,
                              active_iterations=3, max_iterations=2)
    engine.add_request("a", "one two three", GREEDY.replace(max_tokens=20))
    engine.start_profile()
    run_steps(engine, 4)  # wait, warmup, two active
    assert step_numbers(load_trace(tmp_path)) == [2, 3]
    run_steps(engine, 2)
    engine.stop_profile()
    assert len(list(tmp_path.iterdir())) == 1


def test_no_trace_without_a_session_or_a_step(model_dir, tmp_path):
    """A configured profiler that no session started writes nothing, nor does a session without a
    step; stop_profile without a session is a no-op, as in vLLM. A trace directory that cannot be
    made is start_profile's ValueError."""
    engine = profiling_engine(model_dir, tmp_path / "traces")
    engine.add_request("a", "hi", GREEDY)
    run_steps(engine)
    engine.stop_profile()
    assert not (tmp_path / "traces").exists()
    engine.start_profile()
    engine.stop_profile()
    assert not list((tmp_path / "traces").iterdir())
    (tmp_path / "file").write_text("")
    engine = profiling_engine(model_dir, tmp_path / "file" / "traces")
    with pytest.raises(ValueError, match="cannot be made"):
        engine.start_profile()
    assert not engine.is_profiling


def test_start_profile_without_a_profiler_is_vllms_error(model_dir):
    """An engine without a profiler_config (or with profiler None) refuses start_profile with vLLM's
    RuntimeError; so does LLM."""
    for config in (None, {"profiler": None}):
        engine = Engine(EngineConfig(model=str(model_dir), max_model_len=64, profiler_config=config))
        with pytest.raises(RuntimeError, match="Profiling is not enabled"):
            engine.start_profile()
    with pytest.raises(RuntimeError, match="Profiling is not enabled"):
        LLM(str(model_dir), max_model_len=64).start_profile()


TORCH = {"profiler": "torch", "torch_profiler_dir": "/tmp/profiles"}


@pytest.mark.parametrize(("fields", "error"), [
    ({"profiler": "cuda"}, "'cuda' is not supported"),
    ({"profiler": "proton"}, "'proton' is not supported"),
    ({"profiler": "nsys"}, "'nsys'"),
    ({"profiler": "torch"}, "torch_profiler_dir must be set"),
    ({"torch_profiler_dir": "/tmp/x"}, "needs profiler 'torch'"),
    ({**TORCH, "ignore_frontend": True}, r"\['ignore_frontend'\]"),
    ({**TORCH, "delay_iterations": -1}, "delay_iterations.*-1"),
    ({**TORCH, "max_iterations": 2.0}, "max_iterations.*2.0"),
    ({**TORCH, "active_iterations": 0}, "active_iterations.*0"),
    ({**TORCH, "torch_profiler_use_gzip": "no"}, "use_gzip.*'no'"),
    ({**TORCH, "torch_profiler_activities": ["XPU"]}, r"\['XPU'\]"),
    ({**TORCH, "torch_profiler_activities": ["CPU", "CPU"]}, "duplicates"),
    ('{"profiler": "torch",', "not valid JSON"),
])
def test_bad_profiler_configs_are_refused_by_name(model_dir, fields, error):
    """A bad profiler_config is a ValueError naming the field or value, as a dict, its JSON text (the
    server's --profiler-config) or through LLM."""
    with pytest.raises(ValueError, match=error):
        EngineConfig(model=str(model_dir), profiler_config=fields)
    if isinstance(fields, dict):
        with pytest.raises(ValueError, match=error):
            EngineConfig(model=str(model_dir), profiler_config=json.dumps(fields))
        with pytest.raises(ValueError, match=error):
            LLM(str(model_dir), profiler_config=fields)


def test_config_object_and_cuda_activity_on_a_cpu_engine(model_dir, tmp_path):
    """A ProfilerConfig object is taken as it is; naming CUDA activity on a CPU engine is refused."""
    config = ProfilerConfig(profiler="torch", torch_profiler_dir=str(tmp_path),
                            torch_profiler_activities=["CPU"])
    assert EngineConfig(model=str(model_dir), profiler_config=config).profiler_config is config
    with pytest.raises(ValueError, match="CUDA.*cpu"):
        Engine(EngineConfig(model=str(model_dir), max_model_len=64, device="cpu",
                            profiler_config=profiler_config(tmp_path, torch_profiler_activities=["CUDA"])))


def test_a_relative_trace_directory_is_made_absolute(tmp_path, monkeypatch):
    """As vLLM's ProfilerConfig does (os.path.abspath after expanduser), not refused."""
    monkeypatch.chdir(tmp_path)
    config = ProfilerConfig.parse({"profiler": "torch", "torch_profiler_dir": "traces"})
    assert config.torch_profiler_dir == str(tmp_path / "traces")


def test_bad_start_profile_arguments(model_dir, tmp_path):
    """A bad prefix (it names a file) or a negative count is a ValueError naming it, and opens no
    session."""
    engine = profiling_engine(model_dir, tmp_path)
    for args, error in ((("../up",), "'../up'"), (("a" * 129,), "profile_prefix"), (("",), "''")):
        with pytest.raises(ValueError, match=re.escape(error)):
            engine.start_profile(*args)
    for name in ("delay_iterations", "max_iterations"):
        with pytest.raises(ValueError, match=f"{name}.*-2"):
            engine.start_profile(**{name: -2})
    engine.start_profile("ok.name-1")


@contextlib.contextmanager
def served(engine: Engine):
    """The server of `engine` under uvicorn on 127.0.0.1, in a thread of this process; its URL."""
    api = OpenAIServer(engine, ServerConfig(port=0))
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_server_profile_endpoints(model_dir, tmp_path):
    """With a profiler_config (here its JSON text, as `--profiler-config` gives it), POST
    /start_profile and /stop_profile profile the engine thread's steps into a trace that exists
    when /stop_profile answers; a second start is a 409, a bad prefix a 400. A session still open
    when the server stops is written then."""
    config = json.dumps(profiler_config(tmp_path, torch_profiler_use_gzip=False))
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=128, block_size=8,
                                 profiler_config=config))
    with served(engine) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/start_profile", json={"profile_prefix": "bad/prefix"}).status_code == 400
        assert client.post("/start_profile", json={"profile_prefix": "http", "unknown": 1}).status_code == 200
        assert client.post("/start_profile").status_code == 409
        body = {"prompt": "hello", "max_tokens": 5, "temperature": 0.5, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/stop_profile").status_code == 200
        events = load_trace(tmp_path, prefix="http", gzipped=False)
        assert step_numbers(events) == list(range(5))
        assert {SCHEDULE_PHASE, PREPARE_INPUTS_PHASE, FORWARD_PHASE, SAMPLE_PHASE, PROCESS_OUTPUTS_PHASE} <= {
            e["name"] for e in annotations(events)}
        assert client.post("/stop_profile").status_code == 200  # nothing to stop: a no-op
        assert client.post("/start_profile", json={"profile_prefix": "last"}).status_code == 200
        assert client.post("/v1/completions", json=body | {"max_tokens": 2}).status_code == 200
    assert step_numbers(load_trace(tmp_path, prefix="last", gzipped=False)) == [0, 1]


def test_server_without_a_profiler_has_no_profile_endpoints(model_dir):
    """As vLLM: the profile routes are registered only when a profiler is configured."""
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=64))
    with served(engine) as url:
        assert httpx.post(url + "/start_profile").status_code == 404
        assert httpx.post(url + "/stop_profile").status_code == 404
