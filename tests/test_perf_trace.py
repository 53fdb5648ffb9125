"""Profiler-trace analysis: real torch.profiler traces against the profiler's own key_averages,
GPU splits against closed forms on hand-built traces, and hostile files."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from slipstream.cli import main
from slipstream.perf.kineto import export_trace, read_trace
from slipstream.perf.trace import OpTime, analyze, host_op_times
from slipstream.perf.trace_report import format_report


def _profile(path, with_stack: bool) -> dict[str, tuple[int, float, float]]:
    """Profile 3 active training steps of a small MLP into `path`; the profiler's own
    key_averages() of the same window: {name: (calls, self us, inclusive us)}."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(16, 64)
    averages = {}

    def ready(prof):
        prof.export_chrome_trace(str(path))
        for e in prof.key_averages():
            averages[e.key] = (e.count, e.self_cpu_time_total, e.cpu_time_total)

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                 on_trace_ready=ready, with_stack=with_stack) as prof:
        for _ in range(5):
            with record_function("forward"):
                y = model(x)
            with record_function("backward"):
                y.sum().backward()
            prof.step()
    return averages


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A real CPU trace of 3 training steps and the profiler's key_averages() of it."""
    path = tmp_path_factory.mktemp("trace") / "rank0_trace.json"
    return path, _profile(path, with_stack=False)


def _our_op_times(path) -> dict[str, OpTime]:
    ops = {name: t for (cat, name), t in host_op_times(read_trace(path).events).items()}
    steps = [t for name, t in ops.items() if name.startswith("ProfilerStep#")]
    ops["ProfilerStep*"] = OpTime(calls=len(steps), self_us=sum(t.self_us for t in steps))  # its aggregate
    return ops


def test_host_self_times_match_key_averages(profiled):
    """Each op's and annotation's calls and self time are what torch.profiler's key_averages()
    reports (which merges an op's redispatch to itself, e.g. aten::sum calling aten::sum)."""
    path, averages = profiled
    ops = _our_op_times(path)
    for name, (calls, self_us, total_us) in averages.items():
        assert ops[name].calls == calls, name
        assert ops[name].self_us == pytest.approx(self_us, abs=0.05 + 1e-4 * total_us), name
    assert {"aten::mm", "aten::addmm", "forward", "backward", "ProfilerStep*"} <= set(averages)


def test_python_frames_as_key_averages_counts_them(tmp_path):
    """With Python frames (with_stack, the engine's default) in the tree, self times still match
    key_averages, Python rows included. Left out: the script's outer frames, open across the
    steps, which the steps' annotations cross (their self time is meaningless, negative in
    key_averages too), and the profiler's own frames, cut at the edges of the window."""
    path = tmp_path / "stack.json"
    averages = _profile(path, with_stack=True)
    ops = _our_op_times(path)
    # Longer than a step on average: open across steps. (Not the shortest step: on a loaded
    # machine one step's forward alone can outlast another whole step.)
    longest_step_us = max(t.total_us for name, t in ops.items() if name.startswith("ProfilerStep#"))
    compared = [name for name, (calls, _, total_us) in averages.items()
                if name != "ProfilerStep*" and total_us / calls < longest_step_us
                and not name.startswith(("torch/profiler/", "torch/autograd/profiler"))]
    for name in compared:
        calls, self_us, total_us = averages[name]
        assert ops[name].calls == calls, name
        assert ops[name].self_us == pytest.approx(self_us, abs=0.05 + 1e-4 * total_us), name
    assert sum(name.startswith("torch/nn/modules/") for name in compared) >= 2
    assert {"aten::mm", "forward", "backward"} <= set(compared)


