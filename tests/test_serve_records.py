"""The serving engine's JSON-lines metrics records (serve/records.py), checked against independent
facts: the RequestOutputs, token counts worked out from the prompts, closed-form FLOPs and bytes
(perf.flops), the peaks they are divided by; and read back by `slipstream.perf`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch
from serve_fixtures import (
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    VOCAB_SIZE,
    known_calibration,
    kv_bytes_for_blocks,
)

from slipstream import cli
from slipstream.model.config import ModelConfig
from slipstream.perf import flops, hardware
from slipstream.perf.records import read_engine_file, read_engine_headers
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.llm import LLM
from slipstream.serve.request import SamplingParams

pytest_plugins = ["serve_fixtures"]  # the model_dir fixture, built once
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PEAK_FLOPS, PEAK_READ = 1e11, 2e10
"""The peaks of the calibration the tests hand the engine (`known_peaks`)."""


@pytest.fixture
def known_peaks(monkeypatch):
    """A cached CPU calibration with known peaks, whatever this machine's cache holds."""
    calibration = known_calibration(PEAK_FLOPS, PEAK_READ)
    monkeypatch.setattr(hardware, "cached_calibration", lambda device: calibration)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def read_records(directory) -> list[dict]:
    """Every line of the metrics file as JSON: each must parse on its own."""
    lines = (directory / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def of_kind(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind]


def test_llm_records_agree_with_its_outputs(model_dir, tmp_path, known_peaks, caplog):
    """Guards the records of an offline run with prefix hits, chunked prompts and multi-step decode
    bursts: one request record per prompt with its RequestOutput's counts, prefill tokens summing
    to the prompts less their cached tokens, decode tokens to the outputs less the first token of
    each, every step's FLOPs summing to what perf.flops.generation_flops gives the requests, MFU and
    bandwidth use over the calibrated peaks; and `perf fit` reading the directory unchanged."""
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB_SIZE) for _ in range(32)]
    prompts = [shared + [rng.randrange(3, VOCAB_SIZE) for _ in range(5)],
               shared + [rng.randrange(3, VOCAB_SIZE) for _ in range(9)],
               [rng.randrange(3, VOCAB_SIZE) for _ in range(13)],
               [rng.randrange(3, VOCAB_SIZE) for _ in range(20)],
               shared + [7]]  # all but its last token cached: a one-token prefill that samples
    max_tokens = [7, 12, 3, 17, 4]
    llm = LLM(str(model_dir), metrics_dir=str(tmp_path), max_num_batched_tokens=32, max_model_len=128)
    outputs = llm.generate(prompts[:1], greedy(max_tokens[0]), use_tqdm=False)  # then its prefix is cached
    outputs += llm.generate(prompts[1:], [greedy(m) for m in max_tokens[1:]], use_tqdm=False)
    records = read_records(tmp_path)

    (header,) = of_kind(records, "engine_config")
    assert records[0] is header and header["model"] == str(model_dir.resolve())
    assert (header["dtype"], header["device"], header["peak_flops_per_s"], header["peak_read_bytes_per_s"]) \
        == ("float32", "cpu", PEAK_FLOPS, PEAK_READ)
    requests = of_kind(records, "request")
    assert len(requests) == len(prompts)
    by_id = {r["request_id"]: r for r in requests}
    for output in outputs:
        record, completion = by_id[output.request_id], output.outputs[0]
        assert record["request_prompt_tokens"] == len(output.prompt_token_ids)
        assert record["request_generation_tokens"] == len(completion.token_ids)
        assert record["num_cached_tokens"] == output.num_cached_tokens
        assert record["finished_reason"] == completion.finish_reason == "length"
        assert record["num_preemptions"] == 0
        assert record["time_to_first_token_seconds"] == pytest.approx(output.metrics.time_to_first_token_s)
        assert record["e2e_request_latency_seconds"] == pytest.approx(output.metrics.e2e_latency_s)
    cached = [o.num_cached_tokens for o in outputs]
    assert cached == [0, 32, 0, 0, 32]  # the shared prefix's two blocks of 16

    steps = of_kind(records, "engine_step")
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert sum(s["num_prefill_tokens"] for s in steps) == sum(len(p) for p in prompts) - sum(cached)
    assert sum(s["num_decode_tokens"] for s in steps) == sum(max_tokens) - len(prompts)
    assert sum(s["prefix_cache_hits"] for s in steps) == sum(cached)
    assert sum(s["prefix_cache_queries"] for s in steps) == sum(len(p) for p in prompts)
    assert {s["phase"] for s in steps} == {"prefill", "decode", "mixed"}
    assert max(s["num_forward_passes"] for s in steps) > 1  # LLM runs greedy decode steps in bursts
    assert steps[-1]["num_requests_running"] == steps[-1]["num_requests_waiting"] == 0
    config = ModelConfig.from_pretrained(model_dir)
    expected = sum(flops.generation_flops(config, len(p), m) - flops.generation_flops(config, c, 0)
                   for p, m, c in zip(prompts, max_tokens, cached, strict=True))
    assert sum(s["flops"] for s in steps) == expected
    assert max(s["kv_cache_usage_perc"] for s in steps) > 0 == steps[-1]["kv_cache_usage_perc"]
    for s in steps:
        assert 0 <= s["kv_cache_usage_perc"] <= 1
        assert s["flops_per_s"] == pytest.approx(s["flops"] / s["step_s"])
        assert s["mfu"] == pytest.approx(s["flops"] / s["step_s"] / PEAK_FLOPS)
        assert s["mbu"] == pytest.approx(s["read_bytes"] / s["step_s"] / PEAK_READ)

    priced = [s for s in steps if s["phase"] == "decode" or s["prompt_len"] is not None]
    with caplog.at_level("INFO", logger="slipstream.perf.records"):
        read = read_engine_file(tmp_path / "metrics.jsonl")
    assert len(read) == len(priced) < len(steps)
    assert [r.step_s for r in read] == pytest.approx([s["step_s"] / s["num_forward_passes"] for s in priced])
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # mixed steps are counted, not warned
    assert f"{len(steps) - len(priced)} engine steps of several shapes skipped" in caplog.text

    with (tmp_path / "metrics.jsonl").open("a") as file:  # a writer killed mid-line
        file.write('{"kind": "engine_step", "phase": "dec')
    out = tmp_path / "efficiency.json"
    assert cli.main(["perf", "fit", "--hardware", "h100", "--engine-records", str(tmp_path),
                     "--out", str(out), "--json"]) == 0  # model and dtype from the header
    assert "gemm_fraction" in json.loads(out.read_text())


