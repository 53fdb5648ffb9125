"""`slipstream perf serve` (and the other serving commands) as the engine would run the request:
its KV budget, the model's positions, fp8's KV cache and the decode graph."""

from __future__ import annotations

import dataclasses
import json

import pytest

from slipstream.perf import commands, serving
from slipstream.perf.accelerators import get_accelerator
from slipstream.perf.serving import ServeSetup, step_time
from slipstream.perf.shapes import resolve_model

pytest_plugins = ["serve_fixtures"]

H100 = get_accelerator("h100")
LLAMA8B = resolve_model("llama3-8b")


def _args(*argv: str, **extra):
    """`perf ARGV` as the CLI parses it, with `extra` attributes set."""
    from slipstream.cli import build_parser

    args = build_parser().parse_args(["perf", *argv])
    for name, value in extra.items():
        setattr(args, name, value)
    return args


def _error(argv: list[str], capsys) -> str:
    """The one-line error `slipstream perf` prints for `argv`, after checking it exits 2."""
    from slipstream.cli import main

    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["perf", *argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("budget", ["80e9", "1e30"])
def test_kv_cache_memory_beyond_the_device_names_the_flag(budget, capsys):
    """`--kv-cache-memory 80e9` beside Llama-3 8B's 16.1 GB of weights is more than an H100's
    85.5 GB: refused in one line naming the flag (the engine would run out of memory allocating
    it), not a KV cache of 7.6e27 tokens."""
    err = _error(["serve", "--model", "llama3-8b", "--hardware", "h100", "--kv-cache-memory", budget], capsys)
    assert f"--kv-cache-memory {float(budget):g}: a KV cache of" in err
    assert "does not fit beside llama3-8b's 16.1 GB of weights" in err and "H100 SXM's 85.5 GB" in err


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--context", "200000", "--input-len", "200000", "--output-len", "1000"],
     "--context 200000 (and the new token) needs 200,001 positions"),
    (["serve", "--context", "131072"], "--context 131072 (and the new token) needs 131,073 positions"),
    (["serve", "--input-len", "131000", "--output-len", "256"], "--input-len + --output-len needs 131,256"),
    (["roofline", "--input-len", "131073"], "--input-len needs 131,073 positions"),
    (["whatif", "--serve", "--context", "140000"], "--context 140000 (and the new token) needs"),
    (["plan", "--serve", "--devices", "8", "--input-len", "131072", "--output-len", "1"],
     "--input-len + --output-len needs 131,073"),
])
def test_lengths_beyond_max_position_embeddings_name_the_flag(argv, expected, capsys):
    """Llama-3.1 8B has 131,072 positions (its config's max_position_embeddings, the engine's
    max_model_len at most): a longer context or prompt and output is refused naming the flag."""
    err = _error([*argv, "--model", "llama3-8b", "--hardware", "h200"], capsys)
    assert expected in err and "llama3-8b's max_position_embeddings (131,072)" in err, err


def test_fp8_serving_keeps_a_16_bit_kv_cache_unless_asked():
    """`--dtype fp8`: the KV cache stays bf16 (vLLM's kv_cache_dtype "auto"), 128 KiB per token
    of Llama-3 8B, and `--kv-cache-dtype fp8_e4m3` (vLLM's flag) halves it; the weights are 1-byte
    linears beside a 16-bit embedding and lm_head (9.08 GB)."""
    _, auto = commands.serve(_args("serve", "--dtype", "fp8", "--batch", "1"))
    assert auto["kv_capacity"]["kv_bytes_per_token_per_device"] == 131072
    assert auto["kv_capacity"]["weights_bytes_per_device"] == 9_081_200_640
    _, fp8 = commands.serve(_args("serve", "--dtype", "fp8", "--batch", "1", kv_cache_dtype="fp8_e4m3"))
    assert fp8["kv_capacity"]["kv_bytes_per_token_per_device"] == 65536
    assert fp8["decode_s_per_token"] < auto["decode_s_per_token"]
    with pytest.raises(ValueError, match="--kv-cache-dtype: unknown KV cache dtype 'int3'"):
        commands.serve(_args("serve", kv_cache_dtype="int3"))


