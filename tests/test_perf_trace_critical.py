"""`slipstream perf trace --critical-path` (perf/trace_critical.py): the longest chain of
dependencies through a profiler step, against hand-built traces whose critical path is known by
construction, a brute-force longest path, and a real torch.profiler trace."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from slipstream.cli import main
from slipstream.perf.kineto import read_trace
from slipstream.perf.trace import analyze
from slipstream.perf.trace_critical import critical_path, longest_path

HOST = (1, 1)  # pid, tid of the step's thread
GPU = 0  # the device's pid; kernels' tid is their stream


def _span(name: str, start: float, dur: float, cat: str = "cpu_op", where: tuple = HOST, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": dur, "pid": where[0], "tid": where[1],
            "args": args}


def _step(number: int, start: float, dur: float) -> dict:
    return _span(f"ProfilerStep#{number}", start, dur, "user_annotation")


def _launch(correlation: int, start: float, dur: float, name: str = "cudaLaunchKernel") -> dict:
    return _span(name, start, dur, "cuda_runtime", correlation=correlation)


def _kernel(name: str, correlation: int, stream: int, start: float, dur: float, cat: str = "kernel") -> dict:
    return _span(name, start, dur, cat, (GPU, stream), correlation=correlation)


def _write(tmp_path, events: list[dict], name: str = "trace.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def _on_path(cp) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for s in cp.segments:
        out[(s.kind, s.name)] = out.get((s.kind, s.name), 0.0) + s.duration_us
    return out


def test_cpu_nesting_and_sequence(tmp_path):
    """On one thread the path is every op's self time: the step's between ops, a parent's around
    its child, and another thread's op only where the step's thread was in no op of its own."""
    events = [
        _step(1, 0, 100),
        _span("A", 10, 30), _span("B", 15, 10),  # B nested in A
        _span("C", 50, 40),
        _span("loader", 42, 6, where=(1, 2)),  # between A and C: the step's thread waited for it
        _span("writer", 60, 20, where=(1, 3)),  # alongside C: not on the path
    ]
    cp = critical_path(read_trace(_write(tmp_path, events)))
    assert cp.step == 1 and cp.step_us == 100 and cp.length_us == pytest.approx(100)
    assert _on_path(cp) == pytest.approx({("host", "ProfilerStep#1"): 10 + 2 + 2 + 10, ("host", "A"): 20,
                                          ("host", "B"): 10, ("host", "loader"): 6, ("host", "C"): 40})
    assert [s.name for s in cp.segments] == ["ProfilerStep#1", "A", "B", "A", "ProfilerStep#1", "loader",
                                             "ProfilerStep#1", "C", "ProfilerStep#1"]
    assert cp.breakdown_us == pytest.approx({"host": 100, "kernel": 0, "launch_delay": 0, "sync_wait": 0,
                                             "idle": 0})


def _gpu_step(extra: list[dict]) -> list[dict]:
    return [_step(1, 0, 1000), *extra]


def test_long_kernel_decides(tmp_path):
    """A synchronize waits for a long kernel: the path runs launch -> kernel -> the sync's end,
    not through the host's wait, nor through a shorter kernel on another stream."""
    events = _gpu_step([
        _launch(1, 10, 10), _kernel("long", 1, 7, 25, 775),
        _launch(2, 22, 4), _kernel("short", 2, 8, 30, 50),
        _span("cudaDeviceSynchronize", 30, 775, "cuda_runtime", correlation=3),
    ])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    assert cp.length_us == pytest.approx(1000)
    path = _on_path(cp)
    assert path[("kernel", "long")] == pytest.approx(775)
    assert path[("launch_delay", "long")] == pytest.approx(5)
    assert path[("sync_wait", "cudaDeviceSynchronize")] == pytest.approx(5)
    assert ("kernel", "short") not in path and ("host", "cudaDeviceSynchronize") not in path
    assert path[("host", "cudaLaunchKernel")] == pytest.approx(10)  # the first launch call's time
    assert cp.breakdown_us["host"] == pytest.approx(10 + 10 + 195)


