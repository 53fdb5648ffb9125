"""`slipstream perf report`: the HTML report of a real training run and a real serving run, its
numbers checked against the raw records (percentiles by numpy, the goodput ledger's own summary,
the performance model's public functions called directly), the page parsed, strings from the
records escaped, and bad input turned into one-line errors."""

from __future__ import annotations

import html.parser
import json
import random
import sys
from collections import Counter, defaultdict
from statistics import median

import numpy as np
import pytest
from serve_fixtures import VOCAB_SIZE, known_calibration
from train_fixtures import small_config

from slipstream.cli import main
from slipstream.perf import hardware
from slipstream.perf.efficiency import default_efficiency
from slipstream.perf.goodput import read_ledger, summarize
from slipstream.perf.model import Layout, TrainSetup, predict_training
from slipstream.perf.serving import ServeSetup, step_time
from slipstream.perf.shapes import resolve_model
from slipstream.serve.llm import LLM
from slipstream.serve.request import SamplingParams
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures", "serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PEAK_FLOPS, PEAK_READ = 1e11, 2e10


@pytest.fixture(autouse=True)
def known_cpu(monkeypatch):
    """The CPU as a calibration with known peaks, for the engine's records and `--hardware cpu`
    alike, whatever this machine's cache holds (a new calibration takes minutes)."""
    calibration = known_calibration(PEAK_FLOPS, PEAK_READ)
    monkeypatch.setattr(hardware, "cached_calibration", lambda device: calibration)
    monkeypatch.setattr(hardware, "calibrate", lambda **kwargs: calibration)