def test_decode_is_modelled_as_the_engine_replays_it():
    """The engines replay decode steps from a graph unless enforce_eager (CUDA graphs for up to
    max_num_seqs sequences; on a CPU the C decode graph, up to 256 fp32 or bf16 sequences), so
    `perf serve` prices decode batches up to that without the layers' launch costs by default,
    and as before (eager) with --enforce-eager."""
    argv = ("serve", "--batch", "1,8,300", "--max-num-seqs", "256")
    _, graphed = commands.serve(_args(*argv))
    _, eager = commands.serve(_args(*argv, enforce_eager=True))
    for setup_batch, record in ((256, graphed), (0, eager)):
        setup = ServeSetup(shape=LLAMA8B, decode_graph_max_batch=setup_batch)
        for row in record["decode"]:
            expected = step_time(setup, H100, decode_contexts=[1024] * row["batch_size"]).total_s
            assert row["decode_s_per_token"] == pytest.approx(expected, rel=1e-12)
    rows = [(g["decode_s_per_token"], e["decode_s_per_token"])
            for g, e in zip(graphed["decode"], eager["decode"], strict=True)]
    assert rows[0][0] < rows[0][1] and rows[1][0] < rows[1][1] and rows[2][0] == rows[2][1]
    assert commands.decode_graph_max_batch(_args("serve", "--max-num-seqs", "64")) == 64
    roofline = _args("roofline", "--hardware", "h100")  # unset, roofline takes it from --records' header
    assert commands.decode_graph_max_batch(roofline) == commands.MAX_NUM_SEQS == 256
    for dtype, expected in (("fp32", 256), ("bf16", 256), ("fp16", 0)):
        args = _args("roofline", "--hardware", "cpu", "--dtype", dtype)
        assert commands.decode_graph_max_batch(args) == expected
        args.enforce_eager = True
        assert commands.decode_graph_max_batch(args) == 0


@pytest.mark.parametrize("argv, expected", [
    (["plan"], "add --serve to plan serving"),
    (["whatif"], "add --serve for a decode step"),
    (["fit", "--run-dir", "no-such-run"], "not --run-dir's training runs"),
])
def test_enforce_eager_on_a_training_path_is_refused(argv, expected, capsys):
    """--enforce-eager prices decode steps; plan and whatif without --serve and fit of training
    runs have none and would drop it silently: one line naming the flag and the serving path."""
    err = _error([*argv, "--enforce-eager"], capsys)
    assert "--enforce-eager is for decode steps" in err and expected in err


def test_enforce_eager_on_the_serving_path_prices_eager_decode():
    """plan --serve and whatif --serve take --enforce-eager: batch-1 decode pays its launches."""
    _, record = commands.plan(_args("plan", "--serve", "--devices", "8", "--enforce-eager"))
    _, graphed = commands.plan(_args("plan", "--serve", "--devices", "8"))
    eager_ms, graphed_ms = (r["plans"][0]["decode_ms_per_token_batch1"] for r in (record, graphed))
    assert eager_ms > graphed_ms
    assert commands.what_if(_args("whatif", "--serve", "--enforce-eager"))[1]


def test_cpu_decode_graph_default_is_the_engines(model_dir):
    """The CPU default is what the serving engine builds: its decode graph takes MAX_PANEL_ROWS
    sequences (fp32, fast CPU kernels), and none with enforce_eager."""
    from slipstream.ops.linear import MAX_PANEL_ROWS
    from slipstream.serve.engine import Engine, EngineConfig

    assert commands.CPU_DECODE_GRAPH_MAX_BATCH == MAX_PANEL_ROWS
    config = EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=2**22, max_model_len=128)
    engine = Engine(config)
    if engine.runner.decode_graph is None:
        pytest.skip("the C kernels are not available here")
    assert engine.runner.decode_graph.max_seqs == commands.CPU_DECODE_GRAPH_MAX_BATCH
    eager = Engine(dataclasses.replace(config, enforce_eager=True))
    assert eager.runner.decode_graph is None