def test_launch_delay_decides(tmp_path):
    """A kernel that starts long after its launch call returned, on an idle stream: the delay is
    on the path, as a launch delay."""
    events = _gpu_step([
        _launch(1, 10, 10), _kernel("k", 1, 7, 300, 50),
        _span("cudaStreamSynchronize", 25, 330, "cuda_runtime", correlation=2),
        _span("Stream Sync", 349, 6, "cuda_sync", (GPU, 7), correlation=2),
    ])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    assert cp.length_us == pytest.approx(1000)
    assert cp.breakdown_us["launch_delay"] == pytest.approx(280)
    assert cp.breakdown_us["kernel"] == pytest.approx(50)
    assert cp.breakdown_us["sync_wait"] == pytest.approx(5)


def test_stream_sync_waits_on_its_own_stream(tmp_path):
    """cudaStreamSynchronize on stream 8 ("Stream Sync" says which) waits for stream 8's kernel,
    though stream 7's runs longer and ends later inside the call; the step's host work after the
    sync is on the path."""
    events = _gpu_step([
        _launch(1, 10, 5), _kernel("other stream", 1, 7, 20, 103),
        _launch(2, 16, 4), _kernel("synced", 2, 8, 22, 100),
        _span("cudaStreamSynchronize", 21, 104, "cuda_runtime", correlation=3),
        _span("Stream Sync", 120, 5, "cuda_sync", (GPU, 8), correlation=3),
        _span("aten::add", 200, 300),
    ])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    path = _on_path(cp)
    assert cp.length_us == pytest.approx(1000)
    assert path[("kernel", "synced")] == pytest.approx(100)
    assert ("kernel", "other stream") not in path
    assert path[("sync_wait", "cudaStreamSynchronize")] == pytest.approx(3)
    assert path[("host", "aten::add")] == pytest.approx(300)


def test_kernels_in_order_on_a_stream(tmp_path):
    """Kernels launched ahead of a busy stream: each starts when the one before it ends (the gap
    is idle, not a launch delay), so the path runs along the stream."""
    events = _gpu_step([
        _launch(1, 10, 5), _kernel("first", 1, 7, 20, 100),
        _launch(2, 16, 4), _kernel("second", 2, 7, 125, 200),
        _span("cudaDeviceSynchronize", 30, 300, "cuda_runtime", correlation=3),
    ])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    assert cp.length_us == pytest.approx(1000)
    assert cp.breakdown_us["kernel"] == pytest.approx(300)
    assert cp.breakdown_us["idle"] == pytest.approx(5)
    assert cp.breakdown_us["launch_delay"] == pytest.approx(5)  # the first kernel's


def _event_wait_trace(with_wait: bool) -> list[dict]:
    """Stream 7 runs A; stream 8's B waits (cudaStreamWaitEvent) on the event recorded after A,
    then the host synchronizes on B's stream."""
    wait = [_span("cudaStreamWaitEvent", 30, 4, "cuda_runtime", correlation=3),
            _span("Stream Wait Event", 32, 1, "cuda_sync", (GPU, 8), correlation=3, wait_on_stream=7,
                  wait_on_cuda_event_record_corr_id=2)] if with_wait else []
    return _gpu_step([
        _launch(1, 10, 10), _kernel("A", 1, 7, 25, 475),
        _span("cudaEventRecord", 22, 4, "cuda_runtime", correlation=2),
        *wait,
        _launch(4, 40, 10), _kernel("B", 4, 8, 505, 95),
        _span("cudaStreamSynchronize", 60, 550, "cuda_runtime", correlation=5),
        _span("Stream Sync", 600, 5, "cuda_sync", (GPU, 8), correlation=5),
    ])