class Page(html.parser.HTMLParser):
    """The tags, image sources and text of an HTML page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags, self.images, self.links, self.text = Counter(), [], [], []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags[tag] += 1
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        self.links += [v for k, v in attrs.items() if k in ("href", "src") and not v.startswith("data:")]

    def handle_data(self, data):
        self.text.append(data)


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def report_json(argv: list[str], capsys) -> dict:
    assert main(["perf", "report", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def error(argv: list[str], capsys) -> str:
    """The one-line error for `perf report ARGV`, after checking it exits 2 without a traceback."""
    assert main(["perf", "report", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slipstream perf: error: ") and "Traceback" not in err
    return err


def test_training_report_agrees_with_the_records(data_dir, train_model_dir, tmp_path, capsys):
    """Guards the training report: step-time and tokens/s percentiles past the warm-up, the loss,
    the goodput buckets as the ledger's own summary gives them, the prediction as
    `predict_training` gives it for the run's setup on the calibrated CPU, the measured MFU
    against the same FLOPs and peak, and a page with the three charts and no external link."""
    run_dir = tmp_path / "run"
    Trainer(small_config(data_dir, train_model_dir, run_dir, "--training.steps=7",
                         "--checkpoint.interval=3")).run()
    summary = report_json([str(run_dir)], capsys)

    trains = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in trains if r["kind"] == "train"]
    later = [r for r in trains if r["step"] > 2]
    steps_s = [r["step_s"] for r in later]
    for q in (10, 50, 90):
        assert summary["steps"]["step_s"][f"p{q}"] == pytest.approx(np.percentile(steps_s, q))
    assert summary["steps"]["tokens_per_s"]["p50"] == pytest.approx(median(r["tokens_per_s"] for r in later))
    assert summary["steps"]["loss_first"] == trains[0]["loss"]
    assert summary["steps"]["loss_last"] == trains[-1]["loss"]

    events, skipped = read_ledger(run_dir)
    ledger = summarize(events, skipped_lines=skipped)
    goodput = summary["goodput"]
    assert goodput["goodput"] == pytest.approx(ledger["goodput"])
    assert goodput["seconds"] == pytest.approx(ledger["seconds"])
    assert goodput["seconds"]["checkpoint_stall"] > 0

    acc = hardware.get_accelerator("cpu")
    setup = TrainSetup(shape=resolve_model(str(train_model_dir)), global_batch_size=4, seq_len=32,
                       micro_batch_size=4, dtype="fp32", weight_bytes=4, grad_bytes=4, optimizer_bytes=8,
                       reserved_bytes=0)
    expected = predict_training(setup, Layout(dp=1, zero_stage=0), acc, default_efficiency(acc))
    step = summary["prediction"]["step_s"]
    assert step["predicted"] == pytest.approx(expected.step_time_s)
    assert step["measured"] == pytest.approx(median(steps_s))
    assert step["error"] == pytest.approx(expected.step_time_s / median(steps_s) - 1)
    flops = 4 * 32 * setup.shape.train_flops_per_token(32)
    assert summary["prediction"]["mfu"]["measured"] == pytest.approx(flops / median(steps_s) / PEAK_FLOPS)
    assert summary["prediction"]["mfu"]["predicted"] == pytest.approx(expected.mfu)

    page = Page((run_dir / "report.html").read_text())
    assert summary["html"] == str(run_dir / "report.html") and page.links == []
    assert page.tags["table"] >= 4
    charts = 3 if has_matplotlib() else 0
    assert len(page.images) == len(summary["charts"]) == charts
    assert all(src.startswith("data:image/png;base64,iVBOR") for src in page.images)

    out = tmp_path / "elsewhere.html"
    assert main(["perf", "report", str(run_dir / "metrics.jsonl"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("training run ") and text.rstrip().endswith(f"wrote {out}") and out.is_file()


def _priced(record: dict) -> bool:
    """Whether the performance model prices the step (docs/engine.md: not mixed, and a prefill's
    chunks all of one length from position 0)."""
    return record["phase"] == "decode" or (record["phase"] == "prefill" and record["prompt_len"] is not None)


def test_serving_report_agrees_with_the_records(model_dir, tmp_path, capsys):
    """Guards the serving report of a real engine run with prefix hits and decode bursts: each
    (phase, batch) group's median time per forward pass from the raw records and the prediction
    of `serving.step_time` at its median length, latency percentiles by numpy, finish reasons,
    the prefix-cache hit rate and preemptions summed from the steps, and the four charts."""
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB_SIZE) for _ in range(32)]
    prompts = [shared + [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(1, 9))] for _ in range(6)]
    prompts += [[rng.randrange(3, VOCAB_SIZE) for _ in range(16)] for _ in range(4)]
    metrics_dir = tmp_path / "metrics"
    llm = LLM(str(model_dir), metrics_dir=str(metrics_dir), max_model_len=128)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 12), ignore_eos=True)
              for _ in prompts]
    llm.generate(prompts[:1], params[0], use_tqdm=False)
    llm.generate(prompts[1:], params[1:], use_tqdm=False)
    summary = report_json([str(metrics_dir)], capsys)

    records = [json.loads(line) for line in (metrics_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "engine_step"]
    requests = [r for r in records if r["kind"] == "request"]
    groups = defaultdict(list)
    for r in filter(_priced, steps):
        groups[r["phase"], r["batch_size"]].append(r)
    assert [(g["phase"], g["batch_size"]) for g in summary["steps"]["groups"]] == sorted(groups)
    assert summary["steps"]["num_unpriced"] == sum(not _priced(r) for r in steps)
    acc = hardware.get_accelerator("cpu")
    setup = ServeSetup(shape=resolve_model(str(model_dir)), dtype="fp32", decode_graph_max_batch=256)
    for g in summary["steps"]["groups"]:
        members, prefill = groups[g["phase"], g["batch_size"]], g["phase"] == "prefill"
        per_pass_s = [r["step_s"] / r["num_forward_passes"] for r in members]
        assert g["measured_s"] == pytest.approx(median(per_pass_s))
        length = round(median(r["prompt_len" if prefill else "context_len"] for r in members))
        lengths = {"prefill_lens" if prefill else "decode_contexts": [length] * g["batch_size"]}
        expected = step_time(setup, acc, efficiency=default_efficiency(acc), **lengths).total_s
        assert (g["length"], g["predicted_s"]) == (length, pytest.approx(expected))
        assert g["error"] == pytest.approx(expected / g["measured_s"] - 1)
    assert any(g["phase"] == "decode" for g in summary["steps"]["groups"])

    latency = summary["requests"]["latency_s"]
    for name, key in (("ttft", "time_to_first_token_seconds"), ("e2e", "e2e_request_latency_seconds"),
                      ("tpot", "request_time_per_output_token_seconds")):
        values = [r[key] for r in requests if r[key] is not None]
        assert latency[name]["count"] == len(values)
        for q in (50, 90, 99):
            assert latency[name][f"p{q}"] == pytest.approx(np.percentile(values, q))
    assert summary["requests"]["finished_reason"] == {"length": len(prompts)}
    hits, queries = sum(r["prefix_cache_hits"] for r in steps), sum(r["prefix_cache_queries"] for r in steps)
    assert hits > 0 and summary["prefix_cache_hit_rate"] == pytest.approx(hits / queries)
    assert summary["num_preemptions"] == sum(r["num_preemptions"] for r in steps)
    assert summary["steps"]["utilization"]["decode"]["mfu"] == pytest.approx(
        median(r["mfu"] for r in steps if r["phase"] == "decode"))

    page = Page((metrics_dir / "report.html").read_text())
    assert len(page.images) == len(summary["charts"]) == (4 if has_matplotlib() else 0)
    assert page.links == []


def _serving_file(tmp_path, model: str, reason: str = "stop") -> str:
    """A hand-written serving metrics file: a header naming `model`, two decode steps, a request."""
    header = {"kind": "engine_config", "model": model, "dtype": "float32", "device": "cpu", "max_num_seqs": 8}
    step = {"kind": "engine_step", "time": 1.0, "step_s": 0.002, "phase": "decode", "batch_size": 2,
            "num_forward_passes": 1, "prompt_len": None, "context_len": 10, "kv_cache_usage_perc": 0.1,
            "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0, "mfu": 0.01, "mbu": 0.2}
    request = {"kind": "request", "finished_reason": reason, "time_to_first_token_seconds": 0.01,
               "request_time_per_output_token_seconds": 0.002, "e2e_request_latency_seconds": 0.02}
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (header, step, step | {"time": 1.01}, request)))
    return str(path)


def test_strings_from_the_records_are_escaped(model_dir, tmp_path, capsys):
    """Guards the page against markup in the records: a model path and a finish reason holding
    tags are shown as text, not parsed as elements."""
    hostile = "/models/<script>alert(1)</script><img src=x>"
    path = _serving_file(tmp_path, hostile, reason="<b>stop</b>")
    report_json([path, "--model", str(model_dir)], capsys)
    text = (tmp_path / "report.html").read_text()
    page = Page(text)
    assert page.tags["script"] == 0 and page.tags["b"] == 0 and "x" not in page.images
    assert hostile in "".join(page.text) and "<b>stop</b>" in "".join(page.text)
    assert "&lt;script&gt;" in text


def test_without_matplotlib_the_tables_stay(model_dir, tmp_path, capsys, monkeypatch):
    """Guards the report where matplotlib is missing: every table, no image, and a line saying
    which charts `pip install matplotlib` would draw."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    summary = report_json([_serving_file(tmp_path, "m"), "--model", str(model_dir)], capsys)
    page = Page((tmp_path / "report.html").read_text())
    assert summary["charts"] == [] and "pip install matplotlib" in summary["charts_missing"]
    assert page.images == [] and page.tags["table"] == 5
    assert "pip install matplotlib" in "".join(page.text) and "TTFT CDF" in "".join(page.text)


