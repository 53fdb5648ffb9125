"""The serving engine's JSON-lines metrics records (serve/records.py), checked against independent
facts: the RequestOutputs, token counts worked out from the prompts, closed-form FLOPs and bytes
(perf.flops), the peaks they are divided by; and read back by `slipstream.perf`."""

from __future__ import annotations

import json
import random

import pytest
from serve_fixtures import VOCAB_SIZE, kv_bytes_for_blocks

from slipstream import cli
from slipstream.model.config import ModelConfig
from slipstream.perf import flops, hardware
from slipstream.perf.records import read_engine_file
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
    calibration = hardware.Calibration(
        device="cpu", device_name="test cpu", torch_version="x", num_threads=1,
        matmul_flops_per_s={"fp32": {"onednn": PEAK_FLOPS}}, matmul_errors={},
        memory_read_bytes_per_s=PEAK_READ, memory_copy_bytes_per_s=PEAK_READ, cache_read_bytes_per_s={},
        quick=False, elapsed_s=1.0, created_at="2026-12-06T00:00:00")
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
    equal to perf.flops' per-request and per-token closed forms, bytes read to
    decode_bytes_per_step's, each pass of a burst one decode step."""
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
    assert prefill["read_bytes"] == (flops.decode_bytes_per_step(config, "float32", batch * prompt_len, 0)
                                     + batch * prompt_len * flops.kv_cache_bytes_per_token(config, "float32"))
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
    prefill steps computing every prompt token, and FLOPs without the lm_head, as
    perf.flops.generation_flops counts a prompt that generates nothing."""
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


def test_no_calibration_means_no_mfu(model_dir, tmp_path, monkeypatch):
    """Guards the engine against calibrating (minutes) for its records: without a cached
    calibration MFU and bandwidth use are null and the header says how to get them. Also: a
    prompt's two completions are two request records."""
    monkeypatch.setattr(hardware, "cached_calibration", lambda device: None)
    monkeypatch.setattr(hardware, "calibrate", lambda **kwargs: pytest.fail("the engine calibrated"))
    llm = LLM(str(model_dir), metrics_dir=str(tmp_path / "new" / "dir"), max_model_len=64)
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
])
def test_bad_metrics_dir_is_a_value_error(model_dir, tmp_path, metrics_dir, message):
    """Guards EngineConfig's check of metrics_dir: no path, or a path that is a file."""
    if metrics_dir == "FILE":
        metrics_dir = tmp_path / "file"
        metrics_dir.write_text("")
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
    file, so --dtype must be given; a model directory that is gone must be named by --model."""
    step = {"kind": "engine_step", "phase": "decode", "batch_size": 1, "context_len": 8, "step_s": 0.01}
    headers = [{"kind": "engine_config", "model": str(tmp_path / "gone"), "dtype": dtype}
               for dtype in ("float32", "bfloat16")]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*headers, step]))
    fit = ["perf", "fit", "--hardware", "h100", "--engine-records", str(tmp_path)]
    assert cli.main([*fit, "--model", "tiny"]) == 2
    assert "written by engines of several dtypes (bfloat16, float32); give --dtype" in capsys.readouterr().err
    assert cli.main([*fit, "--dtype", "bf16"]) == 2  # the other commands' default, given
    assert f"the engine's model directory {tmp_path / 'gone'} has no config.json" in capsys.readouterr().err
    assert cli.main([*fit, "--dtype", "bf16", "--model", "tiny"]) == 0


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
