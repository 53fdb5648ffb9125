"""A report summary (`perf.report`) as one self-contained HTML file: inline CSS, tables, and charts
as PNG data URIs drawn with matplotlib's Agg backend. Without matplotlib every table is still
there, and the page says which charts `pip install matplotlib` would add. Every string from the
records or the config is escaped: a model path may hold `<`.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;
text-align:right}th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}
.note{color:#666}img{max-width:100%;display:block;margin:.5em 0}"""


def charts_missing() -> str | None:
    """None where matplotlib imports, else why the charts are missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "the charts need matplotlib, which is not installed: pip install matplotlib"
    return None


def render(summary: Mapping[str, Any]) -> tuple[str, list[str]]:
    """(the HTML page, the titles of the charts it holds)."""
    train = summary["kind"] == "train"
    sections = _train_sections(summary) if train else _serve_sections(summary)
    charts = _train_charts(summary) if train else _serve_charts(summary)
    missing = charts_missing()
    body = [f"<h1>{_e('Training' if train else 'Serving')} run report</h1>",
            f"<p>{_e(summary['run'])}</p>", *sections, "<h2>Charts</h2>"]
    drawn = []
    if missing:
        body.append(f"<p class=note>{_e(missing)}; it would draw: {_e(', '.join(t for t, _ in charts))}.</p>")
    else:
        for title, draw in charts:
            body.append(f"<h3>{_e(title)}</h3><img alt=\"{_e(title)}\" src=\"data:image/png;base64,"
                        f"{_png(draw)}\">")
            drawn.append(title)
    page = (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{_e(summary['run'])}</title>"
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    return page, drawn


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(_cell(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.3f}"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _spread_row(name: str, spread: Mapping[str, float] | None, keys: Sequence[str],
                fmt: Callable[[float], str]) -> list[str]:
    return [name, *(fmt(spread[k]) if spread else "-" for k in keys)]


# ---- training ---------------------------------------------------------------------------------


def _train_sections(s: Mapping[str, Any]) -> list[str]:
    steps, p, g = s["steps"], s["prediction"], s["goodput"]
    keys = ("p10", "p50", "p90")
    sections = ["<h2>Run config</h2>", _table(("key", "value"), s["config"].items()),
                f"<h2>Steps</h2><p>{steps['num_records']} train records; the statistics leave out the first "
                f"{steps['warmup_steps']} (warm-up), {steps['num_measured']} measured."
                + (f" {steps['num_earlier_layout']} records of earlier attempts at another layout (world "
                   "size, strategy, tensor or context parallelism) are left out: the run was resumed at "
                   "this one."
                   if steps["num_earlier_layout"] else "") + "</p>",
                _table(("quantity", *keys), [
                    _spread_row("step time (ms)", steps["step_s"], keys, _ms),
                    _spread_row("tokens/s", steps["tokens_per_s"], keys, lambda v: f"{v:,.0f}"),
                    _spread_row("MFU (logged)", steps["mfu_logged"], keys, _pct)]),
                _table(("loss", "value"), [("first", steps["loss_first"]), ("last", steps["loss_last"])]),
                "<h2>Goodput</h2>"]
    if "missing" in g:
        sections.append(f"<p class=note>{_e(g['missing'])}</p>")
    else:
        total = g["total_s"]
        order = sorted(g["seconds"].items(), key=lambda kv: (kv[0] != "productive", -kv[1]))
        sections += [f"<p>goodput {_pct(g['goodput'])} of {total:.3f} s over {g['attempts']} attempt(s), "
                     f"{g['restarts']} restart(s); {g['steps_kept']} steps kept, {g['steps_lost']} lost.</p>",
                     _table(("bucket", "seconds", "share"),
                            [(k, f"{v:.3f}", _pct(v / total if total > 0 else 0.0)) for k, v in order])]
    sections += [f"<h2>Measured against the model</h2><p>{_e(p['model'])} on {_e(p['hardware'])}, "
                 f"{_e(p['layout'])}, {_e(p['dtype'])}; efficiency {_e(p['efficiency'])}; bound by "
                 f"{_e(p['bound'])}.</p>",
                 _table(("quantity", "measured", "predicted", "error"), [
                     ("median step time (ms)", _ms(p["step_s"]["measured"]), _ms(p["step_s"]["predicted"]),
                      f"{100 * p['step_s']['error']:+.1f}%"),
                     ("MFU", _pct(p["mfu"]["measured"]), _pct(p["mfu"]["predicted"]),
                      f"{100 * p['mfu']['error']:+.1f}%")]),
                 _table(("predicted part", "ms"), [(k, _ms(v)) for k, v in p["breakdown_s"].items()])]
    return sections


def _train_charts(s: Mapping[str, Any]) -> list[tuple[str, Callable]]:
    series, predicted = s["series"], s["prediction"]["step_s"]["predicted"]

    def per_step(key: str, label: str, scale: float = 1.0, line: float | None = None):
        def draw(ax):
            points = [(x, scale * y) for x, y in zip(series["step"], series[key], strict=True)
                      if y is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], ".-", label="measured")
            if line is not None:
                ax.axhline(scale * line, color="C3", linestyle="--", label="predicted")
                ax.legend()
            ax.set_xlabel("step")
            ax.set_ylabel(label)
        return draw

    return [("Loss per step", per_step("loss", "loss")),
            ("Tokens/s per step", per_step("tokens_per_s", "tokens/s")),
            ("Step time per step, the prediction as a line",
             per_step("step_s", "step time (ms)", 1e3, predicted))]


# ---- serving ----------------------------------------------------------------------------------


def _serve_sections(s: Mapping[str, Any]) -> list[str]:
    steps, req, p = s["steps"], s["requests"], s["prediction"]
    keys = ("p50", "p90", "p99")
    latency = req["latency_s"]
    hit = s["prefix_cache_hit_rate"]
    return [
        "<h2>Engine config</h2>", _table(("key", "value"), s["config"].items()),
        f"<h2>Steps measured against the model</h2><p>{_e(p['model'])} on {_e(p['hardware'])}, "
        f"{_e(p['dtype'])}; efficiency {_e(p['efficiency'])}. Per forward pass; the prediction at each "
        f"group's median length. {steps['num_unpriced']} of {steps['num_records']} steps not priced "
        "(mixed, malformed or out of range).</p>",
        _table(("phase", "batch", "steps", "median length", "measured ms", "predicted ms", "error", "bound"),
               [(g["phase"], g["batch_size"], g["count"], g["length"], _ms(g["measured_s"]),
                 _ms(g["predicted_s"]), f"{100 * g['error']:+.1f}%", g["bound"]) for g in steps["groups"]]),
        _table(("phase", "median MFU", "median bandwidth use"),
               [(k, _pct(v["mfu"]), _pct(v["mbu"])) for k, v in steps["utilization"].items()]),
        f"<h2>Requests</h2><p>{req['count']} completions, {req['prompt_tokens']:,.0f} prompt and "
        f"{req['generation_tokens']:,.0f} generated tokens; prefix cache hit rate {_pct(hit)}; "
        f"{s['num_preemptions']} preemptions.</p>",
        _table(("latency (ms)", *keys, "count"),
               [[*_spread_row(name, latency[name], keys, _ms), latency[name]["count"] if latency[name] else 0]
                for name in latency]),
        _table(("finished reason", "completions"), sorted(req["finished_reason"].items())),
    ]


def _serve_charts(s: Mapping[str, Any]) -> list[tuple[str, Callable]]:
    series, groups = s["series"], s["steps"]["groups"]

    def step_times(ax):
        for i, phase in enumerate(("prefill", "decode")):
            points = [(b, 1e3 * t) for ph, b, t in series["steps"] if ph == phase]
            if points:
                ax.plot([b for b, _ in points], [t for _, t in points], ".", color=f"C{i}", alpha=.4,
                        label=f"{phase} measured")
            line = [(g["batch_size"], 1e3 * g["predicted_s"]) for g in groups if g["phase"] == phase]
            if line:
                ax.plot([b for b, _ in line], [t for _, t in line], "-", color=f"C{i}",
                        label=f"{phase} predicted")
        ax.set_xlabel("batch size (sequences)")
        ax.set_ylabel("step time per forward pass (ms)")
        ax.legend()

    def cdf(key: str, label: str):
        def draw(ax):
            values = sorted(1e3 * v for v in series[key])
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
            ax.set_xlabel(f"{label} (ms)")
            ax.set_ylabel("fraction of requests")
        return draw

    def kv_usage(ax):
        ax.plot(series["kv_time_s"], [100 * u for u in series["kv_usage"]], "-")
        ax.set_xlabel("time since the first step (s)")
        ax.set_ylabel("KV cache usage (%)")

    charts = [("Step time against batch size: measured points, predicted line", step_times)]
    charts += [(f"{name} CDF", cdf(key, name)) for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"))
               if series[key]]
    return charts + [("KV cache usage over time", kv_usage)]


def _png(draw: Callable) -> str:
    """`draw(ax)` on a fresh figure, as base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    try:
        draw(ax)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
    finally:
        plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