def test_whatif_training_reports_the_memory_fit_of_each_device():
    """`perf whatif` used to price a training layout that cannot fit, with no word of memory, and
    --scale memory_capacity changed nothing. Llama-3 70B at dp 8 under ZeRO-1 needs its
    `training_memory` per device: more than an H100, less than a 10x one."""
    from slipstream.perf.model import Layout, TrainSetup, predict_training

    argv = ("whatif", "--model", "llama3-70b", "--devices", "8", "--global-batch", "64", "--seq-len", "4096")
    setup = TrainSetup(shape=resolve_model("llama3-70b"), global_batch_size=64, seq_len=4096)
    needed = predict_training(setup, Layout(dp=8), H100).memory.total_bytes
    factor = needed / H100.memory_bytes
    text, record = commands.what_if(_args(*argv, "--scale", f"memory_capacity={1.001 * factor}"))
    assert record["memory_bytes_per_device"] == needed and record["memory_capacity_factor"] == factor
    assert record["fits"] == {"baseline": False, "scaled": True}
    assert "DOES NOT FIT" in text.splitlines()[1] and f"fits from memory_capacity x{factor:.2f}" in text
    _, smaller = commands.what_if(_args(*argv, "--scale", f"memory_capacity={0.999 * factor}"))
    assert smaller["fits"] == {"baseline": False, "scaled": False}


def test_whatif_decode_reports_the_kv_fit_on_the_scaled_device():
    """`perf whatif --serve` checked the weights against the unscaled device, so "would twice the
    memory hold Llama-3 70B on one H100?" was an error; now each decode batch reports what the KV
    cache of each device holds (sequences of the context and the new token in 16-token blocks of
    0.9 x memory less weights and 1 GiB, 320 KiB per token), and prices the step either way."""
    shape = resolve_model("llama3-70b")
    setup = ServeSetup(shape=shape)
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    assert per_token == 320 * 1024
    budget = 0.9 * 2 * H100.memory_bytes - setup.weights_bytes_per_device() - 2**30
    expected = int(budget // (per_token * 16)) // -(-1025 // 16)
    text, record = commands.what_if(_args("whatif", "--serve", "--model", "llama3-70b", "--batch", "1,64",
                                          "--scale", "memory_capacity=2"))
    rows = record["decode"]
    assert [r["batch_size"] for r in rows] == [1, 64]
    assert rows[0]["kv_max_sequences"] == {"baseline": 0, "scaled": expected} and expected == 34
    assert rows[0]["fits"] == {"baseline": False, "scaled": True}
    assert rows[1]["fits"] == {"baseline": False, "scaled": False}
    assert "DOES NOT FIT -> 34: fits" in text
    decode = step_time(ServeSetup(shape=shape, decode_graph_max_batch=256), H100.scaled(memory_capacity=2),
                       decode_contexts=[1024])
    assert rows[0]["scaled"]["total_s"] == pytest.approx(decode.total_s, rel=1e-12)


def test_whatif_decode_prices_every_batch():
    """`whatif --serve --batch 32,8,1` priced batch 32 alone (and the default 1,8,32 batch 1):
    each batch is a case of its own, its time `step_time`'s."""
    _, record = commands.what_if(_args("whatif", "--serve", "--batch", "32,8,1"))
    assert [r["batch_size"] for r in record["decode"]] == [32, 8, 1]
    setup = ServeSetup(shape=LLAMA8B, decode_graph_max_batch=256)
    for row in record["decode"]:
        expected = step_time(setup, H100, decode_contexts=[1024] * row["batch_size"]).total_s
        assert row["baseline"]["total_s"] == pytest.approx(expected, rel=1e-12)


def test_whatif_scale_factors_are_bounded(capsys):
    """--scale flops=1e-320 printed NaN times and emitted bare NaN in --json."""
    err = _error(["whatif", "--scale", "flops=1e-320"], capsys)
    assert "--scale flops=1e-320: scale factor flops must be a number from 1e-06 to 1e+06" in err


@pytest.mark.parametrize("argv, expected", [
    (["whatif", "--batch", "64"], "argument --batch: not allowed without --serve"),
    (["whatif", "--context", "100000"], "argument --context: not allowed without --serve"),
    (["whatif", "--serve", "--devices", "3"], "argument --devices: not allowed with --serve"),
    (["whatif", "--serve", "--pp", "4"], "argument --pp: not allowed with --serve"),
    (["whatif", "--serve", "--zero", "3"], "argument --zero: not allowed with --serve"),
    (["whatif", "--serve", "--global-batch", "5"], "argument --global-batch: not allowed with --serve"),
    (["plan", "--input-len", "100000"], "argument --input-len: not allowed without --serve"),
    (["plan", "--output-len", "5"], "argument --output-len: not allowed without --serve"),
    (["plan", "--recompute", "full"], "argument --recompute: not allowed with perf plan (it tries"),
    (["plan", "--micro-batch", "4"], "argument --micro-batch: not allowed with perf plan (it tries"),
    (["plan", "--serve", "--seq-len", "4096"], "argument --seq-len: not allowed with --serve"),
])
def test_options_of_the_other_path_are_refused(argv, expected, capsys):
    """Options the command's path would drop are errors naming them, as --enforce-eager already
    was (docs/perf.md: each command takes only its own)."""
    assert expected in _error(argv, capsys)


def test_the_commands_take_their_own_defaults():
    """Options are refused only when set to other than the parser's default: the defaults of
    both paths pass."""
    assert commands.what_if(_args("whatif"))[1]["fits"]["baseline"] is not None
    assert len(commands.plan(_args("plan", "--serve", "--top", "1"))[1]["plans"]) == 1


def test_roofline_skips_a_record_beyond_the_model(tmp_path):
    """One engine step longer than the model's positions aborted the whole `perf roofline
    --records`; it is skipped with a warning and the other records are placed."""
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps({"kind": "engine_step", "phase": "decode", "batch_size": 2,
                                        "context_len": n, "step_s": 0.01}) + "\n" for n in (10**7, 100)))
    _, record = commands.roofline_cmd(_args("roofline", "--records", str(path)))
    assert [p["label"] for p in record["points"]][-1] == "decode bs2 len100"