def test_a_torn_last_line_is_skipped(model_dir, tmp_path, capsys):
    """Guards the reader against a process killed mid-write: the cut line is skipped."""
    path = _serving_file(tmp_path, "m")
    with open(path, "a") as f:
        f.write('{"kind": "engine_step", "step_s": 0.0')
    summary = report_json([path, "--model", str(model_dir)], capsys)
    assert summary["steps"]["num_records"] == 2 and summary["requests"]["count"] == 1


def _write(tmp_path, lines: list[dict | str]) -> str:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(tmp_path)


TRAIN_STEP = {"kind": "train", "step": 1, "step_s": 0.01, "loss": 5.0}
RUN = {"kind": "run", "device": "cpu"}
HEADER = {"kind": "engine_config", "model": "/gone", "dtype": "float32", "device": "cpu"}


@pytest.mark.parametrize("lines, extra, expected", [
    (None, [], "no metrics.jsonl there"),
    ([], [], "holds no training records"),
    (['{"kind": "tra'], [], "holds no training records"),
    ([TRAIN_STEP, HEADER], [], "mixes 1 training records"),
    ([RUN, *(TRAIN_STEP | {"step": s} for s in (1, 2))], [], "no training step past the 2 warm-up steps"),
    ([RUN, *(TRAIN_STEP | {"step": s} for s in (1, 2, 3))], [], "the run's config lacks"),
    ([RUN, *(TRAIN_STEP | {"step": s} for s in (1, 2, 3))], ["--model", "nope"], "unknown model 'nope'"),
    ([{"kind": "run", "device": "cuda:0"}, TRAIN_STEP], [], "give --hardware"),
    ([HEADER, {"kind": "request"}], ["--hardware", "a800", "--model", "llama3-8b"], "unknown accelerator"),
    ([HEADER, {"kind": "request"}], [], "model directory /gone has no config.json"),
    ([HEADER, HEADER | {"dtype": "bfloat16"}], ["--model", "llama3-8b"], "engines of several dtypes"),
    ([{"kind": "request"}], [], "no engine_config record"),
    ([TRAIN_STEP], ["--enforce-eager"], "--enforce-eager is for decode steps"),
])
def test_bad_runs_are_one_line_errors(lines, extra, expected, tmp_path, capsys):
    """Guards every bad RUN: a missing file, no records, a torn only line, both runtimes' records,
    too few steps, hardware the records do not name or the table lacks, a model directory that is
    gone, engines that disagree, no header, a training run without its config, and a serving flag
    on a training run."""
    run = _write(tmp_path, lines) if lines is not None else str(tmp_path / "missing")
    message = error([run, *extra], capsys)
    assert expected in message, message
    assert not (tmp_path / "report.html").exists()


