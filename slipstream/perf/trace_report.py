"""`slipstream perf trace`'s text: the report `trace.analyze` returns, as tables."""

from __future__ import annotations

from typing import Any

from slipstream.perf.trace_critical import step_label


def format_report(report: dict[str, Any], top: int = 10) -> str:
    """The report as text; `top` is the most step rows a rank shows before it summarizes them."""
    lines: list[str] = []
    for rank in report["ranks"]:
        lines += _format_rank(rank, top) + [""]
    spread = report["spread"]
    if spread:
        lines.append(f"ranks: slowest {spread['slowest']} at {_ms(spread['slowest_step_us'])} ms a step, "
                     f"fastest {spread['fastest']} at {_ms(spread['fastest_step_us'])} ms "
                     f"({spread['ratio']:.2f}x)")
    if report["comparison"]:
        lines += _format_comparison(report["comparison"])
    return "\n".join(lines).rstrip()


def _format_comparison(c: dict[str, Any]) -> list[str]:
    step = c["step_time_us"]
    lines = [f"against {', '.join(c['baseline'])}: "
             + (f"mean step time {_ms(step['new'])} ms, baseline {_ms(step['baseline'])} ms"
                + (f" ({step['ratio']:.2f}x)" if step["ratio"] else "") if c["per"] == "step"
                else "no profiler steps: whole traces compared, averaged over ranks")]
    for table, title in (("host", "host self time"), ("kernels", "kernel time")):
        if c[table]:
            lines.append(f"  {title} per {c['per']}, largest changes:")
            lines += [_format_change(r) for r in c[table]]
    return lines


def _format_change(r: dict[str, Any]) -> str:
    times = f"{_ms(r['baseline_us']):>9} -> {_ms(r['new_us']):>9} ms"
    calls = f"{r['baseline_calls']:g} -> {r['new_calls']:g} calls"
    return f"    {r['delta_us'] / 1e3:+10.3f} ms  {times}  {calls}  {r['change']:<6}  {r['name'][:90]}"


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1e3:.3f}"


def _share(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


GPU_HEADER = "compute  exp. comm  exp. memory     idle  overlap"
"""The columns of `_gpu_cells`: shares of the kernels' span, then of communication time."""


def _format_rank(r: dict[str, Any], top: int) -> list[str]:
    where = ", ".join(([f"rank {r['rank']}"] if r["rank"] is not None else []) + r["devices"][:1])
    lines = [f"{r['file']}{f' ({where})' if where else ''}: {len(r['steps'])} profiler steps"
             + (f", median {_ms(r['step_time_us'])} ms" if r["steps"] else
                " (no ProfilerStep#N annotations: whole trace)")]
    if r["skipped_events"]:
        lines.append(f"  {r['skipped_events']} complete events without a usable time or thread were skipped")
    lines += _format_steps(r["steps"], top)
    lines.append("  host time by op (self time, as key_averages counts it):")
    lines += [f"    {_share(o['share']):>6} {_ms(o['self_us']):>10} ms {o['calls']:>7} calls  {o['name']}"
              for o in r["host"]]
    if r["annotations"]:
        lines.append("  annotations (inclusive time, share of step time):")
        lines += [f"    {_share(a['share_of_steps']):>6} {_ms(a['total_us']):>10} ms {a['calls']:>7} calls  "
                  f"{a['name']}" for a in r["annotations"]]
    if r["gpu"]:
        lines += _format_gpu(r["gpu"], r["kernels"], "all steps" if r["steps"] else "whole trace")
    if r["launches"]:
        lines += _format_launches(r["launches"])
    if r["skipped_memory_events"]:
        lines.append(f"  {r['skipped_memory_events']} memory events without a usable time, thread or size "
                     "were skipped")
    for device in r["memory"]:
        lines += _format_memory(device, top)
    if r["roofline"]:
        lines += _format_roofline(r["roofline"])
    if r["critical_path"]:
        lines += _format_critical_path(r["critical_path"])
    return lines


_KIND_LABELS = {"host": "host ops", "kernel": "kernels", "launch_delay": "launch delay",
                "sync_wait": "sync wait", "idle": "GPU idle"}


def _format_critical_path(cp: dict[str, Any]) -> list[str]:
    """The path's length against the step's, its split by kind, and the events most on it (or
    that the rank lacks the step)."""
    if "lacking" in cp:
        return [f"  critical path of step {cp['step']}: none on this rank ({cp['lacking']})"]
    span = cp["step_us"]
    split = ", ".join(f"{_KIND_LABELS[kind]} {_ms(t)} ms ({_share(t / span if span else None)})"
                      for kind, t in cp["breakdown_us"].items() if t > 0)
    unexplained = cp["unexplained_us"]
    note = f"; {_ms(unexplained)} ms before a kernel whose start the trace explains by no dependency" \
        if unexplained > 1e-3 else ""
    lines = [f"  critical path of step {cp['step']}: {_ms(cp['length_us'])} ms of the step's {_ms(span)} ms, "
             f"{len(cp['segments'])} segments{note}",
             f"    {split or 'nothing on it'}",
             "    on the path (share of the step):"]
    lines += [f"    {_share(row['share']):>6} {_ms(row['time_us']):>10} ms  {_KIND_LABELS[row['kind']]:<12}  "
              f"{step_label(row['name'])[:100]}" for row in cp["top"]]
    return lines


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.3f}"


