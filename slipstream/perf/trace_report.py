"""`slipstream perf trace`'s text: the report `trace.analyze` returns, as tables."""

from __future__ import annotations

from typing import Any


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
    return lines


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