def test_steps_and_annotations(profiled):
    """The three active steps are ProfilerStep#2..#4, with the durations the file gives them;
    annotations report the inclusive time key_averages agrees with."""
    path, averages = profiled
    (rank,) = analyze([str(path)])["ranks"]
    written = {e["name"]: e["dur"] for e in json.loads(path.read_text())["traceEvents"]
               if e.get("name", "").startswith("ProfilerStep#")}
    assert {f"ProfilerStep#{s['step']}": s["duration_us"] for s in rank["steps"]} == pytest.approx(written)
    assert list(written) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    annotations = {a["name"]: a for a in rank["annotations"]}
    assert set(annotations) == {"forward", "backward"}
    for name, a in annotations.items():
        assert a["calls"] == 3
        assert a["total_us"] == pytest.approx(averages[name][2], rel=1e-3)
    assert rank["gpu"] is None and rank["kernels"] == []


def test_runtime_calls_and_overrunning_spans_as_the_profiler_tree(tmp_path):
    """Runtime calls (cudaLaunchKernel, ...) are host events of their own, out of their op's self
    time, as key_averages lists them; a span that ends after the span it starts in (rounding) is
    not its child and closes it: G[0,100) > P[10,50), C[40,51) overruns P, S[50,80) is G's."""
    events = [_step(1, 0, 200), _op("aten::copy_", 100, 50),
              _launch(110, 1) | {"name": "cudaMemcpyAsync", "dur": 30},
              _op("G", 0, 100), _op("P", 10, 40), _op("C", 40, 11), _op("S", 50, 30)]
    ops = {name: t.self_us for (cat, name), t in host_op_times(read_trace(_write(tmp_path / "t.json",
                                                                                  events)).events).items()}
    assert (ops["aten::copy_"], ops["cudaMemcpyAsync"]) == (20, 30)
    assert (ops["G"], ops["P"], ops["C"], ops["S"]) == (100 - 40 - 11 - 30, 40, 11, 30)


def test_many_steps_are_summarized_in_the_text(profiled):
    """Past 2 x top steps the text gives their spread and the `top` slowest, in step order."""
    path, _ = profiled
    report = analyze([str(path)])
    slowest = max(report["ranks"][0]["steps"], key=lambda s: s["duration_us"])["step"]
    text = format_report(report, top=1)
    assert "the 1 slowest steps" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == [slowest]
    assert "the 3 slowest" not in format_report(report, top=3) and "median" in format_report(report, top=3)


def test_gzip_and_plain_read_alike(profiled, tmp_path):
    path, _ = profiled
    packed = tmp_path / "rank0_trace.json.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    plain, zipped = analyze([str(path)]), analyze([str(packed)])
    for report in (plain, zipped):
        report["ranks"][0].pop("file")
    assert plain == zipped


def _kernel(name, start, dur, stream, correlation, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": start, "dur": dur,
            "args": {"stream": stream, "correlation": correlation, "device": 0}}


def _launch(start, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 100,
            "ts": start, "dur": 1, "args": {"correlation": correlation}}


def _step(number, start, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}", "pid": 100, "tid": 100,
            "ts": start, "dur": dur}


def _write(path, events, rank=None, **metadata):
    document = {"schemaVersion": 1, **metadata, "traceEvents": events}
    if rank is not None:
        document["distributedInfo"] = {"rank": rank, "world_size": 2, "backend": "nccl"}
    path.write_text(json.dumps(document))
    return str(path)


