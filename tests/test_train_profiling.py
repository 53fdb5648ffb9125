"""Profiler traces of training runs (`[profiling]`, torchtitan's keys and layout): the right
steps traced into the right files, valid Chrome-trace JSON, per rank under torchrun, on the same
schedule after a resume, bad settings refused, the training itself unchanged, and a trace that
cannot be written neither taking the run down nor left truncated."""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from train_fixtures import read_metrics, small_config, train_with_torchrun

from slipstream.perf.goodput import read_events
from slipstream.perf.trace import analyze
from slipstream.train.config import ProfilingConfig, load_config
from slipstream.train.profiling import StepProfiler
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures"]

EVERY_2_STEPS = ("--profiling.enable_profiling=true", "--profiling.profile_freq=2",
                 "--profiling.profiler_warmup=1", "--profiling.profiler_active=1")
"""A trace every 2 steps: step 1 warms up, step 2 is recorded, and so on."""


def _trace_files(run_dir: Path) -> dict[str, list[str]]:
    """{iteration folder: its file names} under the default traces folder."""
    traces = run_dir / "profile_traces"
    return {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(traces.iterdir())}


def _profiler_steps(trace: Path) -> list[str]:
    """The `ProfilerStep#N` annotations of a Chrome-trace file, sorted."""
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))


def test_traces_every_profile_freq_steps_without_changing_the_losses(data_dir, train_model_dir, tmp_path):
    """Six steps traced every 2 write iteration_2, _4 and _6, each one rank0_trace.json holding
    its step's ProfilerStep#N and the step's ops; the losses equal those of the same run without
    profiling, bit for bit, and that run writes no traces. Each trace's writing is charged like a
    checkpoint's stall: a `profile` metrics record and a `profile` ledger event."""
    plain = small_config(data_dir, train_model_dir, tmp_path / "plain", "--training.steps=6")
    profiled = small_config(data_dir, train_model_dir, tmp_path / "profiled", "--training.steps=6",
                            *EVERY_2_STEPS)
    Trainer(plain).run()
    trainer = Trainer(profiled)
    trainer.run()

    assert not (tmp_path / "plain" / "profile_traces").exists()
    assert _trace_files(tmp_path / "profiled") == {f"iteration_{n}": ["rank0_trace.json"] for n in (2, 4, 6)}
    for n in (2, 4, 6):
        trace = tmp_path / "profiled" / "profile_traces" / f"iteration_{n}" / "rank0_trace.json"
        assert _profiler_steps(trace) == [f"ProfilerStep#{n}"]
        names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
        assert {"aten::mm", "Optimizer.step#AdamW.step"} & names, sorted(names)[:20]
    losses = [r["loss"] for r in read_metrics(tmp_path / "plain")]
    assert len(losses) == 6 and [r["loss"] for r in read_metrics(tmp_path / "profiled")] == losses

    records = read_metrics(tmp_path / "profiled", "profile")
    assert [r["step"] for r in records] == [2, 4, 6]
    assert records[0]["path"] == str(tmp_path / "profiled" / "profile_traces/iteration_2/rank0_trace.json")
    events = [e for e in read_events(tmp_path / "profiled") if e["event"] == "profile"]
    assert [e["step"] for e in events] == [2, 4, 6] and all(e["trace_s"] > 0 for e in events)
    assert trainer.time_s["profiling"] == pytest.approx(sum(e["trace_s"] for e in events))


