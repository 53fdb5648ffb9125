"""vLLM's torch-profiler interface on the engine (serve/profiler.py): profiler_config, start_profile
and stop_profile on the engine, `LLM` and the server. Each test loads the trace file the run wrote
and checks it holds one `ProfilerStep#N` per engine step of the session and the step's phases."""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import logging
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from server_process import in_process

from slipstream import LLM, SamplingParams
from slipstream.serve.async_engine import AsyncEngine
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.profiler import (
    FORWARD_PHASE,
    PREPARE_INPUTS_PHASE,
    PROCESS_OUTPUTS_PHASE,
    SAMPLE_PHASE,
    SCHEDULE_PHASE,
    STEP_PHASES,
    ProfilerAlreadyActiveError,
)
from slipstream.serve.profiler_config import ProfilerConfig
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


def profile_one_request(model_dir: Path, directory: Path, prefix: str | None = None, **fields) -> None:
    """A session over every step of one greedy request, from start_profile to stop_profile."""
    engine = profiling_engine(model_dir, directory, **fields)
    engine.add_request("a", "one two", GREEDY)
    engine.start_profile(prefix)
    run_steps(engine)
    engine.stop_profile()


def run_steps(engine: Engine, num_steps: int | None = None) -> int:
    """Step until the engine is idle (or `num_steps` times); the number of steps taken."""
    taken = 0
    while engine.has_unfinished_requests() and (num_steps is None or taken < num_steps):
        engine.step()
        taken += 1
    return taken


def trace_files(directory: Path) -> list[Path]:
    """The traces in `directory` (not vLLM's profiler_out.txt tables beside them)."""
    return [p for p in directory.iterdir() if TRACE_NAME.fullmatch(p.name)]


def load_trace(directory: Path, prefix: str | None = None, *, gzipped: bool = True) -> list[dict]:
    """The events of the one trace file in `directory` named `prefix`, after checking its name is
    vLLM's."""
    [path] = [p for p in trace_files(directory) if TRACE_NAME.fullmatch(p.name)["prefix"] == prefix]
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
    assert not trace_files(tmp_path)  # the trace is written at stop_profile
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
    assert len(trace_files(tmp_path / "config")) == 1

    engine = profiling_engine(model_dir, tmp_path / "override", delay_iterations=1, max_iterations=2)
    engine.add_request("a", "one two three", GREEDY.replace(max_tokens=20))
    engine.start_profile("second", delay_iterations=3, max_iterations=4)
    run_steps(engine, 6)
    assert not trace_files(tmp_path / "override")  # three delayed, three of four recorded
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
    assert len(trace_files(tmp_path)) == 1


def test_a_schedule_stopped_before_it_records_writes_nothing(model_dir, tmp_path, caplog):
    """Stopped in the schedule's wait or warm-up steps, a session writes neither a trace nor a
    table (there is nothing recorded to tabulate), and says so."""
    caplog.set_level(logging.INFO, logger="slipstream.serve.profiler")
    engine = profiling_engine(model_dir, tmp_path, wait_iterations=1, warmup_iterations=2)
    engine.add_request("a", "one two three", GREEDY.replace(max_tokens=20))
    for steps in (1, 2):  # in the wait step, then in the warm-up
        engine.start_profile()
        run_steps(engine, steps)
        engine.stop_profile()
    assert list(tmp_path.iterdir()) == [] and "before a step was recorded" in caplog.text
    assert "failed" not in caplog.text


@pytest.mark.parametrize("steps_before", [1, 2], ids=["wait", "warmup"])
def test_a_users_profiler_during_the_schedules_wait_or_warmup_is_left_alone(model_dir, tmp_path, caplog,
                                                                            steps_before):
    """A user's torch profiler opened while a scheduled session waits or warms up (torch's profiler
    not recording yet) keeps the engine's events; the session records nothing, says so, and the
    engine's steps do not fail (torch raised from the step into the warm-up's recording)."""
    caplog.set_level(logging.WARNING, logger="slipstream.serve.profiler")
    engine = profiling_engine(model_dir, tmp_path, wait_iterations=1, warmup_iterations=2)
    engine.add_request("a", "one two three", GREEDY.replace(max_tokens=20))
    engine.start_profile()
    run_steps(engine, steps_before)
    with torch.profiler.profile() as user:
        run_steps(engine, 4)
    engine.stop_profile()
    assert FORWARD_PHASE in {e.name for e in user.events()}
    assert not trace_files(tmp_path) and "already records a torch profile" in caplog.text