def test_gpu_split_sums_to_the_span_by_closed_form(tmp_path):
    """Step 1: compute [0,10) and [20,30) on stream 7, an NCCL all-reduce [5,25) on stream 20, a
    copy [28,40): compute 20, exposed communication [10,20) = 10, exposed memory [30,40) = 10,
    idle 0, overlap (communication under compute) 10 / 20; the gap of 10 on stream 7 is a kernel
    wait (launched early, under 30 us). Step 2, stream 7: [100,110), [115,125) (a kernel wait of
    5), [160,170) launched at 150, after [115,125) ended (a host wait of 35), [210,220) launched
    early (another wait of 40)."""
    events = [
        _step(1, -10, 9), _step(2, 0, 200),
        _launch(-9, 1), _launch(-8, 2), _launch(-7, 3), _launch(-6, 4),
        _kernel("sm90_xmma_gemm", 0, 10, 7, 1),
        _kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 5, 20, 20, 2),
        _kernel("sm90_xmma_gemm", 20, 10, 7, 3),
        _kernel("Memcpy DtoH (Device -> Pinned)", 28, 12, 9, 4, cat="gpu_memcpy"),
        _launch(1, 5), _launch(2, 6), _launch(150, 7), _launch(3, 8),
        _kernel("elementwise_kernel", 100, 10, 7, 5), _kernel("elementwise_kernel", 115, 10, 7, 6),
        _kernel("elementwise_kernel", 160, 10, 7, 7), _kernel("elementwise_kernel", 210, 10, 7, 8),
    ]
    path = _write(tmp_path / "t.json", events, deviceProperties=[{"name": "NVIDIA H100"}])
    (rank,) = analyze([path])["ranks"]
    first, second = (s["gpu"] for s in rank["steps"])
    assert first == {"span_us": 40, "compute_us": 20, "exposed_communication_us": 10, "exposed_memory_us": 10,
                     "idle_us": 0, "communication_us": 20, "memory_us": 12, "overlap": 0.5,
                     "host_wait_us": 0, "kernel_wait_us": 10, "other_wait_us": 0}
    assert (second["span_us"], second["compute_us"], second["idle_us"]) == (120, 40, 80)
    assert second["overlap"] is None
    assert (second["host_wait_us"], second["kernel_wait_us"], second["other_wait_us"]) == (35, 5, 40)
    # Over all steps, one window from the first kernel to the last: the 60 us between the steps'
    # kernels (step 1's run after its host code ended, during step 2's) are idle too.
    whole = rank["gpu"]
    assert (whole["span_us"], whole["compute_us"], whole["idle_us"], whole["overlap"]) == (220, 60, 140, 0.5)
    assert (whole["host_wait_us"], whole["kernel_wait_us"], whole["other_wait_us"]) == (35, 15, 110)
    # HTA's launch statistics: each kernel's start less its 1 us launch call's end.
    delays = [0 - -8, 5 - -7, 20 - -6, 28 - -5, 100 - 2, 115 - 3, 160 - 151, 210 - 4]
    assert rank["launches"] == {"launches": 8, "shorter_than_launch": 0, "launch_call_us": 8,
                                "launch_delay_us": sum(delays), "median_launch_delay_us": (26 + 33) / 2,
                                "runtime_outliers": 0, "launch_delay_outliers": 2}
    kernels = {k["name"]: k for k in rank["kernels"]}
    assert kernels["sm90_xmma_gemm"]["class"] == "compute" and kernels["sm90_xmma_gemm"]["calls"] == 2
    assert kernels["ncclDevKernel_AllReduce_Sum_bf16_RING_LL"]["class"] == "communication"
    assert kernels["Memcpy DtoH (Device -> Pinned)"]["class"] == "memory"
    assert rank["devices"] == ["NVIDIA H100"]
    assert "overlap" in format_report(analyze([path]))


def test_epoch_timestamps_keep_their_nanoseconds(tmp_path):
    """Kineto writes epoch microseconds to the nanosecond (16 digits before the point, where a
    double's step is 0.25 us): a 0.1 us gap between two kernels must stay 0.1 us."""
    base = 1712195495527379
    text = json.dumps({"traceEvents": [
        _step(1, "STEP", 10), _launch("L1", 1), _launch("L2", 2),
        _kernel("gemm", "K1", 0.1, 7, 1), _kernel("gemm", "K2", 0.2, 7, 2)]})
    fractions = {"STEP": ".000", "L1": ".001", "L2": ".002", "K1": ".266", "K2": ".466"}
    for marker, fraction in fractions.items():
        text = text.replace(f'"{marker}"', f"{base}{fraction}")
    (tmp_path / "t.json").write_text(text)
    (rank,) = analyze([str(tmp_path / "t.json")])["ranks"]
    assert rank["gpu"]["idle_us"] == pytest.approx(0.1, abs=1e-9)
    assert rank["gpu"]["span_us"] == pytest.approx(0.4, abs=1e-9)
    assert rank["gpu"]["kernel_wait_us"] == pytest.approx(0.1, abs=1e-9)


