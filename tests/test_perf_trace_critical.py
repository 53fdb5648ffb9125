"""`slipstream perf trace --critical-path` (perf/trace_critical.py): the longest chain of
dependencies through a profiler step, against hand-built traces whose critical path is known by
construction, a brute-force longest path, and a real torch.profiler trace."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest
import torch

from slipstream.cli import main
from slipstream.perf.kineto import read_trace
from slipstream.perf.trace import analyze
from slipstream.perf.trace_critical import critical_path
from slipstream.perf.trace_critical_graph import longest_path

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


def _write(tmp_path, events: list[dict], name: str = "trace.json", rank: int | None = None):
    path = tmp_path / name
    record: dict = {"schemaVersion": 1, "traceEvents": events}
    if rank is not None:
        record["distributedInfo"] = {"rank": rank, "world_size": 2}
    path.write_text(json.dumps(record))
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


@pytest.mark.parametrize("call, copy", [("cudaMemcpyAsync", "Memcpy DtoH (Device -> Pageable)"),
                                        ("cudaMemcpy", "Memcpy HtoD (Pinned -> Device)")])
def test_blocking_copy_waits_for_its_copy(tmp_path, call, copy):
    """A copy to pageable memory (even by cudaMemcpyAsync, as CUDA's API synchronization behaviour
    says) or by the synchronous cudaMemcpy returns when its copy has ended: the copy, queued
    behind a kernel on its stream, is on the path."""
    events = _gpu_step([
        _launch(1, 10, 5), _kernel("gemm", 1, 7, 20, 400),
        _launch(2, 16, 430, call), _kernel(copy, 2, 7, 421, 20, "gpu_memcpy"),
    ])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    path = _on_path(cp)
    assert cp.length_us == pytest.approx(1000)
    assert path[("kernel", "gemm")] == pytest.approx(400)
    assert path[("kernel", copy)] == pytest.approx(20)
    assert path[("sync_wait", call)] == pytest.approx(5)
    assert (("host", call)) not in path


def test_async_copy_to_pinned_memory_does_not_wait(tmp_path):
    """A cudaMemcpyAsync to pinned memory returns without waiting for its copy, though the copy
    (2 us) ended before the call (20 us) returned: the call's time is host time."""
    events = _gpu_step([_launch(1, 10, 20, "cudaMemcpyAsync"),
                        _kernel("Memcpy HtoD (Pinned -> Device)", 1, 7, 15, 2, "gpu_memcpy")])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    assert _on_path(cp) == pytest.approx({("host", "ProfilerStep#1"): 980, ("host", "cudaMemcpyAsync"): 20})


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
    assert critical_path(read_trace(_write(tmp_path, [_step(3, 0, 10), _step(4, 10, 30), _step(5, 40, 20)],
                                           "three.json"))).step == 4  # the slowest
    with pytest.raises(ValueError, match=r"step 7: .* has no ProfilerStep#7 \(its steps: 3, 4\)"):
        critical_path(read_trace(stepped), 7)
    with pytest.raises(ValueError, match="no ProfilerStep#7"):
        analyze([str(stepped)], critical_path=7)
    for bad in (-1, True, "fastest", 2.0):
        with pytest.raises(ValueError, match=f"critical_path must be .* got {bad!r}"):
            analyze([str(stepped)], critical_path=bad)


def test_cli_text_and_json(tmp_path, capsys):
    """`perf trace --critical-path` prints the path's table per rank and puts it in --json; it
    takes the slowest step unless given one (--critical-step), and a step the trace lacks is an
    error. The flag takes no value: a trace named after it is a trace, not a step."""
    path = _write(tmp_path, [_step(1, 0, 50), _span("aten::mm", 10, 20), _step(2, 50, 100),
                             _span("aten::add", 60, 70)])
    assert main(["perf", "trace", "--critical-path", str(path)]) == 0
    text = capsys.readouterr().out
    assert "critical path of step 2" in text and "aten::add" in text
    assert main(["perf", "trace", str(path), "--critical-step", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    cp = record["ranks"][0]["critical_path"]
    assert cp["step"] == 1 and cp["length_us"] == pytest.approx(50)
    assert cp["top"] == [{"name": "ProfilerStep#1", "kind": "host", "time_us": pytest.approx(30),
                          "share": pytest.approx(0.6)},
                         {"name": "aten::mm", "kind": "host", "time_us": pytest.approx(20),
                          "share": pytest.approx(0.4)}]
    assert [s["start_us"] for s in cp["segments"]] == pytest.approx([0, 10, 30])
    assert main(["perf", "trace", str(path), "--critical-step", "9"]) == 2
    assert "has no ProfilerStep#9 (its steps: 1, 2)" in capsys.readouterr().err


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))

    def forward(self, x):
        return self.layers(x).square().mean()


