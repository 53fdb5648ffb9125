"""`slipstream perf trace`'s text: the report `trace.analyze` returns, as tables."""

from __future__ import annotations

from typing import Any


def format_report(report: dict[str, Any]) -> str:
    lines: list[str] = []
    for rank in report["ranks"]:
        lines += _format_rank(rank) + [""]
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
    lines = [f"against {', '.join(c['baseline'])}: step time {_ms(step['new'])} ms, baseline "
             f"{_ms(step['baseline'])} ms" + (f" ({step['ratio']:.2f}x)" if step["ratio"] else "")]
    for table, title in (("host", "host self time"), ("kernels", "kernel time")):
        if c[table]:
            lines.append(f"  {title} per step, largest changes:")
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


def _format_rank(r: dict[str, Any]) -> list[str]:
    where = ", ".join(([f"rank {r['rank']}"] if r["rank"] is not None else []) + r["devices"][:1])
    lines = [f"{r['file']}{f' ({where})' if where else ''}: {len(r['steps'])} profiler steps"
             + (f", median {_ms(r['step_time_us'])} ms" if r["steps"] else
                " (no ProfilerStep#N annotations: whole trace)")]
    if r["skipped_events"]:
        lines.append(f"  {r['skipped_events']} complete events without a time were skipped")
    if r["steps"]:
        has_gpu = any(s["gpu"] for s in r["steps"])
        header = "  step      ms  host between ops ms"
        if has_gpu:
            header += "  | GPU compute  exp. comm  exp. memory     idle  overlap"
        lines.append(header)
        for s in r["steps"]:
            line = f"  {s['step']:>4} {_ms(s['duration_us']):>7} {_ms(s['host_outside_ops_us']):>20}"
            if has_gpu:
                line += "  | " + _gpu_cells(s["gpu"])
            lines.append(line)
    lines.append("  host time by op (self time, as key_averages counts it):")
    lines += [f"    {_share(o['share']):>6} {_ms(o['self_us']):>10} ms {o['calls']:>7} calls  {o['name']}"
              for o in r["host"]]
    if r["annotations"]:
        lines.append("  annotations (inclusive time, share of step time):")
        lines += [f"    {_share(a['share_of_steps']):>6} {_ms(a['total_us']):>10} ms {a['calls']:>7} calls  "
                  f"{a['name']}" for a in r["annotations"]]
    if r["gpu"]:
        lines.append(f"  GPU, {'all steps' if r['steps'] else 'whole trace'}:  " + _gpu_cells(r["gpu"]))
        lines.append("  kernels by time:")
        lines += [f"    {_share(k['share']):>6} {_ms(k['total_us']):>10} ms {k['calls']:>7} calls  "
                  f"{k['class']:<13} {k['name'][:100]}" for k in r["kernels"]]
    return lines


def _gpu_cells(gpu: dict[str, float] | None) -> str:
    if not gpu:
        return "no kernels"
    span = gpu["span_us"]
    cells = [gpu["compute_us"], gpu["exposed_communication_us"], gpu["exposed_memory_us"], gpu["idle_us"]]
    shares = "  ".join(f"{_share(v / span) if span else '-':>9}" for v in cells)
    return f"{shares}  {_share(gpu['overlap']):>7}"