def test_step_shapes_flops_and_bytes_in_closed_form(model_dir, tmp_path, known_peaks):
    """Guards one prefill step and two decode bursts of equal prompts: their shape fields, FLOPs
    equal to perf.flops' per-request and per-token closed forms, the prefill's bytes read to the
    safetensors file's weights (of the embedding table only the prompts' rows) and the prompts' KV
    positions, each pass of a burst one decode step."""
    engine = Engine(EngineConfig(model=str(model_dir), metrics_dir=tmp_path, num_scheduler_steps=3,
                                 enable_prefix_caching=False, max_model_len=64))
    rng = random.Random(1)
    batch, prompt_len = 3, 10
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(3, VOCAB_SIZE) for _ in range(prompt_len)], greedy(6))
    while engine.has_unfinished_requests():
        engine.step()
    prefill, burst, tail = of_kind(read_records(tmp_path), "engine_step")
    config = ModelConfig.from_pretrained(model_dir)

    assert (prefill["phase"], prefill["batch_size"], prefill["prompt_len"], prefill["num_forward_passes"]) \
        == ("prefill", batch, prompt_len, 1)
    assert prefill["flops"] == batch * flops.generation_flops(config, prompt_len, 1)
    weights = safetensors.torch.load_file(model_dir / "model.safetensors")
    assert "lm_head.weight" in weights  # untied: the table is read only at the prompt's rows
    weight_bytes = 4 * sum(w.numel() for name, w in weights.items() if name != "model.embed_tokens.weight")
    row_bytes, kv_bytes = 4 * config.hidden_size, 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4
    assert prefill["read_bytes"] == weight_bytes + batch * prompt_len * (row_bytes + kv_bytes)
    # Tokens 2-4 in one burst of 3 passes, at contexts 10, 11 and 12; then tokens 5 and 6.
    for record, first_context, passes in ((burst, prompt_len, 3), (tail, prompt_len + 3, 2)):
        contexts = [first_context + j for j in range(passes)]
        shape = (record["phase"], record["batch_size"], record["num_forward_passes"])
        assert shape == ("decode", batch, passes)
        assert record["context_len"] == round(sum(contexts) / passes)
        assert record["num_decode_tokens"] == batch * passes and record["num_prefill_tokens"] == 0
        assert record["flops"] == batch * sum(flops.forward_flops_per_token(config, c + 1) for c in contexts)
        assert record["read_bytes"] == pytest.approx(
            sum(flops.decode_bytes_per_step(config, "float32", batch, c + 1) for c in contexts), rel=1e-12)
        assert record["mfu"] == pytest.approx(record["flops"] / record["step_s"] / PEAK_FLOPS)