def test_a_training_file_not_named_metrics_jsonl_is_an_error(tmp_path, capsys):
    """Guards a training run given as a renamed records file: its config and ledger are not beside
    it under their names, so the report asks for the directory rather than reading another file."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (RUN, TRAIN_STEP)))
    assert "give the directory" in error([str(path)], capsys)


def test_an_unwritable_out_is_an_error(model_dir, tmp_path, capsys):
    """Guards --out in a directory that does not exist: exit 2 and the path, no traceback."""
    path = _serving_file(tmp_path, "m")
    assert str(tmp_path / "no" / "r.html") in error([path, "--model", str(model_dir), "--out",
                                                      str(tmp_path / "no" / "r.html")], capsys)


def test_a_run_resumed_at_another_layout_reports_its_newest_attempt(tmp_path, capsys):
    """Guards the training report of a run dir whose first attempt ran 4 ranks (FSDP, TP=2) and
    whose resume ran one process: every statistic and series comes from the newest attempt's
    records, which config.toml and the prediction's layout describe, checked by numpy on those
    records alone (the first attempt's 9 s steps were mixed in)."""
    (tmp_path / "config.toml").write_text(
        "[model]\npreset = \"llama3.2-1b\"\n[data]\nseq_len = 64\n[training]\nglobal_batch_size = 2\n"
        "micro_batch_size = 1\n[parallel]\ntensor_parallel_degree = 1\n")
    first = [{"kind": "run", "device": "cpu", "world_size": 4, "strategy": "fsdp",
              "tensor_parallel_degree": 2, "sequence_parallel": True}]
    first += [{"kind": "train", "step": s, "step_s": 9.0, "tokens_per_s": 14.0, "mfu": 0.9, "loss": 9.0 - s}
              for s in range(1, 7)]
    newest = [{"kind": "run", "device": "cpu", "world_size": 1, "strategy": "single",
               "tensor_parallel_degree": 1, "sequence_parallel": False}]
    times = (1.0, 1.3, 1.1, 1.6, 1.2, 1.4)
    newest += [{"kind": "train", "step": s, "step_s": t, "tokens_per_s": 128 / t, "mfu": 0.01 * t,
                "loss": 5.0 - 0.1 * s} for s, t in zip(range(4, 10), times, strict=True)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first + newest))
    summary = report_json([str(tmp_path)], capsys)

    trains = newest[1:]
    measured = trains[2:]  # the resumed process's first two steps are its warm-up
    steps = summary["steps"]
    assert (steps["num_records"], steps["num_measured"], steps["num_earlier_layout"]) == (6, 4, 6)
    for key, name in (("step_s", "step_s"), ("tokens_per_s", "tokens_per_s"), ("mfu", "mfu_logged")):
        for q in (10, 50, 90):
            assert steps[name][f"p{q}"] == pytest.approx(np.percentile([r[key] for r in measured], q))
    assert (steps["loss_first"], steps["loss_last"]) == (trains[0]["loss"], trains[-1]["loss"])
    assert summary["prediction"]["step_s"]["measured"] == pytest.approx(median(r["step_s"] for r in measured))
    assert summary["config"]["world_size"] == 1
    text = (tmp_path / "report.html").read_text()
    assert "6 records of earlier attempts at another layout" in "".join(Page(text).text)