@pytest.mark.parametrize("with_stack", [False, True])
def test_real_cpu_trace(tmp_path, with_stack):
    """A torch.profiler trace of a tiny model's training steps: each step's critical path is its
    whole span, lies inside it, holds every event torch's own event tree has on the step's
    thread, and charges each the self time that tree gives it (within the trace's rounding to
    the nanosecond). With the Python stack (slipstream's serve profiler's default) the optimizer's
    record_function range opens inside its own `__enter__` frame, and torch's tree charges the
    frames around it a negative self time: there the ops are compared (the range's ops among
    them), not the frames and ranges."""
    torch.manual_seed(0)
    model = _Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                with_stack=with_stack) as prof:
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
    ops = {e.name for e in trace.events if e.cat == "cpu_op"}
    compared = [name for name in expected if not with_stack or name in ops]
    optimizer_ops = [n for n in compared if n.startswith("aten::_foreach") or n == "aten::add_"]
    assert "aten::mm" in compared and optimizer_ops  # the optimizer's range's ops are on the path
    worst = max(abs(found[name] - expected[name]) for name in compared)
    print(f"largest difference from torch's self time: {worst:.4f} us over {len(compared)} names")
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


@dataclasses.dataclass(frozen=True)
class _Point:
    """A moment of a simulated step and why it came then: the stretch from `after` (None at the
    step's start) to it was `kind` in `name`."""

    time: float
    after: _Point | None = None
    kind: str = ""
    name: str = ""