def test_preemption_recomputes_as_prefill(model_dir, tmp_path):
    """Guards the token counts under a preemption: the victim's recomputation (prompt and outputs
    so far, read off its streamed outputs) counts as prefill, its next token comes from that
    prefill, and the lost work shows in the FLOPs as perf.flops.generation_flops of it."""
    engine = Engine(EngineConfig(model=str(model_dir), metrics_dir=tmp_path, block_size=4, max_model_len=16,
                                 kv_cache_memory=kv_bytes_for_blocks(6, 4), enable_prefix_caching=False))
    rng = random.Random(2)
    prompts = {name: [rng.randrange(3, VOCAB_SIZE) for _ in range(6)] for name in ("a", "b")}
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, greedy(10))
    num_tokens, outputs_at_preemption = {"a": 0, "b": 0}, []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        step = of_kind(read_records(tmp_path), "engine_step")[-1]
        if step["num_preemptions"]:  # the later request, b, is the one preempted
            assert step["num_preemptions"] == 1 and "b" not in [o.request_id for o in outputs]
            outputs_at_preemption.append(num_tokens["b"])
        for output in outputs:
            num_tokens[output.request_id] = len(output.outputs[0].token_ids)
    records = read_records(tmp_path)
    steps, requests = of_kind(records, "engine_step"), of_kind(records, "request")
    assert outputs_at_preemption, "the KV budget was meant to force a preemption"
    preemptions = {r["request_id"]: r["num_preemptions"] for r in requests}
    assert preemptions == {"a": 0, "b": len(outputs_at_preemption)}
    recomputed = sum(6 + n for n in outputs_at_preemption)
    assert sum(s["num_prefill_tokens"] for s in steps) == 12 + recomputed
    assert sum(s["num_decode_tokens"] for s in steps) == 2 * 10 - 2 - len(outputs_at_preemption)
    config = ModelConfig.from_pretrained(model_dir)
    lost = sum(flops.generation_flops(config, 6 + n - 1, 0) for n in outputs_at_preemption)
    assert sum(s["flops"] for s in steps) == 2 * flops.generation_flops(config, 6, 10) + lost