def test_resumed_run_continues_the_step_schedule(data_dir, train_model_dir, tmp_path):
    """A trace of 2 active steps every 3 (one warm-up step) ends at steps 3 and 6; a run stopped
    after step 4 and resumed from its checkpoint traces steps 5 and 6 into iteration_6, as the
    uninterrupted run does, not steps counted from the restart."""
    schedule = ("--profiling.enable_profiling=true", "--profiling.profile_freq=3",
                "--profiling.profiler_warmup=1", "--profiling.profiler_active=2",
                "--checkpoint.save_final=true")
    run_dir = tmp_path / "run"
    Trainer(small_config(data_dir, train_model_dir, run_dir, "--training.steps=4", *schedule)).run()
    assert _trace_files(run_dir) == {"iteration_3": ["rank0_trace.json"]}
    trainer = Trainer(small_config(data_dir, train_model_dir, run_dir, "--training.steps=6", *schedule))
    assert trainer.step == 4
    trainer.run()

    assert _trace_files(run_dir) == {f"iteration_{n}": ["rank0_trace.json"] for n in (3, 6)}
    for n, steps in ((3, [2, 3]), (6, [5, 6])):
        trace = run_dir / "profile_traces" / f"iteration_{n}" / "rank0_trace.json"
        assert _profiler_steps(trace) == [f"ProfilerStep#{k}" for k in steps]


def test_a_window_cut_by_a_restart_is_written_in_two_parts(data_dir, train_model_dir, tmp_path):
    """Steps 3 and 4 recorded of every 4 (step 2 warms up): the uninterrupted run writes both to
    iteration_4; a run stopped after step 3 writes step 3 to iteration_3, and the resumed run
    records step 4, with no warm-up before it, into iteration_4 (torchtitan does the same)."""
    schedule = ("--profiling.enable_profiling=true", "--profiling.profile_freq=4",
                "--profiling.profiler_warmup=1", "--profiling.profiler_active=2",
                "--checkpoint.save_final=true")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    Trainer(small_config(data_dir, train_model_dir, whole, "--training.steps=4", *schedule)).run()
    for steps in (3, 4):
        Trainer(small_config(data_dir, train_model_dir, cut, f"--training.steps={steps}", *schedule)).run()

    assert _profiler_steps(whole / "profile_traces/iteration_4/rank0_trace.json") == ["ProfilerStep#3",
                                                                                        "ProfilerStep#4"]
    assert _trace_files(cut) == {f"iteration_{n}": ["rank0_trace.json"] for n in (3, 4)}
    for n in (3, 4):
        trace = cut / "profile_traces" / f"iteration_{n}" / "rank0_trace.json"
        assert _profiler_steps(trace) == [f"ProfilerStep#{n}"]


def _failing_export(monkeypatch, fail: Callable[[str], None], times: int = 1) -> None:
    """Make the first `times` trace exports call `fail(path)` instead of writing; later ones write."""
    real = torch.profiler.profile.export_chrome_trace
    calls = []

    def export(profile, path, *args, **kwargs):
        calls.append(path)
        if len(calls) <= times:
            return fail(path)
        return real(profile, path, *args, **kwargs)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)


def _disk_full(path: str) -> None:
    raise OSError(errno.ENOSPC, "No space left on device", path)


@pytest.mark.parametrize("failure", ["folder_is_a_file", "disk_full"])
def test_a_trace_that_cannot_be_written_leaves_the_run_going(data_dir, train_model_dir, tmp_path, monkeypatch,
                                                             caplog, failure):
    """The first trace's write fails (iteration_2 taken by a file, or the export failing with
    ENOSPC): an error names the trace and the cause, and the run goes on. Before, the exception
    cut torch's transition short and stopping the profiler at the run's end crashed the process
    (SIGSEGV) before the ledger's `end`. All 6 steps train, traces 4 and 6 are written and
    charged, the failed one is not, and the ledger ends with a finished `end`."""
    run_dir = tmp_path / "run"
    if failure == "folder_is_a_file":
        (run_dir / "profile_traces").mkdir(parents=True)
        (run_dir / "profile_traces" / "iteration_2").write_text("")
        cause = "File exists"
    else:
        _failing_export(monkeypatch, _disk_full)
        cause = "No space left on device"
    with caplog.at_level(logging.ERROR, logger="slipstream.train.profiling"):
        Trainer(small_config(data_dir, train_model_dir, run_dir, "--training.steps=6", *EVERY_2_STEPS)).run()

    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    path = run_dir / "profile_traces" / "iteration_2" / "rank0_trace.json"
    assert any(str(path) in m and cause in m for m in caplog.messages), caplog.messages
    for n in (4, 6):
        trace = run_dir / "profile_traces" / f"iteration_{n}" / "rank0_trace.json"
        assert _profiler_steps(trace) == [f"ProfilerStep#{n}"]
    assert [r["step"] for r in read_metrics(run_dir, "profile")] == [4, 6]
    events = read_events(run_dir)
    assert [e["step"] for e in events if e["event"] == "profile"] == [4, 6]
    assert events[-1]["event"] == "end" and events[-1]["reason"] == "finished"