def test_cross_stream_event_wait(tmp_path):
    """With the event wait, B started when A ended: A and the wait are on the path and B had no
    launch delay; without it, the trace explains B's start only by its launch (a 455 us delay)."""
    cp = critical_path(read_trace(_write(tmp_path, _event_wait_trace(True))))
    path = _on_path(cp)
    assert cp.length_us == pytest.approx(1000)
    assert path[("kernel", "A")] == pytest.approx(475) and path[("kernel", "B")] == pytest.approx(95)
    assert path[("sync_wait", "B")] == pytest.approx(5)  # A's end to B's start
    assert cp.breakdown_us["launch_delay"] == pytest.approx(5)  # A's only
    unlinked = critical_path(read_trace(_write(tmp_path, _event_wait_trace(False), "unlinked.json")))
    assert ("kernel", "A") not in _on_path(unlinked)
    assert unlinked.breakdown_us["launch_delay"] == pytest.approx(455)


def test_event_synchronize(tmp_path):
    """cudaEventSynchronize waits for the kernel launched last before its cudaEventRecord on the
    event's stream ("Event Sync" names both), not for a later one on that stream that happened
    to end before the call returned."""
    events = _gpu_step([
        _launch(1, 10, 5), _kernel("recorded", 1, 7, 20, 300),
        _span("cudaEventRecord", 16, 2, "cuda_runtime", correlation=2),
        _launch(3, 19, 2), _kernel("after the record", 3, 7, 321, 2),
        _span("cudaEventSynchronize", 22, 302, "cuda_runtime", correlation=4),
        _span("Event Sync", 23, 300, "cuda_sync", (GPU, -1), correlation=4, wait_on_stream=7,
              wait_on_cuda_event_record_corr_id=2),
    ])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    path = _on_path(cp)
    assert cp.length_us == pytest.approx(1000)
    assert path[("kernel", "recorded")] == pytest.approx(300)
    assert ("kernel", "after the record") not in path
    assert path[("sync_wait", "cudaEventSynchronize")] == pytest.approx(4)


def test_blocking_copy_waits_for_its_copy(tmp_path):
    """A cudaMemcpy returns when its copy has ended: the copy, queued behind a kernel on its
    stream, is on the path."""
    events = _gpu_step([
        _launch(1, 10, 5), _kernel("gemm", 1, 7, 20, 400),
        _launch(2, 16, 430, "cudaMemcpyAsync"), _kernel("Memcpy DtoH", 2, 7, 421, 20, "gpu_memcpy"),
    ])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    path = _on_path(cp)
    assert cp.length_us == pytest.approx(1000)
    assert path[("kernel", "gemm")] == pytest.approx(400)
    assert path[("kernel", "Memcpy DtoH")] == pytest.approx(20)
    assert path[("sync_wait", "cudaMemcpyAsync")] == pytest.approx(5)
    assert ("host", "cudaMemcpyAsync") not in path


def _brute_force(num_nodes: int, edges: list[tuple[int, int, float]], source: int, sink: int) -> float:
    """The heaviest path by trying every sequence of distinct nodes from source to sink."""
    weight = {}
    for u, v, w in edges:
        weight[(u, v)] = max(weight.get((u, v), float("-inf")), w)
    best = float("-inf")
    inner = [n for n in range(num_nodes) if n not in (source, sink)]
    for size in range(len(inner) + 1):
        for middle in itertools.permutations(inner, size):
            nodes = (source, *middle, sink)
            if all(pair in weight for pair in itertools.pairwise(nodes)):
                best = max(best, sum(weight[pair] for pair in itertools.pairwise(nodes)))
    return best