def test_aborted_requests_are_recorded(model_dir, tmp_path):
    """Guards abort records: one aborted while waiting (no queue time, no first token), one
    aborted after its first tokens (their count, its times)."""
    engine = Engine(EngineConfig(model=str(model_dir), metrics_dir=tmp_path, max_num_seqs=1,
                                 max_model_len=64))
    engine.add_request("running", [5, 6, 7], greedy(20))
    engine.add_request("waiting", [8, 9], greedy(20))
    engine.step()
    engine.step()
    engine.abort_request(["running", "waiting"])
    records = {r["request_id"]: r for r in of_kind(read_records(tmp_path), "request")}
    assert records["running"]["finished_reason"] == records["waiting"]["finished_reason"] == "abort"
    assert records["running"]["request_generation_tokens"] == 2
    assert records["running"]["time_to_first_token_seconds"] > 0
    assert records["running"]["request_time_per_output_token_seconds"] > 0
    assert records["waiting"]["request_generation_tokens"] == 0
    assert records["waiting"]["request_queue_time_seconds"] is None
    assert records["waiting"]["time_to_first_token_seconds"] is None


def test_embedding_records(model_dir, tmp_path):
    """Guards a pooling engine's records: one request record per prompt with no output tokens,
    prefill steps computing every prompt token, FLOPs without the lm_head, as
    perf.flops.generation_flops counts a prompt that generates nothing, and bytes read without it
    too: the weights in the model's safetensors file but the embedding table (of which the tokens'
    rows) and the lm_head, and the KV positions of the prompts."""
    llm = LLM(str(model_dir), runner="pooling", metrics_dir=str(tmp_path), max_model_len=64)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 41))]
    llm.embed(prompts, use_tqdm=False)
    records = read_records(tmp_path)
    requests, steps = of_kind(records, "request"), of_kind(records, "engine_step")
    assert records[0]["runner"] == "pooling"
    assert sorted((r["request_prompt_tokens"], r["request_generation_tokens"], r["finished_reason"])
                  for r in requests) == [(5, 0, "stop"), (21, 0, "stop")]
    assert {s["phase"] for s in steps} == {"prefill"}
    assert sum(s["num_prefill_tokens"] for s in steps) == 26
    config = ModelConfig.from_pretrained(model_dir)
    assert sum(s["flops"] for s in steps) == sum(flops.generation_flops(config, len(p), 0) for p in prompts)
    weights = safetensors.torch.load_file(model_dir / "model.safetensors")
    layer_bytes = 4 * sum(w.numel() for name, w in weights.items()
                          if name not in ("model.embed_tokens.weight", "lm_head.weight"))
    row_bytes, kv_bytes = 4 * config.hidden_size, 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4
    assert "lm_head.weight" in weights  # untied: counting it would be visible
    assert sum(s["read_bytes"] for s in steps) == len(steps) * layer_bytes + 26 * (row_bytes + kv_bytes)