def _profile_steps(profiler: StepProfiler, steps: int) -> None:
    """Run `steps` steps of a tiny workload under `profiler`."""
    profiler.start(0)
    for done in range(steps):
        profiler.step(done)
        torch.ones(8, 8) @ torch.ones(8, 8)
    profiler.stop()


@pytest.mark.parametrize("raises", [True, False], ids=["export_raises", "export_fails_silently"])
def test_a_trace_file_only_ever_appears_complete(tmp_path, monkeypatch, caplog, raises):
    """An export that writes half a trace and then fails (raising, or only logging, as Kineto does
    when a write fails) leaves no rank0_trace.json and no .tmp: the trace is written under a
    temporary name and renamed into place only when whole. A killed run's leftover .tmp of a
    later trace is overwritten, and that trace is written whole."""
    half = b'{\n  "schemaVersion": 1,\n  "traceEvents": [\n  {"ph": "X", "name": "aten::mm"},\n  {'

    def half_written(path: str) -> None:
        Path(path).write_bytes(half)
        if raises:
            raise OSError(errno.EIO, "Input/output error", path)

    _failing_export(monkeypatch, half_written)
    config = ProfilingConfig(enable_profiling=True, profile_freq=2, profiler_warmup=1, profiler_active=1)
    profiler = StepProfiler(config, tmp_path, rank=0, device_type="cpu")
    leftover = tmp_path / "profile_traces" / "iteration_4" / "rank0_trace.json.tmp"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(half)
    with caplog.at_level(logging.ERROR, logger="slipstream.train.profiling"):
        _profile_steps(profiler, 4)

    assert _trace_files(tmp_path) == {"iteration_2": [], "iteration_4": ["rank0_trace.json"]}
    assert _profiler_steps(tmp_path / "profile_traces/iteration_4/rank0_trace.json") == ["ProfilerStep#4"]
    assert [m for m in caplog.messages if "iteration_2/rank0_trace.json not written" in m], caplog.messages


def test_steps_redone_after_a_rollback_keep_their_numbers(data_dir, train_model_dir, tmp_path):
    """A non-finite loss at traced step 4 rolls back to the checkpoint of step 2: the NaN step's
    trace goes to iteration_4, and the redone steps 3 and 4 run on the schedule of their numbers,
    so the redone step 4's trace replaces it there."""
    run_dir = tmp_path / "run"
    Trainer(small_config(data_dir, train_model_dir, run_dir, "--training.steps=6", "--checkpoint.interval=2",
                         "--faults.nan_at_step=4", *EVERY_2_STEPS)).run()
    assert [r["to_step"] for r in read_metrics(run_dir, "rollback")] == [2]
    assert [r["step"] for r in read_metrics(run_dir, "profile")] == [2, 4, 4, 6]
    assert _trace_files(run_dir) == {f"iteration_{n}": ["rank0_trace.json"] for n in (2, 4, 6)}
    assert _profiler_steps(run_dir / "profile_traces/iteration_4/rank0_trace.json") == ["ProfilerStep#4"]