def _format_memory(m: dict[str, Any], top: int) -> list[str]:
    where = f"step {m['peak_step']} +{_ms(m['peak_us_into_step'])} ms" if m["peak_step"] is not None \
        else "outside the profiler steps"
    ran = m["peak_op"] or "no op"
    if m["peak_annotation"]:
        ran += f" (in {m['peak_annotation']})"
    totals = "the allocator's totals" if m["totals"] == "allocator" else "totals summed from them, from 0"
    reserved = f"; peak reserved {_mib(m['peak_reserved_bytes'])} MiB" if m["peak_reserved_bytes"] else ""
    lines = [f"  memory on {m['device']} ({m['events']} events, {totals}): peak "
             f"{_mib(m['peak_allocated_bytes'])} MiB allocated at {where}, in {ran}{reserved}",
             f"    allocated at the first event {_mib(m['allocated_at_start_bytes'])} MiB, at the last "
             f"{_mib(m['final_allocated_bytes'])} MiB; {m['frees_of_earlier_blocks']} frees of blocks "
             f"allocated before the trace ({_mib(m['freed_earlier_bytes'])} MiB); {m['unfreed_blocks']} "
             f"blocks allocated in it and not freed ({_mib(m['unfreed_bytes'])} MiB)"]
    if m["before_first_step"]:
        b = m["before_first_step"]
        lines.append(f"    before the first step: {b['events']} events, net {_mib(b['net_bytes'])} MiB")
    lines += _format_memory_steps(m["steps"], m["grows_every_step"], top)
    lines.append("    ops by bytes allocated in their own time (net: key_averages' self memory usage):")
    lines.append("      allocated MiB  allocations   freed MiB     net MiB  op")
    lines += [f"      {_mib(o['allocated_bytes']):>13} {o['allocations']:>12} {_mib(o['freed_bytes']):>11} "
              f"{_mib(o['self_net_bytes']):>11}  {o['name'][:90]}" for o in m["ops"]]
    return lines


def _format_memory_steps(steps: list[dict[str, Any]], grows: bool, top: int) -> list[str]:
    """Each step's allocated total, or past 2 x `top` steps the `top` with the highest peaks."""
    if not steps:
        return []
    shown = steps if len(steps) <= 2 * top else sorted(
        sorted(steps, key=lambda s: -s["peak_bytes"])[:top], key=lambda s: s["step"])
    lines = [f"    per step{'' if shown is steps else f', the {top} with the highest peaks'}"
             + (": it grew in every step (a leak?)" if grows else ":"),
             "      step   start MiB    peak MiB     end MiB  growth MiB"]
    lines += [f"      {s['step']:>4} {_mib(s['start_bytes']):>11} {_mib(s['peak_bytes']):>11} "
              f"{_mib(s['end_bytes']):>11} {_mib(s['growth_bytes']):>11}" for s in shown]
    return lines