def test_no_calibration_means_no_mfu(model_dir, tmp_path, monkeypatch, caplog):
    """Guards the engine against calibrating (minutes) for its records: without a cached
    calibration MFU and bandwidth use are null and the header and a warning (seen at `slipstream
    serve`'s default level) say how to get them. Also: a prompt's two completions are two request
    records."""
    monkeypatch.setattr(hardware, "cached_calibration", lambda device: None)
    monkeypatch.setattr(hardware, "calibrate", lambda **kwargs: pytest.fail("the engine calibrated"))
    with caplog.at_level("WARNING", logger="slipstream.serve.records"):
        llm = LLM(str(model_dir), metrics_dir=str(tmp_path / "new" / "dir"), max_model_len=64)
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "without MFU and bandwidth use" in warning.message
    assert "slipstream perf calibrate" in warning.message
    params = SamplingParams(n=2, temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    records = read_records(tmp_path / "new" / "dir")
    assert records[0]["peak_flops_per_s"] is None and "slipstream perf calibrate" in records[0]["peak_source"]
    requests = of_kind(records, "request")  # one per completion, as vLLM counts them
    assert sorted((r["request_id"], r["index"], r["request_generation_tokens"]) for r in requests) == [
        ("0", 0, 3), ("0", 1, 3)]
    steps = of_kind(records, "engine_step")
    assert steps and all(s["mfu"] is None and s["mbu"] is None and s["flops"] > 0 for s in steps)


def test_records_are_off_by_default(model_dir, tmp_path, monkeypatch):
    """Guards the default: an engine without metrics_dir writes no file."""
    monkeypatch.chdir(tmp_path)
    LLM(str(model_dir), max_model_len=64).generate([[5, 6, 7]], greedy(3), use_tqdm=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("metrics_dir, message", [
    (5, "metrics_dir must be a directory path or None, got 5"),
    ("", "metrics_dir must be a directory path or None, got ''"),
    ("FILE", "is a file, not a directory"),
    ("FILE/sub", "cannot be made: .*/file is a file"),
    ("HOLDS_DIR", "holds a directory named metrics.jsonl"),
])
def test_bad_metrics_dir_is_a_value_error(model_dir, tmp_path, metrics_dir, message):
    """Guards EngineConfig's check of metrics_dir: no path, a path that is a file or lies under
    one, a directory where the records file goes."""
    if isinstance(metrics_dir, str) and metrics_dir.startswith("FILE"):
        (tmp_path / "file").write_text("")
        metrics_dir = tmp_path / metrics_dir.replace("FILE", "file")
    elif metrics_dir == "HOLDS_DIR":
        (tmp_path / "metrics.jsonl").mkdir()
        metrics_dir = tmp_path
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(model_dir), metrics_dir=metrics_dir)


def test_serve_flag_reaches_the_engine_config(model_dir, tmp_path, monkeypatch):
    """Guards `slipstream serve --metrics-dir`: the server's engine config carries it."""
    from slipstream.serve import server

    started = []
    monkeypatch.setattr(server, "run_server", lambda config, *args, **kwargs: started.append(config))
    assert cli.main(["serve", str(model_dir), "--metrics-dir", str(tmp_path)]) == 0
    assert started[0].metrics_dir == str(tmp_path)


def test_perf_fit_refuses_headers_that_disagree(tmp_path, capsys):
    """Guards `perf fit`'s defaults from the engine's header: engines of two dtypes wrote the
    file, so --dtype must be given (the error names the engines by engine_id); a model directory
    that is gone must be named by --model."""
    step = {"kind": "engine_step", "phase": "decode", "batch_size": 1, "context_len": 8, "step_s": 0.01}
    headers = [{"kind": "engine_config", "engine_id": engine_id, "model": str(tmp_path / "gone"),
                "dtype": dtype} for engine_id, dtype in (("e1", "float32"), ("e2", "bfloat16"),
                                                         ("e3", "float32"))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*headers, step]))
    fit = ["perf", "fit", "--hardware", "h100", "--engine-records", str(tmp_path)]
    assert cli.main([*fit, "--model", "tiny"]) == 2
    assert ("written by engines of several dtypes: bfloat16 (engines e2); float32 (engines e1, e3); "
            "give --dtype") in capsys.readouterr().err
    assert cli.main([*fit, "--dtype", "bf16"]) == 2  # the other commands' default, given
    assert f"the engine's model directory {tmp_path / 'gone'} has no config.json" in capsys.readouterr().err
    assert cli.main([*fit, "--dtype", "bf16", "--model", "tiny"]) == 0


FULL_DISK_SCRIPT = textwrap.dedent("""
    import gc, json, logging, os, resource, signal, sys
    import torch
    from slipstream.serve.engine import Engine, EngineConfig
    from slipstream.serve.request import SamplingParams

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    model_dir, metrics_dir = sys.argv[1:]
    engine = Engine(EngineConfig(model=model_dir, metrics_dir=metrics_dir, max_model_len=64, max_num_seqs=2))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for name, prompt in (("a", [5, 6, 7]), ("b", [8, 9]), ("c", [10, 11, 12, 13])):
        engine.add_request(name, prompt, params)
    engine.step()  # a and b start, c waits
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead
    size = os.path.getsize(os.path.join(metrics_dir, "metrics.jsonl"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, resource.RLIM_INFINITY))  # the disk fills
    ended = {}
    for output in engine.step() + engine.abort_request(["b", "c"]):
        ended[output.request_id] = output.outputs[0].finish_reason
    while engine.has_unfinished_requests():
        for output in engine.step():
            ended[output.request_id] = (output.outputs[0].finish_reason, len(output.outputs[0].token_ids))
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    engine.add_request("d", [14, 15], params)  # the disk has room again: the records stay off
    while engine.has_unfinished_requests():
        for output in engine.step():
            ended[output.request_id] = (output.outputs[0].finish_reason, len(output.outputs[0].token_ids))
    print(json.dumps({"ended": ended, "used_blocks": engine.scheduler.kv_cache.num_used_blocks,
                      "running": engine.num_running, "waiting": engine.num_waiting}))
    del engine
    gc.collect()  # the engine has no close: collected, its records log what they dropped
""")


