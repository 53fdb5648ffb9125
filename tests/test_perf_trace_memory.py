"""`perf trace`'s memory timeline: a real profile of allocations of known sizes in known steps
against the closed form, each op's own allocations against the profiler's key_averages(), and
hand-built traces for what happened before the trace and for odd events."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from slipstream.cli import main
from slipstream.perf.trace import analyze
from slipstream.perf.trace_memory import BETWEEN_OPS, OUTSIDE_OPS
from slipstream.perf.trace_report import format_report

MIB = 2**20
LEAK_MIB, SCRATCH_MIB = 1, 4


def _profile_steps(path) -> dict[str, int]:
    """5 steps (1 wait, 1 warm-up, 3 recorded), each keeping a 1 MiB tensor (a leak) and
    allocating a 4 MiB scratch tensor inside `record_function("scratch")` that it frees there, then
    a small linear layer's forward and backward; the profiler's key_averages() of the recorded
    steps: {name: self CPU memory usage}."""
    kept = []
    model = torch.nn.Linear(64, 32)
    x = torch.randn(16, 64)
    averages = {}

    def ready(prof):
        prof.export_chrome_trace(str(path))
        averages.update({e.key: e.self_cpu_memory_usage for e in prof.key_averages()})

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, on_trace_ready=ready,
                 schedule=schedule(wait=1, warmup=1, active=3, repeat=1)) as prof:
        for _ in range(5):
            kept.append(torch.empty(LEAK_MIB * MIB, dtype=torch.uint8))
            with record_function("scratch"):
                scratch = torch.empty(SCRATCH_MIB * MIB, dtype=torch.uint8)
                del scratch
            model(x).sum().backward()
            prof.step()
    return averages


@pytest.fixture(scope="module")
def leaky(tmp_path_factory):
    path = tmp_path_factory.mktemp("memory") / "leak.json"
    averages = _profile_steps(path)
    return path, averages, analyze([str(path)], top=1000)["ranks"][0]


def test_steps_peak_and_growth_match_the_closed_form(leaky):
    """Each recorded step starts at the level of the one before, keeps 1 MiB more and peaks at its
    4 MiB scratch tensor (the layer's few KiB come after it is freed, and are freed in the step):
    start S + k MiB, peak S + (k + 1 + 4) MiB, growth 1 MiB in every step, S the total at the
    first event (0 on the CPU: its allocator counts only what was allocated while profiling)."""
    _, _, rank = leaky
    (memory,) = rank["memory"]
    assert memory["device"] == "cpu" and memory["totals"] == "allocator"
    steps = memory["steps"]
    assert [s["step"] for s in steps] == [2, 3, 4]
    start = memory["allocated_at_start_bytes"]
    assert start == 0
    assert [(s["start_bytes"], s["peak_bytes"], s["growth_bytes"]) for s in steps] == [
        (start + k * LEAK_MIB * MIB, start + (k + 1) * LEAK_MIB * MIB + SCRATCH_MIB * MIB, LEAK_MIB * MIB)
        for k in range(3)]
    assert memory["grows_every_step"]
    assert memory["peak_step"] == 4 and memory["peak_annotation"] == "scratch"
    assert memory["peak_op"] == "aten::empty"
    assert memory["peak_allocated_bytes"] == steps[-1]["peak_bytes"]


def test_self_allocations_match_key_averages(leaky):
    """Each op's net bytes allocated in its own time are key_averages' self_cpu_memory_usage of
    the same profile (its ProfilerStep* row is the steps' own, its [memory] row the events in no
    op)."""
    _, averages, rank = leaky
    ours = {row["name"]: row["self_net_bytes"] for row in rank["memory"][0]["ops"]}
    ours["ProfilerStep*"] = ours.pop(BETWEEN_OPS, 0)
    ours["[memory]"] = ours.pop(OUTSIDE_OPS, 0)
    compared = {name: usage for name, usage in averages.items() if usage or ours.get(name)}
    assert {"aten::empty", "aten::addmm", "aten::mm", "scratch", "ProfilerStep*"} <= set(compared)
    for name, usage in compared.items():
        assert ours.get(name, 0) == usage, name


def _memory(ts, nbytes, total=None, addr=None, device_type=1, reserved=None, tid=100):
    args = {"Bytes": nbytes, "Device Type": device_type, "Device Id": 0}
    if total is not None:
        args["Total Allocated"] = total
    if reserved is not None:
        args["Total Reserved"] = reserved
    if addr is not None:
        args["Addr"] = addr
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 100, "tid": tid,
            "ts": ts, "args": args}


def _span(name, start, dur, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": 100, "ts": start, "dur": dur}


def _write(path, events):
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return str(path)


def test_what_came_before_the_trace_is_reported(tmp_path):
    """A CUDA trace that begins with 10 MiB allocated: a free at t=1 of a 2 MiB block the trace
    never saw allocated (before the first step), then in step 1 (t=10 to 23) +4 MiB at an address
    it frees at t=30 in step 2 and +1 MiB never freed. Closed form: at the start 10 MiB, peak
    10 - 2 + 4 + 1 = 13 MiB at t=21 inside aten::empty in annotation fwd, step 1 from 8 to 13
    (growth 5), step 2 from 13 to 9 (growth -4): no leak."""
    mib = MIB
    events = [
        _span("ProfilerStep#1", 10, 13, "user_annotation"),
        _span("ProfilerStep#2", 25, 10, "user_annotation"),
        _span("fwd", 15, 4, "user_annotation"), _span("aten::empty", 16, 1),
        _span("fwd", 20.5, 2, "user_annotation"), _span("aten::empty", 20.8, 1),
        _memory(1, -2 * mib, 8 * mib, addr=7, reserved=20 * mib),
        _memory(16.5, 4 * mib, 12 * mib, addr=8, reserved=20 * mib),
        _memory(21, 1 * mib, 13 * mib, addr=9, reserved=22 * mib),
        _memory(30, -4 * mib, 9 * mib, addr=8, reserved=22 * mib),
    ]
    (memory,) = analyze([_write(tmp_path / "t.json", events)])["ranks"][0]["memory"]
    assert memory["device"] == "cuda:0"
    assert memory["allocated_at_start_bytes"] == 10 * mib
    peak = (memory["peak_allocated_bytes"], memory["peak_step"], memory["peak_us_into_step"])
    assert peak == (13 * mib, 1, 11)
    assert (memory["peak_op"], memory["peak_annotation"]) == ("aten::empty", "fwd")
    assert memory["peak_reserved_bytes"] == 22 * mib
    assert (memory["frees_of_earlier_blocks"], memory["freed_earlier_bytes"]) == (1, 2 * mib)
    assert (memory["unfreed_blocks"], memory["unfreed_bytes"]) == (1, mib)
    assert memory["before_first_step"] == {"events": 1, "net_bytes": -2 * mib}
    steps = [(s["start_bytes"], s["peak_bytes"], s["end_bytes"], s["growth_bytes"]) for s in memory["steps"]]
    assert steps == [(8 * mib, 13 * mib, 13 * mib, 5 * mib), (13 * mib, 13 * mib, 9 * mib, -4 * mib)]
    assert not memory["grows_every_step"]
    rows = {r["name"]: r for r in memory["ops"]}
    assert rows["aten::empty"]["allocated_bytes"] == 5 * mib
    assert rows[BETWEEN_OPS]["self_net_bytes"] == -4 * mib and rows[OUTSIDE_OPS]["freed_bytes"] == 2 * mib
    text = format_report(analyze([str(tmp_path / "t.json")]))
    assert "memory on cuda:0" in text and "1 frees of blocks allocated before the trace (2.000 MiB)" in text


def test_totals_are_summed_where_the_trace_gives_none(tmp_path):
    """Events without "Total Allocated" are summed from 0, and the report says so: +3, -1, +2 MiB
    peak at 4 MiB; a device with one event is reported apart (cpu)."""
    events = [_memory(1, 3 * MIB), _memory(2, -MIB), _memory(3, 2 * MIB), _memory(4, 5, 5, device_type=0)]
    cuda, cpu = sorted(analyze([_write(tmp_path / "t.json", events)])["ranks"][0]["memory"],
                       key=lambda m: m["device"] != "cuda:0")
    assert cuda["totals"] == "summed" and cuda["peak_allocated_bytes"] == 4 * MIB
    assert cuda["peak_step"] is None and cuda["before_first_step"] is None
    assert cpu["device"] == "cpu" and cpu["peak_allocated_bytes"] == 5


def test_odd_memory_events_are_counted_and_a_trace_without_any_has_no_section(tmp_path, capsys):
    """Memory events without a number of bytes, a time or a thread are skipped and counted; odd
    totals and addresses are read as absent; a trace with no memory events shows no memory."""
    events = [_span("aten::mm", 0, 5), _memory(1, "12", 5), _memory(None, 4, 4), _memory(2, 8, tid=None),
              _memory(3, True), _memory(4, 16, total=-3, addr="x", device_type="cuda")]
    rank = analyze([_write(tmp_path / "odd.json", events)])["ranks"][0]
    assert rank["skipped_memory_events"] == 4
    (memory,) = rank["memory"]
    assert (memory["device"], memory["totals"], memory["peak_allocated_bytes"]) == ("unknown", "summed", 16)
    assert "4 memory events without a usable time" in format_report(analyze([str(tmp_path / "odd.json")]))
    plain = _write(tmp_path / "plain.json", [_span("aten::mm", 0, 5)])
    assert analyze([plain])["ranks"][0]["memory"] == []
    assert main(["perf", "trace", plain]) == 0
    assert "memory on" not in capsys.readouterr().out