def test_longest_path_against_brute_force():
    """On random DAGs (parallel edges included) the longest path's weight is the brute force's,
    and the edges it returns form a source-to-sink path of that weight."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 7)
        order = rng.sample(range(n), n)  # a hidden topological order
        edges = [(order[i], order[j], float(rng.randint(0, 9)))
                 for i in range(n) for j in range(i + 1, n) for _ in range(rng.choice((0, 0, 1, 2)))]
        edges.append((order[0], order[-1], 0.0))  # the sink is reachable
        tails, heads, weights = (list(column) for column in zip(*edges, strict=True))
        length, path = longest_path(n, tails, heads, weights, order[0], order[-1])
        assert length == _brute_force(n, edges, order[0], order[-1])
        assert edges[path[0]][0] == order[0] and edges[path[-1]][1] == order[-1]
        assert all(edges[a][1] == edges[b][0] for a, b in itertools.pairwise(path))
        assert sum(edges[i][2] for i in path) == length


def test_longest_path_rejects_cycles_and_unreachable_sinks():
    """A cycle or a sink out of reach is a ValueError, not a hang or a wrong answer."""
    with pytest.raises(ValueError, match="cycle"):
        longest_path(3, [0, 1, 2], [1, 2, 1], [1.0, 1.0, 1.0], 0, 2)
    with pytest.raises(ValueError, match="cannot be reached"):
        longest_path(3, [0], [1], [1.0], 0, 2)


def test_bad_input(tmp_path):
    """No steps, an unknown step or an empty trace: a ValueError that says so."""
    with pytest.raises(ValueError, match="no ProfilerStep#N"):
        critical_path(read_trace(_write(tmp_path, [_span("aten::add", 0, 5)])))
    with pytest.raises(ValueError, match="no ProfilerStep#N"):
        critical_path(read_trace(_write(tmp_path, [], "empty.json")))
    stepped = _write(tmp_path, [_step(3, 0, 10), _step(4, 10, 10)], "stepped.json")
    with pytest.raises(ValueError, match=r"step 7: .* has no ProfilerStep#7 \(its steps: 3, 4\)"):
        critical_path(read_trace(stepped), 7)
    with pytest.raises(ValueError, match="no ProfilerStep#7"):
        analyze([str(stepped)], critical_step=7)


def test_cli_text_and_json(tmp_path, capsys):
    """`perf trace --critical-path` prints the path's table per rank and puts it in --json; it
    takes the slowest step unless given one, and a step the trace lacks is an error."""
    path = _write(tmp_path, [_step(1, 0, 50), _span("aten::mm", 10, 20), _step(2, 50, 100),
                             _span("aten::add", 60, 70)])
    assert main(["perf", "trace", str(path), "--critical-path"]) == 0
    text = capsys.readouterr().out
    assert "critical path of step 2" in text and "aten::add" in text
    assert main(["perf", "trace", str(path), "--critical-path", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    cp = record["ranks"][0]["critical_path"]
    assert cp["step"] == 1 and cp["length_us"] == pytest.approx(50)
    assert cp["top"] == [{"name": "ProfilerStep#1", "kind": "host", "time_us": pytest.approx(30),
                          "share": pytest.approx(0.6)},
                         {"name": "aten::mm", "kind": "host", "time_us": pytest.approx(20),
                          "share": pytest.approx(0.4)}]
    assert [s["start_us"] for s in cp["segments"]] == pytest.approx([0, 10, 30])
    assert main(["perf", "trace", str(path), "--critical-path", "9"]) == 2
    assert "has no ProfilerStep#9 (its steps: 1, 2)" in capsys.readouterr().err


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))

    def forward(self, x):
        return self.layers(x).square().mean()


def test_real_cpu_trace(tmp_path):
    """A torch.profiler trace of a tiny model's training steps: each step's critical path is its
    whole span, lies inside it, and charges each op the self time torch's own event tree gives
    it on the step's thread (within the trace's rounding to the nanosecond)."""
    torch.manual_seed(0)
    model = _Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule) as prof:
        for _ in range(4):
            optimizer.zero_grad()
            model(x).backward()
            optimizer.step()
            prof.step()
    path = tmp_path / "tiny.json"
    prof.export_chrome_trace(str(path))
    trace = read_trace(path)
    steps = sorted({int(e.name.split("#")[1]) for e in trace.events if e.name.startswith("ProfilerStep#")})
    assert len(steps) == 3
    for step in steps:
        cp = critical_path(trace, step)
        assert cp.length_us == pytest.approx(cp.step_us, abs=1e-6)
        assert cp.breakdown_us["host"] == pytest.approx(cp.step_us, abs=1e-6)
        for s in cp.segments:
            assert cp.step_start_us - 1e-6 <= s.start_us and s.start_us + s.duration_us <= \
                cp.step_start_us + cp.step_us + 1e-6
    # torch's own tree: each op's self time in the last step, on the step's thread (torch names
    # every step "ProfilerStep*").
    last = max((e for e in prof.events() if e.name == "ProfilerStep*"), key=lambda e: e.time_range.start)
    expected: dict[str, float] = {}
    for e in prof.events():
        inside = last.time_range.start <= e.time_range.start and e.time_range.end <= last.time_range.end
        if inside and e.thread == last.thread:
            expected[e.name] = expected.get(e.name, 0.0) + e.self_cpu_time_total
    found: dict[str, float] = {}
    for s in critical_path(trace, steps[-1]).segments:
        name = "ProfilerStep*" if s.name.startswith("ProfilerStep#") else s.name
        found[name] = found.get(name, 0.0) + s.duration_us
    assert found.keys() == expected.keys()
    worst = max(abs(found[name] - expected[name]) for name in expected)
    print(f"largest difference from torch's self time: {worst:.4f} us over {len(expected)} op names")
    assert worst < 2.0


def _random_gpu_trace(rng: random.Random, skew_us: float) -> list[dict]:
    """A step of random nested ops, launches, kernels on three streams, synchronizations and
    event waits; kernels start `skew_us` early at most (host and device clocks that disagree)."""
    events, free, correlation, t = [_step(1, 0, 2000)], {7: 0.0, 8: 0.0, 9: 0.0}, 0, 1.0
    while t < 1900:
        correlation += 1
        roll, dur = rng.random(), rng.uniform(1, 30)
        if roll < 0.3:
            events.append(_span("aten::op", t, dur))
            events.append(_span("aten::inner", t + dur / 4, dur / 2))
        elif roll < 0.7:
            stream = rng.choice(list(free))
            start = max(free[stream], t + dur) + rng.uniform(-skew_us, 20)
            name = rng.choice(("cudaLaunchKernel", "cudaMemcpyAsync"))
            events.append(_launch(correlation, t, dur, name))
            length = rng.uniform(0, 80)
            events.append(_kernel("k", correlation, stream, start, length))
            free[stream] = start + length
        elif roll < 0.85:
            dur = max(max(free.values()) - t + rng.uniform(-10, 10), 1)
            events.append(_span(rng.choice(("cudaDeviceSynchronize", "cudaStreamSynchronize")), t, dur,
                                "cuda_runtime", correlation=correlation))
            events.append(_span("Stream Sync", t, 1, "cuda_sync", (GPU, rng.choice(list(free))),
                                correlation=correlation))
        else:
            events.append(_span("cudaStreamWaitEvent", t, dur, "cuda_runtime", correlation=correlation))
            events.append(_span("Stream Wait Event", t, 1, "cuda_sync", (GPU, rng.choice(list(free))),
                                correlation=correlation, wait_on_stream=rng.choice(list(free)),
                                wait_on_cuda_event_record_corr_id=rng.randint(1, correlation)))
        t += dur + rng.uniform(0, 10)
    return events


def test_random_gpu_traces(tmp_path):
    """Random GPU steps: with agreeing clocks the path is the whole step (every wait is linked),
    lies in it and its kinds sum to it; with clocks that disagree (kernels that start before
    their launch) the contradicting dependencies are left out and the path is at most the step."""
    rng = random.Random(1)
    for i in range(40):
        path = _write(tmp_path, _random_gpu_trace(rng, 0.0), f"agree{i}.json")
        cp = critical_path(read_trace(path))
        assert cp.length_us == pytest.approx(cp.step_us)  # every wait is linked to its cause
        assert sum(cp.breakdown_us.values()) == pytest.approx(cp.length_us)
        assert sum(s.duration_us for s in cp.segments) == pytest.approx(cp.length_us)
        assert all(0 <= s.start_us and s.start_us + s.duration_us <= cp.step_us + 1e-6 for s in cp.segments)
        skewed = critical_path(read_trace(_write(tmp_path, _random_gpu_trace(rng, 50.0), f"skew{i}.json")))
        assert skewed.length_us <= skewed.step_us + 1e-6
        assert sum(skewed.breakdown_us.values()) == pytest.approx(skewed.length_us)