def test_a_full_disk_never_fails_serving(model_dir, tmp_path):
    """Guards serving against its metrics file: the disk fills (RLIMIT_FSIZE, in a process of its
    own) in the middle of a record, and every request still runs to its end or is aborted with its
    KV blocks freed; one warning names the file and the error, the engine goes on without records
    (also once the disk has room again) and says how many it dropped when collected. The next
    engine to append ends the torn line before its header, which perf then reads."""
    result = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(model_dir), str(tmp_path)],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads(result.stdout)
    assert state == {"ended": {"a": ["length", 8], "b": "abort", "c": "abort", "d": ["length", 8]},
                     "used_blocks": 0, "running": 0, "waiting": 0}
    path = tmp_path / "metrics.jsonl"
    # a machine without a cached calibration also warns that the records will have no MFU
    warnings = [line for line in result.stderr.splitlines()
                if line.startswith("WARNING") and "without MFU" not in line]
    assert len(warnings) == 2, result.stderr
    assert f"writing {path} failed ([Errno 27] File too large)" in warnings[0]
    num_dropped = int(warnings[1].split()[1])
    assert warnings[1] == f"WARNING {num_dropped} metrics records were not written to {path} " \
                          "(the first failed write is logged above)"
    assert num_dropped >= 4 + 8  # the four requests' records, and a's and d's decode steps at least
    raw = path.read_bytes()
    assert not raw.endswith(b"\n")  # the record the disk filled in is torn
    Engine(EngineConfig(model=str(model_dir), metrics_dir=tmp_path, max_model_len=64))
    lines = path.read_text().splitlines()
    torn = [line for line in lines if not line.startswith("{") or not line.endswith("}")]
    assert len(torn) == 1 and len(torn[0]) == 10
    assert [json.loads(line)["kind"] for line in lines if line not in torn] == [
        "engine_config", "engine_step", "engine_config"]
    assert len(read_engine_headers(path)) == 2  # perf skips the torn line, not the header after it


def test_an_unwritable_file_is_a_value_error_at_start(model_dir, tmp_path):
    """Guards an engine whose metrics file cannot be written from its first record (a full device):
    a ValueError naming metrics_dir when the engine is built, not an OSError at its first step."""
    os.symlink("/dev/full", tmp_path / "metrics.jsonl")
    with pytest.raises(ValueError, match=rf"metrics_dir '{tmp_path}': cannot append to .*No space left"):
        Engine(EngineConfig(model=str(model_dir), metrics_dir=str(tmp_path), max_model_len=64))


def test_engines_sharing_a_directory_are_told_apart(model_dir, tmp_path):
    """Guards two engines appending to one file: every record names its engine's `engine_id` (a
    distinct one per engine), so that each engine's steps number 1, 2, ... and its request ids,
    which repeat across engines, are its own."""
    first, second = (LLM(str(model_dir), metrics_dir=str(tmp_path), max_model_len=64, max_num_seqs=seqs)
                     for seqs in (1, 4))
    first.generate([[5, 6, 7]], greedy(3), use_tqdm=False)
    second.generate([[5, 6, 7, 8], [9, 10]], greedy(4), use_tqdm=False)
    first.generate([[11, 12]], greedy(2), use_tqdm=False)
    records = read_records(tmp_path)
    headers = of_kind(records, "engine_config")
    ids = {h["max_num_seqs"]: h["engine_id"] for h in headers}
    assert len(headers) == 2 and len(set(ids.values())) == 2
    assert {r["engine_id"] for r in records} == set(ids.values())
    for seqs, requests in ((1, [("0", 3), ("1", 2)]), (4, [("0", 4), ("1", 4)])):
        mine = [r for r in records if r["engine_id"] == ids[seqs]]
        steps = of_kind(mine, "engine_step")
        assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
        assert sorted((r["request_id"], r["request_generation_tokens"]) for r in of_kind(mine, "request")) \
            == requests