def test_spans_that_end_together_in_the_file_nest(tmp_path):
    """Three frames open when the profiler stopped end at one instant, 5660894918947.290; start +
    duration in doubles puts the middle one's end a step early, which would make the inner frame
    the outer one's child (self times of -37.8 and +37.8 ms). Ends are computed exactly."""
    frames = [("outer", "5660894881155.189", "37792.101"), ("middle", "5660894881156.018", "37791.272"),
              ("inner", "5660894881157.924", "37789.366")]
    events = ", ".join(f'{{"ph": "X", "cat": "python_function", "name": "{name}", "pid": 1, "tid": 0, '
                       f'"ts": {ts}, "dur": {dur}}}' for name, ts, dur in frames)
    (tmp_path / "t.json").write_text(f'{{"traceEvents": [{events}]}}')
    events = read_trace(tmp_path / "t.json").events
    ops = {name: t.self_us for (cat, name), t in host_op_times(events).items()}
    assert ops == pytest.approx({"outer": 0.829, "middle": 1.906, "inner": 37789.366}, abs=1e-6)


def test_kernels_launched_between_steps_count_to_the_whole_run(tmp_path):
    """Steps [0,10) and [20,30) with a gap (the engine's marks cover its steps only): a kernel
    launched at 15 is no step's, but the whole run's (HTA's whole-trace window)."""
    events = [_step(1, 0, 10), _step(2, 20, 10), _launch(1, 1), _launch(15, 2), _launch(21, 3),
              _kernel("gemm", 2, 4, 7, 1), _kernel("gemm", 16, 4, 7, 2), _kernel("gemm", 22, 4, 7, 3)]
    (rank,) = analyze([_write(tmp_path / "t.json", events)])["ranks"]
    assert [s["gpu"]["compute_us"] for s in rank["steps"]] == [4, 4]
    assert (rank["gpu"]["compute_us"], rank["gpu"]["span_us"], rank["launches"]["launches"]) == (12, 24, 3)


def test_launch_statistics_count_what_hta_counts(tmp_path):
    """A 60 us cudaMemcpyAsync whose 5 us copy starts 2 us after it: shorter than its launch call,
    a runtime outlier (over 50 us), no delay outlier; a graph launch is not one of HTA's calls."""
    events = [_step(1, 0, 200), _launch(10, 1) | {"name": "cudaMemcpyAsync", "dur": 60},
              _kernel("Memcpy HtoD (Pageable -> Device)", 72, 5, 7, 1, cat="gpu_memcpy"),
              _launch(100, 2) | {"name": "cudaGraphLaunch"}, _kernel("gemm", 120, 5, 7, 2)]
    report = analyze([_write(tmp_path / "t.json", events)])
    assert report["ranks"][0]["launches"] == {"launches": 1, "shorter_than_launch": 1, "launch_call_us": 60,
                                "launch_delay_us": 2, "median_launch_delay_us": 2,
                                "runtime_outliers": 1, "launch_delay_outliers": 0}
    assert "1 (100.0%) ran shorter than their launch call" in format_report(report)


def test_ranks_are_ordered_and_the_straggler_named(tmp_path):
    _write(tmp_path / "b.json", [_step(1, 0, 30), _step(2, 30, 30)], rank=1)
    _write(tmp_path / "a.json", [_step(1, 0, 10), _step(2, 10, 12)], rank=0)
    report = analyze([str(tmp_path)])
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert report["spread"]["slowest"] == "rank 1" and report["spread"]["ratio"] == pytest.approx(30 / 11)
    sessions = tmp_path / "sessions"  # an engine's trace folder: several sessions, no ranks
    sessions.mkdir()
    _write(sessions / "a.json", [_step(1, 0, 10)])
    _write(sessions / "b.json", [_step(1, 0, 30)])
    assert analyze([str(sessions)])["spread"] is None


def _op(name, start, dur):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 100, "tid": 100, "ts": start, "dur": dur}