def _format_roofline(roofline: dict[str, Any]) -> list[str]:
    timed = "each op's host time, inclusive"
    if roofline["time_source"] == "kernels":
        by_host = sum(g["host_timed_calls"] for g in roofline["ops"])
        timed = "the kernels each op launched" + (
            f"; {by_host} calls that launched none by their host time" if by_host else "")
    hardware = roofline["hardware"] or roofline.get("hardware_note") or "no hardware"
    lines = [f"  ops against the roofline of {hardware} (timed by {timed}; bytes: inputs and outputs once):",
             "          ms   calls   GFLOP/s      GB/s   FLOP/B  bound    of roof  op [shapes] type"]
    for g in roofline["ops"]:
        intensity = "-" if g["flops_per_byte"] is None else f"{g['flops_per_byte']:.1f}"
        lines.append(f"    {_ms(g['time_us']):>8} {g['calls']:>7} {_rate(g['gflops_per_s']):>9} "
                     f"{_rate(g['gbytes_per_s']):>9} {intensity:>8}  {g['bound'] or '-':<7} "
                     f"{_share(g['roofline_fraction']):>7}  {g['name']} [{g['shapes']}] {g['dtype']}")
    lines += [f"    not priced: {u['name']}, {u['calls']} calls, {_ms(u['time_us'])} ms: {u['reason']}"
              for u in roofline["unpriced"]]
    return lines


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _format_launches(launches: dict[str, float]) -> list[str]:
    n = launches["launches"]
    return [
        f"  launches: {n} kernels, copies and sets; {launches['shorter_than_launch']} "
        f"({_share(launches['shorter_than_launch'] / n)}) ran shorter than their launch call; launch delay "
        f"median {launches['median_launch_delay_us']:.1f} us, total {_ms(launches['launch_delay_us'])} ms",
        f"    HTA's outliers: {launches['runtime_outliers']} launch calls over 50 us, "
        f"{launches['launch_delay_outliers']} launch delays over 100 us",
    ]


def _format_steps(steps: list[dict[str, Any]], top: int) -> list[str]:
    """Every step in order, or past 2 x `top` steps their spread and the `top` slowest."""
    if not steps:
        return []
    lines = []
    shown = steps
    if len(steps) > 2 * top:
        ordered = sorted(s["duration_us"] for s in steps)
        lines.append(f"  step time ms: min {_ms(ordered[0])}, p10 {_ms(_quantile(ordered, 0.1))}, p90 "
                     f"{_ms(_quantile(ordered, 0.9))}, max {_ms(ordered[-1])}; the {top} slowest steps:")
        shown = sorted(sorted(steps, key=lambda s: -s["duration_us"])[:top], key=lambda s: s["step"])
    has_gpu = any(s["gpu"] for s in steps)
    lines.append("  step      ms  host between ops ms" + (f"  | GPU {GPU_HEADER}" if has_gpu else ""))
    for s in shown:
        line = f"  {s['step']:>4} {_ms(s['duration_us']):>7} {_ms(s['host_outside_ops_us']):>20}"
        lines.append(line + ("  | " + _gpu_cells(s["gpu"]) if has_gpu else ""))
    return lines


def _quantile(ordered: list[float], q: float) -> float:
    """The nearest-rank quantile of sorted values."""
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def _format_gpu(gpu: dict[str, float], kernels: list[dict[str, Any]], over: str) -> list[str]:
    return [
        f"  GPU, {over}: {_ms(gpu['span_us'])} ms from the first kernel to the last",
        f"      {GPU_HEADER}",
        f"    {_gpu_cells(gpu)}",
        f"  idle waits, summed over streams: host {_ms(gpu['host_wait_us'])} ms, kernel "
        f"{_ms(gpu['kernel_wait_us'])} ms, other {_ms(gpu['other_wait_us'])} ms",
        "  kernels by time:",
        *[f"    {_share(k['share']):>6} {_ms(k['total_us']):>10} ms {k['calls']:>7} calls  "
          f"{k['class']:<13} {k['name'][:100]}" for k in kernels],
    ]


def _gpu_cells(gpu: dict[str, float] | None) -> str:
    if not gpu:
        return "no kernels"
    span = gpu["span_us"]
    cells = [gpu["compute_us"], gpu["exposed_communication_us"], gpu["exposed_memory_us"], gpu["idle_us"]]
    shares = "  ".join(f"{_share(v / span) if span else '-':>9}" for v in cells)
    return f"{shares}  {_share(gpu['overlap']):>7}"