def test_whatif_decode_on_the_cpu_takes_the_engines_cpu_kv_budget():
    """On --hardware cpu the engine's KV cache is at most 4 GiB (and 40% of memory), as `perf serve`
    takes it: 4 GiB of Llama-3 8B's 128 KiB tokens is 2,048 blocks of 16, 31 sequences of 1,025
    positions (65 blocks each); none where that budget does not fit beside the weights."""
    setup = ServeSetup(shape=LLAMA8B)
    assert commands._kv_room(setup, H100, "cpu", 1024) == 2048 // 65 == 31
    assert commands._kv_room(setup, H100.scaled(memory_capacity=0.2), "cpu", 1024) == 0
    expected = serving.kv_capacity(setup, H100, 1025).max_sequences
    assert commands._kv_room(setup, H100, "h100", 1024) == expected


@pytest.mark.parametrize("command", [["serve"], ["roofline"], ["whatif", "--serve"]])
def test_tensor_parallel_serving_on_the_cpu_is_refused_by_name(command, capsys):
    """--tp 2 on --hardware cpu is refused in one line saying why (a CPU's ranks share its memory
    and exchange through shared memory, which the model has no link for), not "lists no link
    bandwidth"; on a GPU the same flags price the split."""
    err = _error([*command, "--model", "tiny", "--hardware", "cpu", "--dtype", "fp32", "--tp", "2"], capsys)
    assert "--tp 2 on --hardware cpu: perf prices tensor-parallel serving on GPUs, not a CPU's ranks" in err
    from slipstream.cli import main

    assert main(["perf", *command, "--model", "tiny", "--hardware", "h100", "--tp", "2"]) == 0