@pytest.mark.parametrize(("flags", "message"), [
    (("--profiling.enable_profiling=true", "--profiling.profile_freq=2"),
     r"profiling.profile_freq \(2\) must be at least profiling.profiler_warmup \+ "
     r"profiling.profiler_active \(3 \+ 1 = 4\)"),
    (("--profiling.profiler_warmup=-1",), r"profiling.profiler_warmup must be an integer >= 0, got -1"),
    (("--profiling.profiler_active=0",), r"profiling.profiler_active must be a positive integer, got 0"),
    (("--profiling.profile_freq=0",), r"profiling.profile_freq must be a positive integer, got 0"),
    (("--profiling.save_traces_folder=",), r"profiling.save_traces_folder must be a folder path"),
    (("--profiling.enable_profiling=yes",), r"profiling.enable_profiling must be bool, got 'yes'"),
    (("--profiling.profile_frequency=5",), r"unknown config key profiling.profile_frequency; "
                                           r"did you mean profiling.profile_freq\?"),
])
def test_bad_settings_are_refused_naming_them(flags, message):
    """A schedule that does not fit in profile_freq steps, counts out of range, an empty folder,
    a value of the wrong type and an unknown key are ValueErrors naming key and value."""
    with pytest.raises(ValueError, match=message):
        load_config(None, ["--data.path=d", *flags])


def test_an_unused_schedule_is_not_checked():
    """As in torchtitan, warm-up + active steps beyond profile_freq only matter (and are only
    refused) with profiling enabled."""
    config = load_config(None, ["--profiling.profile_freq=2", "--profiling.profiler_warmup=3"])
    assert config.profiling.profile_freq == 2 and not config.profiling.enable_profiling


@pytest.mark.slow  # ~15 s of torchrun; the one-process tests above check what each rank writes
def test_two_ranks_write_a_trace_each(data_dir, train_model_dir, tmp_path):
    """`slipstream train --nproc 2` (torchrun, gloo) with profiling: each iteration folder holds
    rank0_trace.json and rank1_trace.json, each with the step's ProfilerStep#N and its gloo
    collectives, which `perf trace` reads as the job's ranks."""
    run_dir = tmp_path / "run"
    config = small_config(data_dir, train_model_dir, run_dir, "--training.steps=4",
                          "--training.micro_batch_size=2", *EVERY_2_STEPS)
    result = train_with_torchrun(config, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = ["rank0_trace.json", "rank1_trace.json"]
    assert _trace_files(run_dir) == {"iteration_2": expected, "iteration_4": expected}
    for name in expected:
        trace = run_dir / "profile_traces" / "iteration_4" / name
        assert _profiler_steps(trace) == ["ProfilerStep#4"]
        names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
        assert any(n.startswith("gloo:") for n in names), sorted(names)[:40]
    # `slipstream perf trace` reads the folder as the job's two ranks, each with its step.
    report = analyze([str(run_dir / "profile_traces" / "iteration_4")])
    assert [(r["rank"], [s["step"] for s in r["steps"]]) for r in report["ranks"]] == [(0, [4]), (1, [4])]
    assert report["spread"] is not None


def test_profile_memory_records_the_allocator_for_the_memory_timeline(data_dir, train_model_dir, tmp_path):
    """`profiling.profile_memory` puts the allocator's events in the trace, so `perf trace` reports
    the step's memory: its peak is the largest total the allocator reported, at least the fp32
    gradients, which the recorded step allocates and holds at once before the optimizer step."""
    config = small_config(data_dir, train_model_dir, tmp_path / "run", "--training.steps=2", *EVERY_2_STEPS,
                          "--profiling.profile_memory=true")
    trainer = Trainer(config)
    trainer.run()
    trace = tmp_path / "run" / "profile_traces" / "iteration_2" / "rank0_trace.json"
    totals = [e["args"]["Total Allocated"] for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("name") == "[memory]"]
    (rank,) = analyze([str(trace)], hardware="h100")["ranks"]
    (device,) = rank["memory"]
    gradients = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    print(f"peak {device['peak_allocated_bytes']} B, gradients {gradients} B")
    assert device["peak_allocated_bytes"] == max(totals) >= gradients