def test_stop_profile_on_another_thread_is_refused_and_the_session_kept(model_dir, tmp_path):
    """Only the stepping thread can stop torch's profiler: stop_profile elsewhere is a RuntimeError
    and leaves the session, which the stepping thread then stops and writes."""
    engine = profiling_engine(model_dir, tmp_path)
    engine.add_request("a", "one two three", GREEDY)
    engine.start_profile()
    run_steps(engine, 2)
    errors = []
    worker = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, engine.stop_profile)))
    worker.start()
    worker.join()
    assert "thread that steps the engine" in str(errors[0].value) and engine.is_profiling
    engine.stop_profile()
    assert step_numbers(load_trace(tmp_path)) == [0, 1]


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


def test_start_and_stop_profile_without_a_profiler_are_vllms_error(model_dir):
    """An engine without a profiler_config (or with profiler None) refuses start_profile and
    stop_profile with vLLM's RuntimeError (its worker's profile() checks before start or stop); so
    does LLM."""
    for config in (None, {"profiler": None}):
        engine = Engine(EngineConfig(model=str(model_dir), max_model_len=64, profiler_config=config))
        assert not engine.has_profiler
        for call in (engine.start_profile, engine.stop_profile):
            with pytest.raises(RuntimeError, match="Profiling is not enabled"):
                call()
    llm = LLM(str(model_dir), max_model_len=64)
    for call in (llm.start_profile, llm.stop_profile):
        with pytest.raises(RuntimeError, match="Profiling is not enabled"):
            call()


TORCH = {"profiler": "torch", "torch_profiler_dir": "/tmp/profiles"}