def engine_file(directory, header: dict, steps: list[dict]) -> str:
    """A metrics directory holding `header` (an engine_config record) and `steps`."""
    records = [{"kind": "engine_config", "engine_id": "e1"} | header]
    records += [{"kind": "engine_step"} | step for step in steps]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(directory)


def test_perf_takes_the_hardware_from_the_header(model_dir, tmp_path, known_peaks, monkeypatch, capsys):
    """Guards `perf fit` and `perf roofline --records` against pricing an engine's steps on other
    hardware than it ran on: a CPU engine's records are priced against this CPU (`perf.hardware`'s
    calibration, not the H100 default), a GPU's against its datasheet entry, an unknown GPU is an
    error asking for --hardware; both take model and dtype from the header too, giving what the
    explicit flags give; and a fit whose multipliers hit their bounds says so."""
    calibration = hardware.cached_calibration("cpu")
    monkeypatch.setattr(hardware, "calibrate", lambda **kwargs: calibration)
    cpu_name = hardware.local_accelerator(calibration).name
    decode = [{"phase": "decode", "batch_size": b, "context_len": 16, "step_s": 1e-3 * (1 + b / 8)}
              for b in (1, 2, 4, 8)]
    cases = [("cpu", None, cpu_name), ("cuda:0", "H100 SXM", "H100 SXM"), ("cuda:1", "NVIDIA A100-SXM4-80GB",
                                                                         "A100 SXM 80GB")]
    for i, (device, name, expected) in enumerate(cases):
        directory = tmp_path / str(i)
        directory.mkdir()
        records = engine_file(directory, {"model": str(model_dir), "dtype": "float32", "device": device,
                                          "hardware": name}, decode)
        assert cli.main(["perf", "fit", "--engine-records", records, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["hardware"] == expected
        roofline = ["perf", "roofline", "--context", "16", "--input-len", "16", "--batch", "1", "--json"]
        assert cli.main([*roofline, "--records", records]) == 0
        implied = json.loads(capsys.readouterr().out)
        assert cli.main([*roofline, "--records", records, "--model", str(model_dir), "--dtype", "float32",
                         "--hardware", "cpu" if device == "cpu" else expected]) == 0
        assert implied == json.loads(capsys.readouterr().out) and implied["hardware"] == expected
        assert len(implied["points"]) == 2 + len(decode)

    records = engine_file(tmp_path, {"model": str(model_dir), "dtype": "float32", "device": "cuda:0",
                                     "hardware": "Some GPU (calibrated)"}, decode)
    assert cli.main(["perf", "fit", "--engine-records", records]) == 2
    assert "the engine ran on cuda:0 (Some GPU (calibrated)), which the accelerator table does not know; " \
           "give --hardware" in capsys.readouterr().err
    assert cli.main(["perf", "fit", "--engine-records", records, "--hardware", "h100", "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)  # a 2-layer model's steps take milliseconds on no H100
    assert fitted["calibration"]["scales"]["memory_s"] == 20.0
    assert any("memory multiplier sits at its bound 20" in w for w in fitted["warnings"])


def test_step_cost_functions_against_brute_force():
    """Guards perf.flops' chunk counts against position-by-position sums, with a sliding window
    and without: keys attended, KV positions read (the union of the queries' windows), and bytes
    over several passes."""
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    for config, window in ((ModelConfig(model_type="mistral", sliding_window=5, **shape), 5),
                           (ModelConfig(**shape), 10**9)):
        for start in range(12):
            for num_tokens in range(8):
                positions = range(start, start + num_tokens)
                keys = sum(min(p + 1, window) for p in positions)
                assert flops.causal_keys(config, start, num_tokens) == keys
                read = set().union(*(range(max(0, p - window + 1), p + 1) for p in positions))
                assert flops.kv_positions_read(config, start, num_tokens) == len(read)
        one_pass = flops.forward_bytes_read(config, "float32", 3, 0)
        assert flops.forward_bytes_read(config, "float32", 3, 7, num_passes=4) == (
            4 * one_pass + 7 * flops.kv_cache_bytes_per_token(config, "float32"))


def test_an_eager_engines_steps_are_priced_eagerly(model_dir, tmp_path, known_peaks, monkeypatch, capsys):
    """An engine built with enforce_eager=True says so in its header, and `perf roofline --records`
    and `perf fit` price its decode steps module by module, as --enforce-eager would, not as the
    CPU decode graph's replays (which they did, the header being silent)."""
    calibration = hardware.cached_calibration("cpu")
    monkeypatch.setattr(hardware, "calibrate", lambda **kwargs: calibration)
    llm = LLM(str(model_dir), metrics_dir=tmp_path / "real", enforce_eager=True)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert read_engine_headers(tmp_path / "real" / "metrics.jsonl")[0]["enforce_eager"] is True
    decode = [{"phase": "decode", "batch_size": b, "context_len": 16, "step_s": 1e-3 * (1 + b / 8)}
              for b in (1, 2, 4, 8)]
    roofline = ["roofline", "--context", "16", "--input-len", "16", "--batch", "1", "--records"]
    outputs = {}
    for eager in (False, True):
        directory = tmp_path / str(eager)
        directory.mkdir()
        records = engine_file(directory, {"model": str(model_dir), "dtype": "float32", "device": "cpu",
                                          "enforce_eager": eager}, decode)
        for command in (["fit", "--engine-records", records], [*roofline, records]):
            assert cli.main(["perf", *command, "--json"]) == 0
            outputs[eager, command[0]] = json.loads(capsys.readouterr().out)
    records = engine_file(tmp_path, {"model": str(model_dir), "dtype": "float32", "device": "cpu"}, decode)
    assert cli.main(["perf", *roofline, records, "--enforce-eager", "--json"]) == 0
    assert outputs[True, "roofline"] == json.loads(capsys.readouterr().out) != outputs[False, "roofline"]
    assert outputs[True, "fit"] != outputs[False, "fit"]


def test_a_cpu_engines_records_are_priced_at_its_thread_count(model_dir, tmp_path, known_peaks,
                                                              monkeypatch, capsys):
    """The CPU's peaks depend on the threads it runs (a calibration per thread count): a CPU engine's
    header names the count it ran with, and `perf fit` prices its records against the calibration
    at that count, not at the perf process's, which it leaves as it was."""
    import torch

    LLM(str(model_dir), metrics_dir=tmp_path / "real").generate([[5, 6, 7]], greedy(1), use_tqdm=False)
    header = read_engine_headers(tmp_path / "real" / "metrics.jsonl")[0]
    assert header["num_threads"] == torch.get_num_threads()
    calibration = hardware.cached_calibration("cpu")
    seen = []

    def calibrate(**kwargs):
        seen.append(torch.get_num_threads())
        return calibration

    monkeypatch.setattr(hardware, "calibrate", calibrate)
    decode = [{"phase": "decode", "batch_size": b, "context_len": 16, "step_s": 1e-3 * (1 + b / 8)}
              for b in (1, 2, 4, 8)]
    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    records = engine_file(tmp_path, {"model": str(model_dir), "dtype": "float32", "device": "cpu",
                                     "num_threads": other}, decode)
    assert cli.main(["perf", "fit", "--engine-records", records, "--json"]) == 0
    capsys.readouterr()
    assert seen == [other] and torch.get_num_threads() == threads