def test_comparison_per_step(tmp_path):
    """Per step: aten::mm went from 20 us (two calls in the baseline's one step) to 5 (one call
    in each of two steps), aten::gelu is new, aten::relu gone, the step twice as fast."""
    baseline = _write(tmp_path / "old.json", [_step(1, 0, 40), _op("aten::mm", 1, 10),
                                               _op("aten::mm", 12, 10), _op("aten::relu", 30, 4)])
    new = _write(tmp_path / "new.json", [_step(1, 0, 20), _op("aten::mm", 1, 5), _op("aten::gelu", 7, 3),
                                          _step(2, 20, 20), _op("aten::mm", 21, 5), _op("aten::gelu", 27, 3)])
    report = analyze([new], baseline=[baseline])
    c = report["comparison"]
    assert c["baseline"] == [baseline]
    assert c["step_time_us"] == {"baseline": 40, "new": 20, "ratio": 0.5} and c["per"] == "step"
    rows = {r["name"]: r for r in c["host"]}
    assert rows["aten::mm"] == {"name": "aten::mm", "change": "faster", "baseline_us": 20, "new_us": 5,
                                "delta_us": -15, "baseline_calls": 2, "new_calls": 1}
    assert rows["aten::gelu"]["change"] == "added" and rows["aten::gelu"]["new_us"] == 3
    assert rows["aten::relu"]["change"] == "gone" and rows["aten::relu"]["delta_us"] == -4
    between = rows["(between ops, in profiler steps)"]
    assert (between["baseline_us"], between["new_us"]) == (40 - 24, 20 - 8)
    assert c["host"][0]["name"] == "aten::mm"  # the largest change first
    assert "against" in format_report(report)
    unstepped = _write(tmp_path / "unstepped.json", [_op("aten::mm", 1, 5)])
    with pytest.raises(ValueError, match="unstepped.json has no ProfilerStep"):
        analyze([unstepped], baseline=[baseline])
    whole = analyze([unstepped], baseline=[_write(tmp_path / "old_unstepped.json", [_op("aten::mm", 1, 9)])])
    assert whole["comparison"]["per"] == "trace" and whole["comparison"]["host"][0]["delta_us"] == -4


def test_a_trace_larger_than_the_read_window(tmp_path):
    """The streaming reader gives what json.load gives across its 1 MiB reading window, with
    times written as strings and events without a time counted, not dropped silently."""
    events = [_step(1, 0, 10**6)]
    for i in range(20_000):
        events.append({"ph": "X", "cat": "cpu_op", "name": f"aten::op_{i % 7}_" + "x" * (i % 300),
                       "pid": 1, "tid": 1, "ts": str(10 * i + 0.125), "dur": 5, "args": {"n": [i] * 3}})
    events.append({"ph": "X", "cat": "cpu_op", "name": "no time", "pid": 1, "tid": 1})
    events.append({"ph": "i", "name": "instant", "ts": 3})
    path = tmp_path / "big.json"
    _write(path, events)
    assert path.stat().st_size > 3 * 2**20
    trace = read_trace(path)
    assert trace.skipped_events == 1
    assert len(trace.events) == 20_001
    assert [e.name for e in trace.events] == [e["name"] for e in events[:20_001]]
    assert trace.events[-1].start_us == 10 * 19_999 + 0.125