@pytest.mark.parametrize(("fields", "error"), [
    ({"profiler": "cuda"}, "'cuda' is not supported"),
    ({"profiler": "proton"}, "'proton' is not supported"),
    ({"profiler": "nsys"}, "'nsys'"),
    ({"profiler": "torch"}, "torch_profiler_dir must be set"),
    ({"torch_profiler_dir": "/tmp/x"}, "needs profiler 'torch'"),
    ({**TORCH, "proton_context": "shadow"}, r"\['proton_context'\]"),
    ({**TORCH, "capture_torch_profiler": True}, "capture_torch_profiler=True is not supported"),
    ({**TORCH, "detailed_trace_annotation": True}, "detailed_trace_annotation=True is not supported"),
    ({**TORCH, "ignore_frontend": 1}, "ignore_frontend.*1"),
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


def served(engine: Engine):
    """The server of `engine` under uvicorn on 127.0.0.1, in a thread of this process; its URL."""
    return in_process(OpenAIServer(engine, ServerConfig(port=0)))


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


def test_a_users_own_torch_profiler_is_left_alone(model_dir, tmp_path, caplog):
    """Two torch profilers on one thread crash torch or empty one of them: a session whose first
    step finds a user's profiler recording (opened inside the session, or around all of it) records
    nothing and says so, and the user's profile keeps the engine's events; one the user starts and
    stops between two steps of a running session ends the session's recording, which then writes
    no trace instead of crashing. The next session records again."""
    llm = LLM(str(model_dir), max_model_len=128, block_size=8, profiler_config=profiler_config(tmp_path))
    caplog.set_level(logging.WARNING, logger="slipstream.serve.profiler")
    llm.start_profile("inside")
    with torch.profiler.profile() as inside:
        llm.generate(["hello world"], GREEDY, use_tqdm=False)
    llm.stop_profile()
    with torch.profiler.profile() as around:
        llm.start_profile("around")
        llm.generate(["hello world"], GREEDY, use_tqdm=False)
        llm.stop_profile()
    for user in (inside, around):
        assert {SCHEDULE_PHASE, FORWARD_PHASE} <= {e.name for e in user.events()}
    assert "already records a torch profile" in caplog.text
    llm.start_profile("between")
    llm.generate(["hello world"], GREEDY, use_tqdm=False)
    with torch.profiler.profile() as between:
        llm.generate(["hello world"], GREEDY, use_tqdm=False)
    llm.generate(["hello world"], GREEDY, use_tqdm=False)
    llm.stop_profile()
    assert FORWARD_PHASE in {e.name for e in between.events()}
    assert not trace_files(tmp_path) and "ended its recording" in caplog.text
    llm.start_profile("after")
    llm.generate(["hello world"], GREEDY, use_tqdm=False)
    llm.stop_profile()
    assert "ProfilerStep#0" in {e["name"] for e in annotations(load_trace(tmp_path, prefix="after"))}


def break_directory(directory: Path) -> None:
    """Replace the trace directory by a file, so that no trace can be written into it."""
    shutil.rmtree(directory)
    directory.write_text("")


def test_a_trace_that_cannot_be_written_is_logged_not_raised(model_dir, tmp_path, caplog):
    """As vLLM's worker ("Failed to stop profiler"): a trace that cannot be written, at stop_profile
    or as the last of max_iterations steps ends, is a warning naming the directory and the cause,
    never an exception; the next session writes its trace."""
    directory = tmp_path / "traces"
    llm = LLM(str(model_dir), max_model_len=128, block_size=8, profiler_config=profiler_config(directory))
    caplog.set_level(logging.WARNING, logger="slipstream.serve.profiler")
    llm.start_profile()
    llm.generate(["hello"], GREEDY, use_tqdm=False)
    break_directory(directory)
    llm.stop_profile()
    assert f"write the trace to {directory}: [Errno 17] File exists" in caplog.text
    directory.unlink()
    llm.start_profile(max_iterations=1)
    break_directory(directory)
    caplog.clear()
    assert len(llm.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert f"write the trace to {directory}" in caplog.text
    llm.stop_profile()
    directory.unlink()
    llm.start_profile("next")
    llm.generate(["hello"], GREEDY, use_tqdm=False)
    llm.stop_profile()
    assert step_numbers(load_trace(directory, prefix="next"))


def test_a_failed_trace_at_shutdown_keeps_the_abort_outputs(model_dir, tmp_path):
    """The server's engine thread, stopping with a session open whose trace cannot be written,
    still ends the running request's stream with its abort output."""
    directory = tmp_path / "traces"
    engine = profiling_engine(model_dir, directory)

    async def run() -> str | None:
        async_engine = AsyncEngine(engine, max_waiting=4)
        async_engine.start()
        await async_engine.start_profile()
        stream = await async_engine.add({"long": [5, 6, 7]}, GREEDY.replace(max_tokens=100),
                                        arrival_time_s=time.monotonic())
        await stream.get()
        break_directory(directory)
        await async_engine.stop()
        outputs = []
        while not stream.finished:
            outputs += await asyncio.wait_for(stream.get(), timeout=10)
        return outputs[-1].outputs[0].finish_reason

    assert asyncio.run(run()) == "abort"


def test_a_step_mark_covers_the_step_only(model_dir, tmp_path):
    """Without a schedule each ProfilerStep#N is a host-thread user_annotation opened and closed
    around its engine step (what slipstream perf trace and HTA look for): time between steps (a
    server's idle time) lies outside every mark."""
    engine = profiling_engine(model_dir, tmp_path)
    engine.add_request("a", "one two three", GREEDY.replace(max_tokens=20))
    engine.start_profile()
    engine.step()
    before_sleep = time.perf_counter_ns()
    time.sleep(0.2)
    after_sleep = time.perf_counter_ns()
    engine.step()
    engine.stop_profile()
    events = load_trace(tmp_path)
    steps = sorted((e for e in annotations(events) if e["name"].startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    assert [e["name"] for e in steps] == ["ProfilerStep#0", "ProfilerStep#1"]
    forward_threads = {e["tid"] for e in annotations(events) if e["name"] == FORWARD_PHASE}
    assert {e["tid"] for e in steps} == forward_threads and len(forward_threads) == 1
    gap_us = steps[1]["ts"] - (steps[0]["ts"] + steps[0]["dur"])
    assert gap_us >= (after_sleep - before_sleep) / 1000 * 0.99
    assert all(e["dur"] < 200_000 for e in steps)


@pytest.mark.parametrize("fields", [
    {"ignore_frontend": True, "torch_profiler_dump_cuda_time_total": False},
    {"ignore_frontend": False, "capture_torch_profiler": False, "detailed_trace_annotation": False},
    {"torch_profiler_record_shapes": True},
])
def test_vllm_fields_and_the_profiler_out_table(model_dir, tmp_path, fields):
    """vLLM's ignore_frontend (either value: slipstream's one trace holds its front end),
    torch_profiler_dump_cuda_time_total (it chooses the device-time table, and a CPU engine has
    none), capture_torch_profiler and detailed_trace_annotation (False) are taken; as vLLM's CPU-only
    worker, `<worker>.profiler_out.txt` beside the trace holds key_averages sorted by self CPU time,
    at most 50 rows (grouped by input shape when shapes are recorded)."""
    profile_one_request(model_dir, tmp_path, "tab", **fields)
    assert step_numbers(load_trace(tmp_path, prefix="tab")) == list(range(GREEDY.max_tokens))
    table = (tmp_path / "tab_dp0_pp0_tp0_dcp0_ep0_rank0.profiler_out.txt").read_text().splitlines()
    columns = [match.span() for match in re.finditer(r"-+", table[0])]
    names = [table[1][start:end].strip() for start, end in columns]
    rows = [[line[start:end].strip() for start, end in columns] for line in table[3:table.index(table[0], 3)]]
    assert ("Input Shapes" in names) == bool(fields.get("torch_profiler_record_shapes"))
    self_cpu = [float(row[names.index("Self CPU %")].rstrip("%")) for row in rows]
    assert 10 < len(rows) <= 50 and self_cpu == sorted(self_cpu, reverse=True)


def test_an_export_cut_short_leaves_no_trace(model_dir, tmp_path, caplog, monkeypatch):
    """Kineto does not raise when it cannot write the whole file (a full disk): a trace cut short
    is never left where `perf trace` would read it; the failure is a warning naming the cause."""
    caplog.set_level(logging.WARNING, logger="slipstream.serve.profiler")
    export = torch.profiler.profile.export_chrome_trace

    def cut_short(self, path):
        export(self, path)
        Path(path).write_bytes(Path(path).read_bytes()[:1000])

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", cut_short)
    profile_one_request(model_dir, tmp_path)
    assert list(tmp_path.iterdir()) == [] and "no complete trace" in caplog.text


def test_a_table_that_fails_leaves_the_trace(model_dir, tmp_path, caplog, monkeypatch):
    """torch's key_averages() fails now and then on profiles with Python frames: the trace is
    written all the same, and the warning names the table, not the trace."""
    caplog.set_level(logging.WARNING, logger="slipstream.serve.profiler")

    def fails(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xb0", 0, 1, "invalid start byte")

    monkeypatch.setattr(torch.profiler.profile, "key_averages", fails)
    profile_one_request(model_dir, tmp_path)
    assert step_numbers(load_trace(tmp_path)) == list(range(GREEDY.max_tokens))
    assert "key_averages table" in caplog.text and "failed to stop" not in caplog.text


def test_an_open_session_is_written_when_the_engine_goes_or_the_program_exits(model_dir, tmp_path):
    """As vLLM's worker shutdown stops its profiler: a session left open is written when its engine
    is garbage-collected, and when a script exits without stop_profile."""
    engine = profiling_engine(model_dir, tmp_path / "gc")
    engine.add_request("a", "hi", GREEDY)
    engine.start_profile()
    run_steps(engine)
    del engine
    gc.collect()
    assert step_numbers(load_trace(tmp_path / "gc")) == list(range(GREEDY.max_tokens))
    script = (f"from slipstream import LLM, SamplingParams\n"
              f"llm = LLM({str(model_dir)!r}, max_model_len=64, profiler_config={{'profiler': 'torch', "
              f"'torch_profiler_dir': {str(tmp_path / 'exit')!r}}})\n"
              f"llm.start_profile()\n"
              f"llm.generate(['hi'], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, capture_output=True)
    assert step_numbers(load_trace(tmp_path / "exit"))


def test_server_stop_profile_answers_200_when_the_trace_cannot_be_written(model_dir, tmp_path, caplog):
    """As vLLM's /stop_profile (its worker logs "Failed to stop profiler"): a 200, the cause in the
    log, and the server goes on serving and profiling."""
    directory = tmp_path / "traces"
    engine = profiling_engine(model_dir, directory, torch_profiler_use_gzip=False)
    caplog.set_level(logging.WARNING, logger="slipstream.serve.profiler")
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    with served(engine) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/start_profile").status_code == 200
        assert client.post("/v1/completions", json=body).status_code == 200
        break_directory(directory)
        assert client.post("/stop_profile").status_code == 200
        assert f"write the trace to {directory}: [Errno 17]" in caplog.text
        directory.unlink()
        assert client.post("/start_profile", json={"profile_prefix": "again"}).status_code == 200
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/stop_profile").status_code == 200
    assert step_numbers(load_trace(directory, prefix="again", gzipped=False)) == [0, 1, 2]