def test_an_out_of_range_engine_step_is_skipped(model_dir, tmp_path, capsys, caplog):
    """Guards the serving report against a step no model can run: a context of 10^7 tokens (past
    the model's max_position_embeddings) and a batch of 10^9 sequences are each skipped with one
    warning, as `perf fit` skips them, and the rest is reported."""
    path = _serving_file(tmp_path, "m")
    step = {"kind": "engine_step", "time": 1.02, "step_s": 0.002, "phase": "decode", "batch_size": 2,
            "num_forward_passes": 1, "prompt_len": None, "context_len": 10}
    with open(path, "a") as f:
        for bad in ({"context_len": 10**7}, {"batch_size": 10**9}):
            f.write(json.dumps(step | bad) + "\n")
    with caplog.at_level("WARNING", logger="slipstream.perf.records"):
        summary = report_json([path, "--model", str(model_dir)], capsys)
    skipped = [r.getMessage() for r in caplog.records if "engine_step record skipped" in r.getMessage()]
    assert len(skipped) == 2 and "max_position_embeddings" in skipped[0] and "batch_size" in skipped[1]
    groups = summary["steps"]["groups"]
    assert [(g["phase"], g["batch_size"], g["count"]) for g in groups] == [("decode", 2, 2)]
    assert (summary["steps"]["num_records"], summary["steps"]["num_unpriced"]) == (4, 2)


def test_an_unknown_gpu_is_the_same_error_for_report_and_fit(model_dir, tmp_path, capsys):
    """Guards one reading of the engine's header: a GPU the accelerator table lacks is the same
    error for `perf report` as for `perf fit --engine-records`, past the flag naming the file."""
    path = _serving_file(tmp_path, str(model_dir))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    header = json.loads(lines[0]) | {"device": "cuda:0", "hardware": "NVIDIA L4 (8 threads, calibrated)"}
    (tmp_path / "metrics.jsonl").write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    by_report = error([path], capsys)
    assert main(["perf", "fit", "--engine-records", path]) == 2
    by_fit = capsys.readouterr().err
    assert by_report.startswith(f"slipstream perf: error: RUN {path}: ")
    assert by_fit.startswith(f"slipstream perf: error: --engine-records {path}: ")
    assert by_report.split(f"{path}: ", 1)[1] == by_fit.split(f"{path}: ", 1)[1]
    assert "accelerator table does not know" in by_report


def _with_header(path: str, **fields) -> str:
    """The serving file at `path` with `fields` set in its header."""
    with open(path) as file:
        lines = file.read().splitlines()
    with open(path, "w") as file:
        file.write("\n".join([json.dumps(json.loads(lines[0]) | fields), *lines[1:]]) + "\n")
    return path


def test_tensor_parallel_records_are_priced_at_their_layout_on_gpus_and_refused_on_a_cpu(model_dir, tmp_path,
                                                                                         capsys):
    """Records of an engine split over 2 GPUs are priced at tp 2 (the model's own step time for that
    layout), by report as by fit; a CPU's split engine, whose ranks share its memory and exchange
    through shared memory, is refused rather than priced as one device."""
    path = _with_header(_serving_file(tmp_path, str(model_dir)), device="cuda:0", hardware="h100",
                        tensor_parallel_size=2, enforce_eager=True)
    [group] = report_json([path], capsys)["steps"]["groups"]
    acc = hardware.get_accelerator("h100")
    setup = ServeSetup(shape=resolve_model(str(model_dir)), dtype="fp32", tp=2)  # eager: no graph
    expected = step_time(setup, acc, decode_contexts=[10, 10], efficiency=default_efficiency(acc)).total_s
    assert group["predicted_s"] == pytest.approx(expected)
    single = ServeSetup(shape=resolve_model(str(model_dir)), dtype="fp32")
    assert expected != pytest.approx(
        step_time(single, acc, decode_contexts=[10, 10], efficiency=default_efficiency(acc)).total_s)
    assert main(["perf", "fit", "--engine-records", path, "--tp", "4"]) == 2
    assert "tensor_parallel_size 2, not --tp 4" in capsys.readouterr().err

    _with_header(path, device="cpu", hardware="test cpu")
    assert "written by an engine split over 2 CPU processes" in error([path], capsys)