class _Program:
    """A random GPU step run by a simple model of a host thread and three streams, written as
    events: each moment is recorded with the one it waited for, so the chain that ends the step
    is known by construction. Kernels run in order on their stream and start after the last of
    their launch (a call's end, or its start for one that starts before it returns), the kernel
    before them on the stream and the kernels their stream waits for (cudaStreamWaitEvent); a
    synchronize or blocking copy returns after the last work it waited for ended."""

    def __init__(self, rng: random.Random):
        self.rng, self.events, self.correlation = rng, [], 0
        self.now = _Point(0.0)  # the host thread's last moment
        self.streams = {7: [], 8: [], 9: []}  # each stream's kernels' end points, in order
        self.waits: dict[int, list[_Point]] = {7: [], 8: [], 9: []}  # kernels a stream must wait for
        self.records: list[tuple[int, int]] = []  # (stream, correlation) of each cudaEventRecord
        self.recorded: dict[int, _Point] = {}  # the kernel each record's event marks, by correlation

    def _host(self, name: str, dur: float, cat: str = "cpu_op", **args) -> tuple[_Point, _Point]:
        """A host span of `dur` after a gap between ops: its start and end points."""
        gap = _Point(self.now.time + self.rng.uniform(0.5, 10), self.now, "host", "ProfilerStep#1")
        self.events.append(_span(name, gap.time, dur, cat, **args))
        self.now = _Point(gap.time + dur, gap, "host", name)
        return gap, self.now

    def op(self) -> None:
        d = self.rng.uniform(4, 40)
        start, _ = self._host("aten::op", d)
        self.events.append(_span("aten::inner", start.time + d / 4, d / 2))
        inner = _Point(start.time + d / 4, start, "host", "aten::op")
        inner = _Point(start.time + 3 * d / 4, inner, "host", "aten::inner")
        self.now = _Point(start.time + d, inner, "host", "aten::op")

    def launch(self, call: str = "cudaLaunchKernel", copy: str = "", blocking: bool = False) -> None:
        self.correlation += 1
        stream, correlation = self.rng.choice(list(self.streams)), self.correlation
        name = copy or f"k{correlation}"
        ready = [p for p in (*self.waits[stream], *self.streams[stream][-1:])]
        self.waits[stream] = []
        dur = self.rng.uniform(2, 15)
        start = _Point(self.now.time + self.rng.uniform(0.5, 10), self.now, "host", "ProfilerStep#1")
        latest = max(ready, key=lambda p: p.time, default=None)
        early = start.time + self.rng.uniform(0.1, 0.9) * dur
        if (blocking or self.rng.random() < 0.3) and (latest is None or latest.time < start.time):
            # It starts before its call returns: launched from the call's start.
            cause, kind = start, "launch_delay"
            begins = early
        else:
            # A blocking copy starts before its call returns, whenever it starts.
            launched = start if blocking else _Point(start.time + dur, start, "host", call)
            candidates = [(launched, "launch_delay"),
                          *((p, "idle" if p in self.streams[stream] else "sync_wait") for p in ready)]
            cause, kind = max(candidates, key=lambda c: c[0].time)
            begins = cause.time + self.rng.uniform(0.5, 40)
        kernel_start = _Point(begins, cause, kind, name)
        length = self.rng.uniform(0.5, 80) if not copy else self.rng.uniform(0.5, 10)
        kernel_end = _Point(begins + length, kernel_start, "kernel", name)
        self.events.append(_kernel(name, correlation, stream, begins, length,
                                   "gpu_memcpy" if copy else "kernel"))
        self.streams[stream].append(kernel_end)
        if blocking:
            returns = _Point(kernel_end.time + self.rng.uniform(0.5, 5), kernel_end, "sync_wait", call)
            dur = returns.time - start.time
        else:
            returns = _Point(start.time + dur, start, "host", call)
            assert kernel_start.time >= returns.time or cause is start
        self.events.append(_launch(correlation, start.time, dur, call))
        self.now = returns

    def record(self) -> None:
        stream = self.rng.choice(list(self.streams))
        self.correlation += 1
        self._host("cudaEventRecord", self.rng.uniform(1, 5), "cuda_runtime", correlation=self.correlation)
        if self.streams[stream]:
            self.recorded[self.correlation] = self.streams[stream][-1]
        self.records.append((stream, self.correlation))

    def wait_event(self) -> None:
        """cudaStreamWaitEvent on a recorded event of another stream."""
        stream, record = self.rng.choice(self.records)
        waiting = self.rng.choice([s for s in self.streams if s != stream])
        self.correlation += 1
        start, _ = self._host("cudaStreamWaitEvent", self.rng.uniform(1, 5), "cuda_runtime",
                              correlation=self.correlation)
        self.events.append(_span("Stream Wait Event", start.time, 1, "cuda_sync", (GPU, waiting),
                                 correlation=self.correlation, wait_on_stream=stream,
                                 wait_on_cuda_event_record_corr_id=record))
        if record in self.recorded:
            self.waits[waiting].append(self.recorded[record])

    def synchronize(self) -> None:
        """cudaDeviceSynchronize, cudaStreamSynchronize or cudaEventSynchronize, with the event
        that says what it waited for."""
        self.correlation += 1
        call = self.rng.choice(("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
                               if self.records else ("cudaDeviceSynchronize", "cudaStreamSynchronize"))
        begins = _Point(self.now.time + self.rng.uniform(0.5, 10), self.now, "host", "ProfilerStep#1")
        args: dict = {"correlation": self.correlation}
        if call == "cudaDeviceSynchronize":
            awaited = [s[-1] for s in self.streams.values() if s]
            sync = _span("Context Sync", begins.time, 1, "cuda_sync", (GPU, -1), **args)
        elif call == "cudaStreamSynchronize":
            stream = self.rng.choice(list(self.streams))
            awaited = self.streams[stream][-1:]
            sync = _span("Stream Sync", begins.time, 1, "cuda_sync", (GPU, stream), **args)
        else:
            stream, record = self.rng.choice(self.records)
            awaited = [self.recorded[record]] if record in self.recorded else []
            sync = _span("Event Sync", begins.time, 1, "cuda_sync", (GPU, -1), **args, wait_on_stream=stream,
                         wait_on_cuda_event_record_corr_id=record)
        last = max(awaited, key=lambda p: p.time, default=None)
        if last is not None and last.time > begins.time:
            self.now = _Point(last.time + self.rng.uniform(0.5, 5), last, "sync_wait", call)
        else:
            self.now = _Point(begins.time + self.rng.uniform(1, 5), begins, "host", call)
        self.events += [_span(call, begins.time, self.now.time - begins.time, "cuda_runtime", **args), sync]

    def run(self, until: float) -> list[dict]:
        while self.now.time < until:
            roll = self.rng.random()
            if roll < 0.2:
                self.op()
            elif roll < 0.55:
                self.launch()
            elif roll < 0.6:
                self.launch("cudaMemcpyAsync", "Memcpy HtoD (Pinned -> Device)")
            elif roll < 0.65:
                self.launch(*self.rng.choice((("cudaMemcpyAsync", "Memcpy DtoH (Device -> Pageable)"),
                                              ("cudaMemcpy", "Memcpy DtoD (Device -> Device)"))),
                            blocking=True)
            elif roll < 0.75:
                self.record()
            elif roll < 0.85 and self.records:
                self.wait_event()
            else:
                self.synchronize()
        end = _Point(self.now.time + self.rng.uniform(0.5, 10), self.now, "host", "ProfilerStep#1")
        self.chain = _chain(end)
        return [_step(1, 0, end.time), *self.events]


def _chain(point: _Point) -> list[tuple[str, str, float]]:
    """The stretches from the step's start to `point`, in order, consecutive ones of one kind and
    name as one (as the path's segments are)."""
    stretches = []
    while point.after is not None:
        stretches.append((point.kind, point.name, point.time - point.after.time))
        point = point.after
    merged: list[tuple[str, str, float]] = []
    for kind, name, dur in reversed(stretches):
        if merged and merged[-1][:2] == (kind, name):
            merged[-1] = (kind, name, merged[-1][2] + dur)
        else:
            merged.append((kind, name, dur))
    return merged


def test_random_gpu_steps_against_their_known_chain(tmp_path):
    """Random GPU steps (launches, copies blocking and not, kernels that start before their call
    returns, event records, cross-stream waits, three kinds of synchronize) run by a model that
    records why each moment came: the path is that chain, stretch by stretch (which kernels,
    which kinds, how long)."""
    rng = random.Random(3)
    kinds = set()
    for i in range(60):
        program = _Program(rng)
        cp = critical_path(read_trace(_write(tmp_path, program.run(1500), f"program{i}.json")))
        found = [(s.kind, s.name, s.duration_us) for s in cp.segments]
        assert [f[:2] for f in found] == [c[:2] for c in program.chain], i
        assert [f[2] for f in found] == pytest.approx([c[2] for c in program.chain], abs=1e-6)
        assert cp.length_us == pytest.approx(cp.step_us) and cp.unexplained_us == pytest.approx(0, abs=1e-6)
        kinds |= {kind for kind, _, _ in program.chain}
    assert kinds == {"host", "kernel", "launch_delay", "sync_wait", "idle"}


def _segments(cp) -> list[tuple[str, str, float]]:
    return [(s.kind, s.name, pytest.approx(s.duration_us)) for s in cp.segments]


def test_record_function_opened_inside_its_enter_frame(tmp_path):
    """Under with_stack, a record_function range starts inside its own Python `__enter__` frame
    and outlasts it: the range starts on the path where the frame ends, with its op, launch and
    kernel, instead of being left out."""
    events = _gpu_step([
        _span("optimizer.py: wrapper", 5, 900, "python_function"),
        _span("profiler.py: __enter__", 10, 20, "python_function"),
        _span("Optimizer.step#SGD.step", 25, 700, "user_annotation"),
        _span("aten::mm", 40, 30), _launch(1, 50, 10), _kernel("gemm", 1, 7, 62, 600),
        _span("cudaDeviceSynchronize", 100, 600, "cuda_runtime", correlation=2),
    ])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    step, wrapper, annotation = "ProfilerStep#1", "optimizer.py: wrapper", "Optimizer.step#SGD.step"
    assert _segments(cp) == [
        ("host", step, 5), ("host", wrapper, 5), ("host", "profiler.py: __enter__", 20),
        ("host", annotation, 10), ("host", "aten::mm", 10), ("host", "cudaLaunchKernel", 10),
        ("launch_delay", "gemm", 2), ("kernel", "gemm", 600), ("sync_wait", "cudaDeviceSynchronize", 38),
        ("host", annotation, 25), ("host", wrapper, 180), ("host", step, 95)]


def _two_waits(first: tuple[int, int], second: tuple[int, int]) -> list[dict]:
    """Kernels A (stream 7, ends at 300) and B (stream 8, ends at 600), each with an event recorded
    after it; C on stream 9 waits for both events (`first` and `second`: (correlation of the
    wait, of the event's record)), then the host synchronizes on stream 9."""
    streams = {2: 7, 4: 8}
    waits = [ev for i, (correlation, record) in enumerate((first, second)) for ev in (
        _span("cudaStreamWaitEvent", 30 + 3 * i, 2, "cuda_runtime", correlation=correlation),
        _span("Stream Wait Event", 31 + 3 * i, 1, "cuda_sync", (GPU, 9), correlation=correlation,
              wait_on_stream=streams[record], wait_on_cuda_event_record_corr_id=record))]
    return _gpu_step([
        _launch(1, 10, 5), _kernel("A", 1, 7, 20, 280),
        _span("cudaEventRecord", 16, 2, "cuda_runtime", correlation=2),
        _launch(3, 20, 5), _kernel("B", 3, 8, 30, 570),
        _span("cudaEventRecord", 26, 2, "cuda_runtime", correlation=4),
        *waits,
        _launch(7, 40, 5), _kernel("C", 7, 9, 600, 200),
        _span("cudaStreamSynchronize", 50, 750, "cuda_runtime", correlation=8),
        _span("Stream Sync", 799, 1, "cuda_sync", (GPU, 9), correlation=8),
    ])


@pytest.mark.parametrize("order", ["B's wait first", "A's wait first"])
def test_several_event_waits_before_one_kernel(tmp_path, order):
    """A kernel held by two cudaStreamWaitEvents started when the later of the two events' kernels
    ended, whichever wait came first: B (ends at 600, as C starts) is on the path, A is not."""
    waits = [(5, 4), (6, 2)] if order == "B's wait first" else [(6, 2), (5, 4)]
    cp = critical_path(read_trace(_write(tmp_path, _two_waits(*waits))))
    assert _segments(cp) == [
        ("host", "ProfilerStep#1", 10), ("host", "cudaLaunchKernel", 5), ("host", "ProfilerStep#1", 1),
        ("host", "cudaEventRecord", 2), ("host", "ProfilerStep#1", 2), ("host", "cudaLaunchKernel", 5),
        ("launch_delay", "B", 5), ("kernel", "B", 570), ("kernel", "C", 200), ("host", "ProfilerStep#1", 200)]


def test_synchronize_preferred_to_its_own_time(tmp_path):
    """A synchronize's span and the chain through the kernel it waited for end together and weigh
    alike: the path is the kernel's (the call was waiting), for each kind of synchronize."""
    for i, (call, sync) in enumerate([("cudaDeviceSynchronize", ("Context Sync", -1)),
                                      ("cudaStreamSynchronize", ("Stream Sync", 7))]):
        events = _gpu_step([_launch(1, 10, 10), _kernel("k", 1, 7, 25, 475),
                            _span(call, 30, 490, "cuda_runtime", correlation=2),
                            _span(sync[0], 500, 1, "cuda_sync", (GPU, sync[1]), correlation=2)])
        cp = critical_path(read_trace(_write(tmp_path, events, f"{i}.json")))
        assert _segments(cp) == [("host", "ProfilerStep#1", 10), ("host", "cudaLaunchKernel", 10),
                                 ("launch_delay", "k", 5), ("kernel", "k", 475), ("sync_wait", call, 20),
                                 ("host", "ProfilerStep#1", 480)]


def test_synchronize_waits_for_what_ended_before_it_returned(tmp_path):
    """On the synchronized stream, a kernel launched after the call (ending after it returned), or
    one of no duration that starts as it returns, was not waited for: the kernel before them was.
    A blocking copy of no duration at its call's end did not hold the call either."""
    events = _gpu_step([
        _launch(1, 10, 5), _kernel("waited", 1, 7, 20, 70),
        _span("cudaStreamSynchronize", 30, 70, "cuda_runtime", correlation=2),
        _span("Stream Sync", 95, 1, "cuda_sync", (GPU, 7), correlation=2),
        _launch(3, 100, 5), _kernel("no time", 3, 7, 100, 0, "gpu_memset"),
        _launch(4, 110, 5), _kernel("later", 4, 7, 120, 300),
        _launch(5, 130, 10, "cudaMemcpy"),
        _kernel("Memcpy DtoH (Device -> Pageable)", 5, 8, 140, 0, "gpu_memcpy"),
    ])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    path = _on_path(cp)
    assert cp.length_us == pytest.approx(1000)
    assert path[("kernel", "waited")] == pytest.approx(70)
    assert path[("sync_wait", "cudaStreamSynchronize")] == pytest.approx(10)
    assert path[("host", "cudaMemcpy")] == pytest.approx(10)
    assert ("kernel", "later") not in path and ("host", "cudaStreamSynchronize") not in path


def test_device_synchronize_waits_for_its_own_device(tmp_path):
    """cudaDeviceSynchronize ("Context Sync" on device 0) waits for device 0's kernel, not for the
    kernel of device 2 that ended later during the call."""
    events = _gpu_step([
        _launch(1, 10, 5), _kernel("device 0", 1, 7, 20, 380),
        _launch(2, 16, 4), _span("other device", 22, 388, "kernel", (2, 7), correlation=2),
        _span("cudaDeviceSynchronize", 30, 390, "cuda_runtime", correlation=3),
        _span("Context Sync", 415, 5, "cuda_sync", (GPU, -1), correlation=3),
    ])
    path = _on_path(critical_path(read_trace(_write(tmp_path, events))))
    assert path[("kernel", "device 0")] == pytest.approx(380)
    assert path[("sync_wait", "cudaDeviceSynchronize")] == pytest.approx(20)
    assert ("kernel", "other device") not in path


def test_synchronize_and_a_kernel_running_past_its_return(tmp_path):
    """Another thread launched a kernel on the stream while cudaDeviceSynchronize waited; it
    started before the call returned and ended after: the call waited for the kernel before it."""
    events = _gpu_step([
        _launch(1, 10, 5), _kernel("waited", 1, 7, 20, 380),
        _span("cudaDeviceSynchronize", 30, 390, "cuda_runtime", correlation=2),
        _span("Context Sync", 415, 5, "cuda_sync", (GPU, -1), correlation=2),
        _span("cudaLaunchKernel", 403, 4, "cuda_runtime", (1, 2), correlation=3),
        _kernel("running past the return", 3, 7, 410, 200),
    ])
    path = _on_path(critical_path(read_trace(_write(tmp_path, events))))
    assert path[("kernel", "waited")] == pytest.approx(380)
    assert path[("sync_wait", "cudaDeviceSynchronize")] == pytest.approx(20)
    assert ("host", "cudaDeviceSynchronize") not in path


@pytest.mark.parametrize("zero", ["launch", "record"])
def test_calls_at_one_instant(tmp_path, zero):
    """Times rounded to the microsecond put two calls of one thread at one instant, the first of
    no duration: a launch of no duration before a cudaEventRecord is recorded by it; a record of
    no duration before a launch is not. Likewise a launch of no duration right before a
    cudaStreamWaitEvent is not held by it."""
    launch_first = zero == "launch"
    events = _gpu_step([
        _launch(1, 16, 0 if launch_first else 3), _kernel("X", 1, 7, 20, 480),
        _launch(2, 10, 3), _kernel("before", 2, 7, 14, 4),
        _span("cudaEventRecord", 16, 2 if launch_first else 0, "cuda_runtime", correlation=3),
        _launch(4, 30, 0), _kernel("Y0", 4, 8, 31, 5),
        _span("cudaStreamWaitEvent", 30, 3, "cuda_runtime", correlation=5),
        _span("Stream Wait Event", 31, 1, "cuda_sync", (GPU, 8), correlation=5, wait_on_stream=7,
              wait_on_cuda_event_record_corr_id=3),
        _launch(6, 40, 5), _kernel("Y", 6, 8, 500, 100),
        _span("cudaStreamSynchronize", 50, 560, "cuda_runtime", correlation=7),
        _span("Stream Sync", 600, 5, "cuda_sync", (GPU, 8), correlation=7),
    ])
    path = _on_path(critical_path(read_trace(_write(tmp_path, events))))
    if launch_first:  # Y waited for X, recorded by the event
        assert path[("kernel", "X")] == pytest.approx(480) and path[("kernel", "Y")] == pytest.approx(100)
        assert ("launch_delay", "Y") not in path and ("idle", "Y") not in path
    else:  # the event marks "before", which ended long before Y's launch: Y waited for nothing seen
        assert ("kernel", "X") not in path and path[("launch_delay", "Y")] == pytest.approx(455)


def test_event_wait_holds_the_next_launch_of_its_own_thread(tmp_path):
    """cudaStreamWaitEvent holds the next kernel its own thread launches on the stream (as HTA),
    not one another thread launched there in between."""
    events = _gpu_step([
        _launch(1, 10, 5), _kernel("A", 1, 7, 20, 280),
        _span("cudaEventRecord", 16, 2, "cuda_runtime", correlation=2),
        _span("cudaStreamWaitEvent", 30, 4, "cuda_runtime", correlation=3),
        _span("Stream Wait Event", 31, 1, "cuda_sync", (GPU, 8), correlation=3, wait_on_stream=7,
              wait_on_cuda_event_record_corr_id=2),
        _span("cudaLaunchKernel", 35, 2, "cuda_runtime", (1, 2), correlation=4),
        _kernel("other thread's", 4, 8, 40, 20),
        _launch(5, 40, 10), _kernel("B", 5, 8, 300, 100),
        _span("cudaStreamSynchronize", 60, 350, "cuda_runtime", correlation=6),
        _span("Stream Sync", 405, 5, "cuda_sync", (GPU, 8), correlation=6),
    ])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    path = _on_path(cp)
    assert cp.length_us == pytest.approx(1000)
    assert path[("kernel", "A")] == pytest.approx(280) and path[("kernel", "B")] == pytest.approx(100)
    assert ("idle", "B") not in path and ("kernel", "other thread's") not in path


def test_tied_dependencies_take_the_chain_with_more_behind_it(tmp_path):
    """A kernel's launch call and the kernel before it on its stream end at one instant: of the
    two, the path takes the chain that explains more of the step (the host's, whole; the earlier
    kernel hangs from the step's start with nothing before it in the trace)."""
    events = _gpu_step([
        _kernel("launched before the step", 99, 8, 50, 150),
        _launch(1, 190, 10), _kernel("k", 1, 8, 210, 290),
        _span("cudaDeviceSynchronize", 220, 290, "cuda_runtime", correlation=2),
    ])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    assert cp.length_us == pytest.approx(1000) and cp.unexplained_us == pytest.approx(0)
    assert _on_path(cp)[("launch_delay", "k")] == pytest.approx(10)
    assert ("kernel", "launched before the step") not in _on_path(cp)


def test_unexplained_time_is_before_a_kernel_nothing_explains(tmp_path, capsys):
    """`unexplained_us` is the time from the step's start to a kernel on the path that no
    dependency in the trace explains (here one launched before the step, 50 us in)."""
    events = _gpu_step([_kernel("launched before the step", 99, 7, 50, 900),
                        _span("cudaDeviceSynchronize", 10, 945, "cuda_runtime", correlation=2)])
    cp = critical_path(read_trace(_write(tmp_path, events)))
    assert cp.unexplained_us == pytest.approx(50) and cp.length_us == pytest.approx(950)
    assert _segments(cp) == [("kernel", "launched before the step", 900),
                             ("sync_wait", "cudaDeviceSynchronize", 5), ("host", "ProfilerStep#1", 45)]
    assert main(["perf", "trace", str(tmp_path / "trace.json"), "--critical-path"]) == 0
    assert "0.950 ms of the step's 1.000 ms, 3 segments; 0.050 ms before a kernel whose start the trace " \
           "explains by no dependency" in capsys.readouterr().out


def test_nested_spans_of_one_name_are_one_segment(tmp_path):
    """A span and a child of the same name (aten::mean calling aten::mean) are one segment."""
    cp = critical_path(read_trace(_write(tmp_path, [_step(1, 0, 100), _span("aten::mean", 10, 30),
                                                    _span("aten::mean", 15, 20)])))
    assert _segments(cp) == [("host", "ProfilerStep#1", 10), ("host", "aten::mean", 30),
                             ("host", "ProfilerStep#1", 60)]


def test_cycle_at_one_instant_is_an_error(tmp_path):
    """Kernels of no duration at one instant that wait on each other's events form a cycle: a
    ValueError that says so (not a hang, nor a hint at clocks)."""
    events = [_step(1, 0, 100), _launch(1, 10, 1), _launch(2, 10, 1),
              _span("cudaEventRecord", 10, 1, "cuda_runtime", correlation=3),
              _span("cudaEventRecord", 10, 1, "cuda_runtime", correlation=4),
              _span("cudaStreamWaitEvent", 10, 1, "cuda_runtime", correlation=5),
              _span("cudaStreamWaitEvent", 10, 1, "cuda_runtime", correlation=6),
              _span("Stream Wait Event", 10, 0, "cuda_sync", (GPU, 8), correlation=5, wait_on_stream=7,
                    wait_on_cuda_event_record_corr_id=3),
              _span("Stream Wait Event", 10, 0, "cuda_sync", (GPU, 7), correlation=6, wait_on_stream=8,
                    wait_on_cuda_event_record_corr_id=4),
              _kernel("k1", 1, 7, 20, 0), _kernel("k2", 2, 8, 20, 0)]
    with pytest.raises(ValueError, match="cycle among events of no duration at one instant"):
        critical_path(read_trace(_write(tmp_path, events)))


def test_ranks_share_one_step(tmp_path, capsys):
    """Without a step, every rank's path is of the step whose slowest rank took longest (step 2:
    300 us on rank 0), not each rank's own slowest; a step one rank lacks is reported as lacking
    there, the other rank analysed; a step no rank has is an error."""
    _write(tmp_path, [_step(1, 0, 100), _span("aten::mm", 10, 20), _step(2, 100, 300)], "r0.json", rank=0)
    _write(tmp_path, [_step(1, 0, 200), _step(2, 200, 150), _span("aten::add", 210, 30), _step(3, 350, 10)],
           "r1.json", rank=1)
    report = analyze([str(tmp_path)], critical_path="slowest")
    assert [r["critical_path"]["step"] for r in report["ranks"]] == [2, 2]
    assert [r["critical_path"]["length_us"] for r in report["ranks"]] == pytest.approx([300, 150])
    report = analyze([str(tmp_path)], critical_path=3)
    lacking, found = (r["critical_path"] for r in report["ranks"])
    assert lacking == {"step": 3, "lacking": f"critical path step 3: {tmp_path / 'r0.json'} has no "
                                             "ProfilerStep#3 (its steps: 1, 2)"}
    assert found["step"] == 3 and found["length_us"] == pytest.approx(10)
    assert main(["perf", "trace", str(tmp_path), "--critical-step", "3"]) == 0
    assert "critical path of step 3: none on this rank (critical path step 3:" in capsys.readouterr().out
    with pytest.raises(ValueError, match="has no ProfilerStep#4"):
        analyze([str(tmp_path)], critical_path=4)
