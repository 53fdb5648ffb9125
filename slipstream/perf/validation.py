"""Validation against published measurements (`data/published.json`): fit, predict, score.

Each profile (a software stack on a device) is first fitted to its own calibration points, then
predicts its validation points, which the fit never saw. Every point is converted to a time so a
fit can use it (a rate or an MFU becomes the time it implies) and scored in the units the source
prints: error = predicted / published - 1.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from slipstream.perf.accelerators import get_accelerator
from slipstream.perf.efficiency import Efficiency, default_efficiency, max_fraction
from slipstream.perf.fit import Calibration, calibrate
from slipstream.perf.model import Layout, TrainSetup, layer_passes, predict_training
from slipstream.perf.serving import ServeSetup, static_batch, step_time
from slipstream.perf.shapes import TransformerShape, resolve_model
from slipstream.perf.work import Work

DATA_PATH = Path(__file__).parent / "data" / "published.json"
RATE_KINDS = ("mfu", "output_tokens_per_s")


@dataclasses.dataclass(frozen=True)
class PointResult:
    id: str
    role: str
    profile: str
    kind: str
    published: float
    predicted: float
    source: str
    where: str

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1


def load(path: Path = DATA_PATH) -> dict[str, Any]:
    return json.loads(path.read_text())


def _shape(name: str, data: dict[str, Any]) -> TransformerShape:
    inline = data["shapes"].get(name)
    if inline is None:
        return resolve_model(name)
    return TransformerShape(name=name, **{k: v for k, v in inline.items() if k != "source"})


def _work(point: dict[str, Any], data: dict[str, Any], acc, eff: Efficiency) -> tuple[Work, float]:
    """(predicted time as a Work, the model's value in the point's units)."""
    kind = point["kind"]
    if "train" in point:
        cfg = dict(point["train"])
        setup = TrainSetup(shape=_shape(cfg.pop("model"), data), **cfg)
        layout = Layout(**point["layout"])
        if kind in ("layer_forward_s", "layer_backward_s"):
            work = layer_passes(setup, layout, acc, eff)[kind.split("_")[1]]
            return work, work.total_s
        prediction = predict_training(setup, layout, acc, eff)
        return prediction.work, prediction.mfu if kind == "mfu" else prediction.step_time_s
    cfg = dict(point["serve"])
    setup = ServeSetup(shape=_shape(cfg.pop("model"), data), tp=cfg.pop("tp"), dtype=cfg.pop("dtype"))
    if kind == "prefill_s":
        work = step_time(setup, acc, prefill_lens=[cfg["input_len"]] * cfg["batch_size"], efficiency=eff)
        return work, work.total_s
    batch = static_batch(setup, acc, cfg["batch_size"], cfg["input_len"], cfg["output_len"], eff)
    return batch.prefill_work + batch.decode_work * (cfg["output_len"] - 1), batch.output_tokens_per_s


def _measured_time_s(point: dict[str, Any], work: Work, model_value: float) -> float:
    """The time the published value implies, for fitting (rates scale inversely)."""
    if point["kind"] in RATE_KINDS:
        return work.total_s * model_value / point["value"]
    return point["value"]


def calibrate_profile(name: str, data: dict[str, Any]) -> Calibration | None:
    """Fit the profile to its calibration points; None when it has none (defaults apply)."""
    profile = data["profiles"][name]
    acc = get_accelerator(profile["accelerator"])
    points = [p for p in data["points"] if p["profile"] == name and p["role"] == "calibration"]
    if not points or not profile["components"]:
        return None
    eff = default_efficiency(acc)

    def predict(e: Efficiency) -> list[Work]:
        return [_work(p, data, acc, e)[0] for p in points]

    base = [_work(p, data, acc, eff) for p in points]
    measured = [_measured_time_s(p, w, v) for p, (w, v) in zip(points, base, strict=True)]
    return calibrate(predict, measured, eff, profile["components"], ceiling=max_fraction(acc))


def fit_profile(name: str, data: dict[str, Any]) -> Efficiency:
    """The profile's efficiency, fitted to its calibration points (defaults if it has none)."""
    cal = calibrate_profile(name, data)
    if cal is None:
        return default_efficiency(get_accelerator(data["profiles"][name]["accelerator"]))
    return cal.efficiency


def profile_scales(name: str, data: dict[str, Any]) -> dict[str, float]:
    """The profile's fitted time multipliers per component, to apply to another device."""
    cal = calibrate_profile(name, data)
    return dict(cal.scales) if cal else {}


def run(data: dict[str, Any] | None = None) -> list[PointResult]:
    """Fit every profile and predict every point (calibration points included, for the table)."""
    data = data or load()
    results = []
    for name, profile in data["profiles"].items():
        acc = get_accelerator(profile["accelerator"])
        eff = fit_profile(name, data)
        for point in (p for p in data["points"] if p["profile"] == name):
            _, value = _work(point, data, acc, eff)
            results.append(PointResult(point["id"], point["role"], name, point["kind"], point["value"],
                                       value, data["sources"][point["source"]], point["where"]))
    return results


def summary(results: list[PointResult]) -> dict[str, float]:
    """Mean and max absolute error over the validation points."""
    errors = [abs(r.error) for r in results if r.role == "validation"]
    return {"num_points": len(errors), "mean_abs_error": sum(errors) / len(errors),
            "max_abs_error": max(errors)}


def format_table(results: list[PointResult]) -> str:
    lines = [f"{'point':<38}{'role':<12}{'kind':<20}{'published':>12}{'predicted':>12}{'error':>9}"]
    for r in results:
        lines.append(f"{r.id:<38}{r.role:<12}{r.kind:<20}{r.published:>12.4g}{r.predicted:>12.4g}"
                     f"{100 * r.error:>+8.1f}%")
    s = summary(results)
    lines.append(f"validation points: {s['num_points']}, mean |error| {100 * s['mean_abs_error']:.2f}%, "
                 f"max {100 * s['max_abs_error']:.2f}%")
    return "\n".join(lines)