@pytest.mark.parametrize("content, message", [
    (b"", "the end of the file"),
    (b"[1, 2]", "expected '{'"),
    (b'{"schemaVersion": 1}', "no traceEvents"),
    (b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 2}', "the end of the file"),
    (b'{"traceEvents": []} trailing', "text after the end"),
    (b'{"traceEvents": [] "x": 1}', "expected '}'"),
    (b'{"traceEvents": [{"ph": "X", "na', "ends inside a value.*Unterminated string starting at char.* 29"),
    (gzip.compress(b'{"traceEvents": [{"ph": "X", "ts": 1}]}', mtime=0)[:-9], "cannot be read"),
    (b"\xff\xfe{", "cannot be read"),
    (b'{"traceEvents": [{"ph": "X", "ts": 1, "args": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}",
     "nested too deeply"),
    (b'{"traceEvents": [{"ph": "X", "ts": ' + b"9" * 5000 + b"}]}", "cannot be read"),
    (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + b"\xff" * 64, "cannot be read"),  # corrupt deflate
    (b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 2}, {"ph": "X", "ts": 1 "dur": 2}]}',
     "Expecting ',' delimiter at character 69"),  # the 70th character, the quote of "dur"
])
def test_a_file_that_is_no_trace_is_named(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
        read_trace(path)
    assert str(path) in str(error.value)


def test_a_syntax_error_is_placed_in_the_file_and_read_no_further(tmp_path):
    """An error past the first reading window is reported at its character in the file, and
    one early in a large file is reported without reading on (the text after it is not JSON
    the decoder could wait for)."""
    event = json.dumps(_op("aten::mm", 1, 2)) + ", "
    head = '{"traceEvents": [' + event * (3 * 2**20 // len(event))
    path = tmp_path / "late.json"
    bad = '{"ph": "X" "ts": 1}'  # no comma before "ts"
    path.write_text(head + bad + "]}")
    at = len(head) + bad.index('"ts')
    with pytest.raises(ValueError, match=f"at character {at:,}$"):
        read_trace(path)
    early = tmp_path / "early.json"
    start = '{"traceEvents": [' + bad + ", "
    early.write_text(start + event * (3 * 2**20 // len(event)) + "]}")
    at = start.index('"ts')
    with pytest.raises(ValueError, match=f"at character {at:,}$"):
        read_trace(early)


def test_odd_values_are_skipped_or_read_as_json_load_reads_them(tmp_path):
    """Events with no usable time or thread are counted, never crash the reader: a timestamp
    of 1e999999999 (valid JSON), 10^30, a list as pid; a name with a lone surrogate prints; a
    byte-order mark is read; a second traceEvents list replaces the first, as in json.load; a
    number split across the reading window is read whole."""
    events = [_op("ok", 1, 2), _op("huge", 1, 2) | {"ts": "HUGE"}, _op("far", 1, 2) | {"ts": 10**30},
              _op("listed", 1, 2) | {"pid": [1]}, _op("\ud800", 3, 1)]
    text = json.dumps({"traceEvents": [_op("replaced", 1, 2)], "x": 0}).rstrip("}") + ", "
    text += json.dumps({"traceEvents": events})[1:].replace('"HUGE"', "1e999999999")
    path = tmp_path / "odd.json"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    trace = read_trace(path)
    assert [e.name for e in trace.events] == ["ok", "\ufffd" if False else "?"]
    assert trace.skipped_events == 3
    pad = 2**20 - len('{"pad": "') - len('", "v": 1')
    split = tmp_path / "split.json"
    split.write_text('{"pad": "' + "p" * pad + '", "v": 1.5, "traceEvents": []}')
    assert read_trace(split).metadata["v"] == "1.5"


class _Exporter:
    """A stand-in for torch.profiler.profile's export: writes `text` to the path it is given."""

    def __init__(self, text: str):
        self.text = text

    def export_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.text)


@pytest.mark.parametrize("name", ["rank0_trace.json", "w.1.pt.trace.json.gz"])
def test_a_trace_is_exported_whole_or_not_at_all(profiled, tmp_path, name):
    """A whole export is renamed into place (gzipped for .gz) and reads as the original; one cut
    short (a full disk: Kineto does not raise) is an OSError that leaves no file behind."""
    path, _ = profiled
    export_trace(_Exporter(path.read_text()), tmp_path / name)
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert len(read_trace(tmp_path / name).events) == len(read_trace(path).events)
    (tmp_path / name).unlink()
    with pytest.raises(OSError, match="no complete trace"):
        export_trace(_Exporter(path.read_text()[:5000]), tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_cli(profiled, tmp_path, capsys):
    path, _ = profiled
    assert main(["perf", "trace", str(path), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "3 profiler steps" in text and "host time by op" in text and "backward" in text
    assert main(["perf", "trace", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["steps"][0]["step"] == 2
    assert main(["perf", "trace", str(tmp_path / "missing.json")]) == 2
    assert "no such trace file" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["perf", "trace", str(tmp_path / "empty")]) == 2
    assert "no trace files" in capsys.readouterr().err
