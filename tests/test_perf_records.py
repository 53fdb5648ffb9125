"""Metrics-record readers and calibration from measurements (fit, then predict again)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from slipstream.perf.accelerators import get_accelerator
from slipstream.perf.efficiency import Efficiency, default_efficiency
from slipstream.perf.fit import apply_scales, calibrate, fit_scales
from slipstream.perf.measured import (
    engine_step_work,
    fit_engine_steps,
    fit_train_runs,
    train_run_work,
    train_setup,
)
from slipstream.perf.model import predict_training
from slipstream.perf.records import (
    EngineStep,
    read_engine_file,
    read_engine_steps,
    read_jsonl,
    read_train_run,
)
from slipstream.perf.serving import ServeSetup
from slipstream.perf.shapes import resolve_model
from slipstream.perf.work import Work

A100 = get_accelerator("a100")


def _write_run(tmp_path, lines, config_toml):
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if config_toml:
        (tmp_path / "config.toml").write_text(config_toml)
    return tmp_path


def test_train_reader_is_tolerant(tmp_path):
    """Guards the reader: bad lines skipped, other spellings read, warm-up dropped, tokens/s only."""
    lines = [json.dumps({"kind": "run", "world_size": 1, "tokens_per_step": 4096}), "not json",
             json.dumps({"kind": "train", "step": 1, "step_s": 9.0, "loss": 5.0}),
             json.dumps({"kind": "train", "step": 3, "step_time_s": 2.0}),
             json.dumps({"step": 4, "tps": 2048.0}),  # no kind, torchtitan's name, no time
             json.dumps({"kind": "eval", "step": 5, "eval_loss": 4.0})]
    toml = "[model]\npreset = \"tiny\"\n[data]\nseq_len = 256\n[training]\nglobal_batch_size = 16\n"
    run = read_train_run(_write_run(tmp_path, lines, toml))
    assert run.step_times_s == [2.0, 2.0]
    assert run.config == {"preset": "tiny", "seq_len": 256, "global_batch_size": 16, "world_size": 1}
    assert run.median_step_s == 2.0


def test_train_records_of_the_wrong_types_are_skipped(tmp_path):
    """A null or string step, a string or infinite time or tokens/s: skipped (with a warning),
    neither a TypeError nor an infinite step time."""
    lines = [json.dumps(r) for r in [
        {"kind": "train", "step": None, "step_s": 1.0}, {"kind": "train", "step": "abc", "step_s": 1.0},
        {"kind": "train", "step": 4, "tokens_per_s": "fast"}, {"kind": "train", "step": 5, "step_s": 1e999},
        {"kind": "train", "step": 6, "step_s": "1"}, {"kind": "train", "step": 7, "step_s": 3.0}]]
    toml = "[data]\nseq_len = 256\n[training]\nglobal_batch_size = \"eight\"\n"
    assert read_train_run(_write_run(tmp_path, lines, toml)).step_times_s == [3.0]


def test_train_reader_config_json_and_missing_metrics(tmp_path):
    """Guards config.json as an alternative, and a clear error without metrics.jsonl."""
    (tmp_path / "config.json").write_text(json.dumps({"model": {"preset": "tiny"}, "seq_len": 64}))
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_train_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 9, "step_s": 1.5}) + "\n")
    assert read_train_run(tmp_path).config == {"preset": "tiny", "seq_len": 64}


def test_engine_step_records(tmp_path):
    """Guards engine step records: phases read, malformed records skipped."""
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"kind": "engine_step", "phase": "prefill", "batch_size": 2, "prompt_len": 64, "step_s": 0.1},
        {"kind": "engine_step", "phase": "decode", "batch_size": 8, "context_len": 100, "step_s": 0.01},
        {"kind": "engine_step", "phase": "decode", "batch_size": "x", "context_len": 1, "step_s": 1},
        {"kind": "request"}]) + "\n")
    steps = read_engine_steps(read_jsonl(path))
    assert steps == [EngineStep("prefill", 2, 64, 0.1), EngineStep("decode", 8, 100, 0.01)]


def test_fit_recovers_known_multipliers():
    """Guards the least-squares fit: synthetic times made with known multipliers give them back."""
    works = [Work(gemm_s=g, memory_s=m, overhead_s=o) for g, m, o in
             [(1.0, 0.2, 0.01), (0.5, 0.6, 0.02), (0.1, 0.9, 0.05), (2.0, 0.1, 0.03)]]
    truth = {"gemm_s": 1.3, "memory_s": 0.8, "overhead_s": 2.0}
    measured = [w.scaled(truth).total_s for w in works]
    fitted = fit_scales(works, measured, ("gemm_s", "memory_s", "overhead_s"), prior_weight=1e-9)
    assert fitted == pytest.approx(truth, rel=1e-4)


def test_calibrate_engine_steps_then_predict_again():
    """Guards the calibration loop: fitted to steps measured on a 'slower' device, the model
    reproduces them, including steps it was not fitted to."""
    setup = ServeSetup(shape=resolve_model("small"), dtype="fp32")
    base = default_efficiency(A100)
    slow = apply_scales(base, {"gemm_s": 1.4, "memory_s": 1.2, "overhead_s": 3.0})
    steps = [EngineStep("prefill", b, n, 0.0) for b, n in [(1, 128), (1, 512), (2, 1024), (4, 256)]]
    steps += [EngineStep("decode", b, c, 0.0) for b, c in [(1, 128), (4, 1024), (8, 512), (16, 64),
                                                           (32, 256)]]
    steps = [EngineStep(s.phase, s.batch_size, s.length, engine_step_work(s, setup, A100, slow).total_s)
             for s in steps]
    cal = fit_engine_steps(steps[:-1], setup, A100, base, ("gemm_s", "memory_s", "overhead_s"))
    held_out = engine_step_work(steps[-1], setup, A100, cal.efficiency).total_s
    print(cal.scales, cal.errors_before, cal.errors_after)
    assert max(abs(e) for e in cal.errors_after) < 0.02
    assert held_out == pytest.approx(steps[-1].step_s, rel=0.03)


def test_engine_fit_recovers_the_roofline_overlap():
    """Guards the overlap search: steps made with a CPU-like partial overlap (0.4) and slower
    streaming are fitted with that overlap and the memory multiplier, overhead left at its prior."""
    setup = ServeSetup(shape=resolve_model("small"), dtype="fp32")
    base = default_efficiency(A100)
    truth = apply_scales(base, {"gemm_s": 1.2, "memory_s": 1.5}).replace(roofline_overlap=0.4)
    shapes = [("prefill", 1, 128), ("prefill", 1, 512), ("decode", 1, 264), ("decode", 8, 264),
              ("decode", 32, 264), ("decode", 256, 264)]
    steps = [EngineStep(p, b, n, engine_step_work(EngineStep(p, b, n, 1.0), setup, A100, truth).total_s)
             for p, b, n in shapes]
    cal = fit_engine_steps(steps, setup, A100, base)
    print(cal.efficiency.roofline_overlap, cal.scales, cal.errors_after)
    assert cal.efficiency.roofline_overlap == 0.4
    assert set(cal.scales) == {"gemm_s", "memory_s"}
    assert cal.scales["memory_s"] == pytest.approx(1.5, rel=0.02)
    assert max(abs(e) for e in cal.errors_after) < 0.01
    assert "fit_engine_steps" in cal.efficiency.sources["roofline_overlap"]
    with pytest.raises(ValueError, match="overlaps"):
        fit_engine_steps(steps, setup, A100, base, overlaps=(1.5,))


def test_engine_fit_recovers_the_attention_fraction():
    """Guards the attention search: prefills of two lengths, made with a CPU-like slow attention
    (0.15 of the peak before a GEMM multiplier of 1.3), are fitted with that fraction; with one
    prefill length the prior's fraction is kept."""
    setup = ServeSetup(shape=resolve_model("small"), dtype="fp32")
    base = default_efficiency(A100)
    truth = apply_scales(base.replace(attention_fraction=0.15), {"gemm_s": 1.3, "memory_s": 1.1})
    shapes = [("prefill", 1, 128), ("prefill", 1, 1024), ("decode", 1, 264), ("decode", 32, 264)]
    steps = [EngineStep(p, b, n, engine_step_work(EngineStep(p, b, n, 1.0), setup, A100, truth).total_s)
             for p, b, n in shapes]
    cal = fit_engine_steps(steps, setup, A100, base, overlaps=(base.roofline_overlap,))
    print(cal.efficiency.attention_fraction, cal.scales, cal.errors_after)
    assert cal.efficiency.attention_fraction == pytest.approx(truth.attention_fraction, rel=0.02)
    assert cal.scales["gemm_s"] == pytest.approx(1.3, rel=0.02)
    assert max(abs(e) for e in cal.errors_after) < 0.01
    assert "fit_engine_steps" in cal.efficiency.sources["attention_fraction"]
    one_length = fit_engine_steps([steps[0], *steps[2:]], setup, A100, base, overlaps=(1.0,))
    assert one_length.efficiency.attention_fraction == pytest.approx(
        base.attention_fraction / one_length.scales["gemm_s"])
    with pytest.raises(ValueError, match="attention_fractions"):
        fit_engine_steps(steps, setup, A100, base, attention_fractions=(0.0,))


@pytest.mark.parametrize("world_size", [1, 8])
def test_calibrate_from_a_training_run(tmp_path, world_size):
    """Guards fitting to a trainer run directory (metrics.jsonl + config.toml): the fitted GEMM
    multiplier gives the measured step back, every part of the step counted (8 DDP ranks: the
    logged loss's all-reduce too, which a fit of the other parts once left out)."""
    toml = ("[model]\npreset = \"tiny\"\n[data]\nseq_len = 256\n[training]\nglobal_batch_size = 8\n"
            "micro_batch_size = 1\ndtype = \"float32\"\n")
    lines = [json.dumps({"kind": "run", "world_size": world_size})]
    step_s = 0.05 / world_size  # each rank runs 8 / world_size micro-batches
    lines += [json.dumps({"kind": "train", "step": s, "step_s": step_s, "loss": 1.0}) for s in range(1, 8)]
    run = read_train_run(_write_run(tmp_path, lines, toml))
    acc = get_accelerator("a100")
    cal = fit_train_runs([run], acc, default_efficiency(acc))
    setup, layout = train_setup(run)
    assert layout.dp == world_size
    assert predict_training(setup, layout, acc, cal.efficiency).step_time_s == pytest.approx(step_s, rel=1e-4)
    assert train_run_work(run, acc, cal.efficiency).total_s == pytest.approx(step_s, rel=1e-4)
    assert set(cal.scales) == {"gemm_s"}


def test_calibrate_rejects_bad_input():
    """Guards user errors in fitting: mismatched lengths, non-positive times."""
    with pytest.raises(ValueError):
        fit_scales([Work(gemm_s=1.0)], [1.0, 2.0])
    with pytest.raises(ValueError):
        fit_scales([Work(gemm_s=1.0)], [0.0])
    cal = calibrate(lambda e: [Work(gemm_s=2.0 / e.gemm_fraction)], [1.0], Efficiency(gemm_fraction=1.0),
                    ("gemm_s",))
    assert cal.efficiency.gemm_fraction == pytest.approx(2.0, rel=0.01) or cal.efficiency.gemm_fraction == 1.5


def test_one_run_with_phases_fits_two_multipliers(tmp_path):
    """Guards the phase fit: the trainer's forward_backward_s and optimizer_s give two numbers
    from one run, so GEMM and memory multipliers are both fitted and both phases reproduced."""
    toml = ("[model]\npreset = \"tiny\"\n[data]\nseq_len = 256\n[training]\nglobal_batch_size = 8\n"
            "micro_batch_size = 8\ndtype = \"float32\"\n")
    lines = [json.dumps({"kind": "train", "step": s, "step_s": 0.06, "forward_backward_s": 0.05,
                         "optimizer_s": 0.003}) for s in range(1, 8)]
    run = read_train_run(_write_run(tmp_path, lines, toml))
    assert run.median_phase_s("optimizer_s") == 0.003
    acc = get_accelerator("a100")
    cal = fit_train_runs([run], acc, default_efficiency(acc))
    print(cal.scales, cal.errors_after)
    assert set(cal.scales) == {"gemm_s", "memory_s"}
    assert max(abs(e) for e in cal.errors_after) < 0.01


def _strategy_run(tmp_path, strategy):
    toml = ("[model]\npreset = \"llama3.2-1b\"\n[data]\nseq_len = 2048\n[training]\nglobal_batch_size = 8\n"
            f"micro_batch_size = 1\ndtype = \"bfloat16\"\n[parallel]\nstrategy = \"{strategy}\"\n")
    lines = [json.dumps({"kind": "run", "world_size": 8, "strategy": strategy})]
    lines += [json.dumps({"kind": "train", "step": s, "step_s": 1.0}) for s in range(1, 8)]
    path = tmp_path / strategy
    path.mkdir()
    return read_train_run(_write_run(path, lines, toml))


def test_a_ddp_run_is_modelled_as_ddp(tmp_path):
    """`[parallel] strategy = "ddp"` runs the trainer's `replicate`: one bucketed all-reduce of the
    fp32 gradients per step and the whole AdamW state on every rank (ZeRO-0), where `perf fit`
    modelled every multi-rank run as FSDP. The all-reduce moves 4 bytes x Llama-3.2 1B's
    1,235,814,400 parameters (HF's count); the optimizer streams all of them on each rank."""
    h100 = get_accelerator("h100")
    ddp_setup, ddp = train_setup(_strategy_run(tmp_path, "ddp"))
    fsdp_setup, fsdp = train_setup(_strategy_run(tmp_path, "fsdp"))
    assert (ddp.dp, ddp.zero_stage, fsdp.dp, fsdp.zero_stage) == (8, 0, 8, 3)
    parts = predict_training(ddp_setup, ddp, h100).parts
    assert parts["data_parallel"].comm_bytes == 4 * 1_235_814_400
    fsdp_parts = predict_training(fsdp_setup, fsdp, h100).parts
    assert parts["optimizer"].memory_bytes == pytest.approx(8 * fsdp_parts["optimizer"].memory_bytes)


@pytest.mark.parametrize("config, expected", [
    ('seq_len = "abc"', "the run's seq_len must be an integer >= 1, got 'abc'"),
    ("seq_len = 0", "the run's seq_len must be an integer >= 1, got 0"),
    ("seq_len = 1000000", "the run's seq_len needs 1,000,000 positions"),
    ('seq_len = 256\n[parallel]\nstrategy = "zero2"', "the run's parallel strategy is 'zero2'; known: fsdp"),
])
def test_run_config_errors_name_the_run_and_the_key(tmp_path, config, expected):
    """A run-dir value the model cannot take was "invalid literal for int()" naming nothing."""
    toml = f"[model]\npreset = \"tiny\"\n[training]\nglobal_batch_size = 8\n[data]\n{config}\n"
    lines = [json.dumps({"kind": "train", "step": 5, "step_s": 1.0})]
    run = read_train_run(_write_run(tmp_path, lines, toml))
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))}: ") as error:
        train_setup(run)
    assert expected in str(error.value)


def test_out_of_range_engine_steps_are_skipped_naming_file_and_line(tmp_path, caplog):
    """One record of 1e8 sequences or of more positions than the model has aborted the whole
    roofline or fit (or hung it); such records are skipped, each logged with its file and line."""
    path = tmp_path / "steps.jsonl"
    records = [{"phase": "decode", "batch_size": 10**8, "context_len": 100},
               {"phase": "decode", "batch_size": 1, "context_len": 131_071},
               {"phase": "decode", "batch_size": 1, "context_len": 131_072},
               {"phase": "prefill", "batch_size": 1, "prompt_len": 131_073},
               {"phase": "decode", "batch_size": 2, "context_len": "x"}]
    path.write_text("".join(json.dumps(r | {"kind": "engine_step", "step_s": 0.01}) + "\n" for r in records))
    with caplog.at_level("WARNING"):
        steps = read_engine_file(path, max_batch_size=2**20, max_positions=131_072)
    assert steps == [EngineStep("decode", 1, 131_071, 0.01)]
    assert f"{path}:1: engine_step record skipped (batch_size 100,000,000 above 1,048,576)" in caplog.text
    assert f"{path}:3: engine_step record skipped (131,073 positions" in caplog.text
    assert f"{path}:4: engine_step record skipped (131,073 positions" in caplog.text
    assert f"{path}:5: engine_step record skipped (malformed)" in caplog.text


@pytest.mark.parametrize(("world", "tp", "sp", "expected"), [
    (2, 2, None, (1, 2, True, 0)),  # the trainer's default: sequence parallel with TP, no FSDP on one replica
    (4, 2, False, (2, 2, False, 3)),
    (8, 1, None, (8, 1, False, 3)),
])
def test_a_tensor_parallel_run_is_modelled_with_its_layout(tmp_path, world, tp, sp, expected):
    """A run of `parallel.tensor_parallel_degree` ranks per replica is world / degree data-parallel
    replicas of TP (and, as the trainer defaults, sequence-parallel) groups: not `world` replicas,
    which priced every rank as holding (and all-reducing) the whole model."""
    toml = ("[model]\npreset = \"llama3.2-1b\"\n[data]\nseq_len = 2048\n[training]\nglobal_batch_size = 8\n"
            f"micro_batch_size = 1\n[parallel]\nstrategy = \"fsdp\"\ntensor_parallel_degree = {tp}\n"
            + ("" if sp is None else f"sequence_parallel = {str(sp).lower()}\n"))
    lines = [json.dumps({"kind": "run", "world_size": world, "strategy": "fsdp"})]
    lines += [json.dumps({"kind": "train", "step": s, "step_s": 1.0}) for s in range(1, 8)]
    _, layout = train_setup(read_train_run(_write_run(tmp_path, lines, toml)))
    assert (layout.dp, layout.tp, layout.sequence_parallel, layout.zero_stage) == expected
    assert layout.num_devices == world


def test_a_tensor_parallel_degree_that_does_not_divide_the_world_is_named(tmp_path):
    toml = "[model]\npreset = \"tiny\"\n[data]\nseq_len = 256\n[training]\nglobal_batch_size = 8\n" \
           "[parallel]\ntensor_parallel_degree = 3\n"
    lines = [json.dumps({"kind": "run", "world_size": 4}),
             json.dumps({"kind": "train", "step": 5, "step_s": 1.0})]
    with pytest.raises(ValueError, match=r"tensor_parallel_degree x context_parallel_degree \(3 x 1\) "
                                         r"does not divide its world size"):
        train_setup(read_train_run(_write_run(tmp_path, lines, toml)))


def test_a_run_resumed_at_another_layout_is_read_at_its_newest(tmp_path):
    """A run dir whose first attempt ran 4 ranks as 2 replicas of TP=2 and whose resume ran one
    process: config.toml is the newest attempt's, and so must be the layout and the steps read
    (they were the first attempt's world size with the newest degree, a layout that never ran)."""
    toml = ("[model]\npreset = \"llama3.2-1b\"\n[data]\nseq_len = 2048\n[training]\nglobal_batch_size = 8\n"
            "micro_batch_size = 1\n[parallel]\ntensor_parallel_degree = 1\n")
    first = {"kind": "run", "world_size": 4, "strategy": "fsdp", "tensor_parallel_degree": 2,
             "sequence_parallel": True}
    newest = {"kind": "run", "world_size": 1, "strategy": "single", "tensor_parallel_degree": 1,
              "sequence_parallel": False}
    steps = [{"kind": "train", "step": s, "step_s": 9.0} for s in range(1, 6)]
    resumed = [{"kind": "train", "step": s, "step_s": 1.0} for s in range(4, 9)]
    lines = [json.dumps(r) for r in (first, *steps, newest, *resumed)]
    run = read_train_run(_write_run(tmp_path, lines, toml))
    assert run.step_times_s == [1.0] * 3  # steps 6-8: 4 and 5 are the resumed process's warm-up
    _, layout = train_setup(run)
    assert (layout.dp, layout.tp, layout.zero_stage) == (1, 1, 0)


def test_a_run_record_from_before_tensor_parallelism_has_the_same_layout(tmp_path):
    """A run started by a trainer that wrote no tensor_parallel_degree and resumed by one that
    writes degree 1 ran one layout: both attempts' steps are read, less each one's two warm-up
    steps (the first attempt's were all dropped)."""
    toml = "[model]\npreset = \"tiny\"\n[data]\nseq_len = 256\n[training]\nglobal_batch_size = 8\n"
    old = {"kind": "run", "world_size": 8, "strategy": "fsdp"}
    new = old | {"tensor_parallel_degree": 1, "sequence_parallel": False}
    steps = [{"kind": "train", "step": s, "step_s": 1.0} for s in range(1, 6)]
    resumed = [{"kind": "train", "step": s, "step_s": 1.0} for s in range(4, 9)]
    lines = [json.dumps(r) for r in (old, *steps, new, *resumed)]
    assert len(read_train_run(_write_run(tmp_path, lines, toml)).step_times_s) == 3 + 3


def test_each_attempts_first_steps_are_warm_up(tmp_path):
    """A resumed process is as cold as a new one (allocator, oneDNN's kernels, compile): the first
    two steps of every attempt are warm-up and not measured, whatever their step numbers, and the
    report's statistics (`measured`) are the records whose times are read."""
    toml = "[model]\npreset = \"tiny\"\n[data]\nseq_len = 256\n[training]\nglobal_batch_size = 8\n"
    run = {"kind": "run", "world_size": 1, "strategy": "single", "tensor_parallel_degree": 1,
           "sequence_parallel": False}
    cold = [{"kind": "train", "step": s, "step_s": 5.0} for s in (1, 2)]
    warm = [{"kind": "train", "step": s, "step_s": 1.0} for s in (3, 4, 5)]
    cold_again = [{"kind": "train", "step": s, "step_s": 5.0} for s in (4, 5)]
    warm_again = [{"kind": "train", "step": s, "step_s": 1.0} for s in (6, 7)]
    lines = [json.dumps(r) for r in (run, *cold, *warm, run, *cold_again, *warm_again)]
    train_run = read_train_run(_write_run(tmp_path, lines, toml))
    assert train_run.step_times_s == [1.0] * 5
    assert [r["step"] for r in train_run.measured] == [3, 4, 5, 6, 7]


@pytest.mark.parametrize(("world", "tp", "cp", "strategy", "expected"), [
    (2, 1, 2, "fsdp", (1, 1, 2, 3)),  # one replica, yet FSDP2 shards over its two CP ranks
    (4, 1, 2, "ddp", (2, 1, 2, 0)),
    (8, 2, 2, "fsdp", (2, 2, 2, 3)),
])
def test_a_context_parallel_run_is_modelled_with_its_layout(tmp_path, world, tp, cp, strategy, expected):
    """A run of `parallel.context_parallel_degree` C is world / (T x C) data-parallel replicas of
    T x C ranks, FSDP or DDP over the data- and context-parallel ranks together (as the trainer
    applies them, torchtitan's dp_shard_cp): not world / T replicas, which priced every CP rank as
    a replica holding whole sequences."""
    toml = ("[model]\npreset = \"llama3.2-1b\"\n[data]\nseq_len = 2048\n[training]\nglobal_batch_size = 8\n"
            f"micro_batch_size = 1\n[parallel]\nstrategy = \"{strategy}\"\ntensor_parallel_degree = {tp}\n"
            f"context_parallel_degree = {cp}\n")
    lines = [json.dumps({"kind": "run", "world_size": world, "strategy": strategy})]
    lines += [json.dumps({"kind": "train", "step": s, "step_s": 1.0}) for s in range(1, 8)]
    _, layout = train_setup(read_train_run(_write_run(tmp_path, lines, toml)))
    assert (layout.dp, layout.tp, layout.cp, layout.zero_stage) == expected
    assert layout.num_devices == world


def test_a_context_parallel_degree_that_does_not_divide_the_world_is_named(tmp_path):
    toml = "[model]\npreset = \"tiny\"\n[data]\nseq_len = 256\n[training]\nglobal_batch_size = 8\n" \
           "[parallel]\ntensor_parallel_degree = 2\ncontext_parallel_degree = 3\n"
    lines = [json.dumps({"kind": "run", "world_size": 4}),
             json.dumps({"kind": "train", "step": 5, "step_s": 1.0})]
    with pytest.raises(ValueError, match=r"context_parallel_degree \(2 x 3\) does not divide its world size"):
        train_setup(read_train_run(_write_run(tmp_path, lines, toml)))


def _pipeline_run(tmp_path, parallel: str, run: dict, name: str = "run", batch: str = "local_batch_size = 4"):
    """A run dir of Llama-3.2 1B (16 layers), 8 sequences of 2048 a step (`batch`: the micro-batch
    key, torchtitan's local batch by default), `[parallel]` or torchtitan's `[parallelism]` keys as
    given, and a `run` record."""
    toml = ("[model]\npreset = \"llama3.2-1b\"\n[data]\nseq_len = 2048\n[training]\nglobal_batch_size = 8\n"
            f"{batch}\n{parallel}")
    lines = [json.dumps({"kind": "run"} | run)]
    lines += [json.dumps({"kind": "train", "step": s, "step_s": 1.0}) for s in range(1, 8)]
    path = tmp_path / name
    path.mkdir()
    return read_train_run(_write_run(path, lines, toml))


def test_an_interleaved_pipeline_run_is_priced_with_its_virtual_stages(tmp_path):
    """A slipstream run of Interleaved1F1B over 2 stages of 2 virtual stages each on 4 ranks is
    Layout(pp=2, virtual_stages=2) over 2 replicas, its bubble (p - 1) / v = 1/2 of a stage-time
    (Narayanan et al. 2021, section 2.2.2): half of the same run's at 1F1B."""
    parallel = ("[parallel]\nstrategy = \"fsdp\"\npipeline_parallel_degree = 2\n"
                "pipeline_parallel_schedule = \"Interleaved1F1B\"\npipeline_parallel_stages_per_rank = 2\n")
    run = {"world_size": 4, "strategy": "fsdp", "pipeline_parallel_degree": 2,
           "pipeline_parallel_schedule": "Interleaved1F1B", "pipeline_parallel_stages_per_rank": 2}
    setup, layout = train_setup(_pipeline_run(tmp_path, parallel, run, batch="micro_batch_size = 1"))
    assert (layout.dp, layout.pp, layout.virtual_stages, layout.zero_stage) == (2, 2, 2, 3)
    assert setup.num_microbatches(layout) == 8 // (2 * 1)
    one_f_one_b = dataclasses.replace(layout, virtual_stages=1)
    bubbles = [predict_training(setup, x, A100).breakdown_s["bubble_s"] for x in (layout, one_f_one_b)]
    assert bubbles[0] == pytest.approx(bubbles[1] / 2, rel=0.05)  # v = 2's stage-time: twice the sends


@pytest.mark.parametrize(("parallelism", "expected"), [
    # torchtitan: an interleaved schedule without a stage count runs 2 stages per rank, and
    # splits each rank's local batch (4) into micro-batches of pipeline_parallel_microbatch_size
    ("pipeline_parallel_schedule = \"Interleaved1F1B\"\npipeline_parallel_microbatch_size = 1\n",
     (2, 1, 4, False)),
    ("pipeline_parallel_schedule = \"interleaved1f1b\"\n", (2, 4, 1, False)),
    ("pipeline_parallel_schedule = \"1F1B\"\npipeline_parallel_microbatch_size = 2\n", (1, 2, 2, False)),
    ("pipeline_parallel_schedule = \"GPipe\"\n", (1, 4, 1, True)),
    ("pipeline_parallel_schedule = \"gpipe\"\npipeline_parallel_microbatch_size = 2\n", (1, 2, 2, True)),
])
def test_torchtitans_pipeline_keys_give_the_virtual_stages_and_micro_batches(tmp_path, parallelism, expected):
    """torchtitan's `[parallelism]` keys: 4 ranks of pp 2 are 2 replicas of local batch 4;
    (virtual stages, micro-batch size, micro-batches a step, GPipe) follow the schedule and
    `pipeline_parallel_microbatch_size` as torchtitan runs them."""
    parallel = f"[parallelism]\npipeline_parallel_degree = 2\n{parallelism}"
    setup, layout = train_setup(_pipeline_run(tmp_path, parallel, {"world_size": 4}))
    assert (layout.dp, layout.pp) == (2, 2)
    assert (layout.virtual_stages, setup.micro_batch_size, setup.num_microbatches(layout),
            layout.gpipe) == expected


def test_stages_per_rank_without_pipeline_parallelism_is_one_stage(tmp_path):
    """A config that names stages per rank, an interleaved schedule or a pipeline micro-batch but
    runs no pipeline (pp 1) is priced as one stage of its own micro-batch, not refused as
    virtual stages without pipeline stages."""
    parallel = ("[parallel]\npipeline_parallel_stages_per_rank = 2\n[parallelism]\n"
                "pipeline_parallel_schedule = \"Interleaved1F1B\"\npipeline_parallel_microbatch_size = 1\n")
    setup, layout = train_setup(_pipeline_run(tmp_path, parallel, {"world_size": 2}))
    assert (layout.dp, layout.pp, layout.virtual_stages, setup.micro_batch_size) == (2, 1, 1, 4)


def test_a_ddp_pipeline_run_all_reduces_after_the_schedule(tmp_path):
    """DDP with pp > 1 (`train.pipeline.average_grads` after the schedule): the all-reduce of each
    stage's fp32 gradients is not overlapped with the backward, where DDP's hooks overlap it
    without a pipeline. On H100s (dp 2 x pp 2, one node) a 2-rank ring of the larger stage's
    gradients: 2 steps + S / B, S = 4 x (8 layers + the tied table's copy and the final norm)."""
    h100 = get_accelerator("h100")
    parallel = "[parallel]\nstrategy = \"ddp\"\npipeline_parallel_degree = 2\n"
    run = {"world_size": 4, "strategy": "ddp", "pipeline_parallel_degree": 2}
    setup, layout = train_setup(_pipeline_run(tmp_path, parallel, run))
    assert (layout.dp, layout.pp, layout.zero_stage, setup.dp_overlap) == (2, 2, 0, False)
    layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    grads = 4 * (8 * layer + 128256 * 2048 + 2048)
    dp = predict_training(setup, layout, h100).parts["data_parallel"]
    assert dp.comm_s == pytest.approx(2 * 0.936e-6 + grads / 400e9, rel=1e-9)
    flat_setup, flat = train_setup(_pipeline_run(tmp_path, "[parallel]\nstrategy = \"ddp\"\n",
                                                 {"world_size": 2, "strategy": "ddp"}, "flat"))
    assert flat_setup.dp_overlap
    assert predict_training(flat_setup, flat, h100).parts["data_parallel"].comm_s == 0


def test_a_pipeline_run_resumed_at_another_degree_is_a_layout_change(tmp_path):
    """A run whose first attempt ran pp 2 and whose resume ran pp 4 (or another schedule) on the
    same ranks ran two layouts: only the newest attempt's steps are read."""
    base = {"kind": "run", "world_size": 4, "strategy": "fsdp", "pipeline_parallel_degree": 2,
            "pipeline_parallel_schedule": "1F1B", "pipeline_parallel_stages_per_rank": 1}
    toml = "[model]\npreset = \"tiny\"\n[data]\nseq_len = 256\n[training]\nglobal_batch_size = 8\n"
    steps = [{"kind": "train", "step": s, "step_s": 9.0} for s in range(1, 6)]
    resumed = [{"kind": "train", "step": s, "step_s": 1.0} for s in range(4, 9)]
    for i, newest in enumerate([base | {"pipeline_parallel_degree": 4},
                                base | {"pipeline_parallel_schedule": "GPipe"},
                                base | {"pipeline_parallel_schedule": "Interleaved1F1B",
                                        "pipeline_parallel_stages_per_rank": 2}]):
        lines = [json.dumps(r) for r in (base, *steps, newest, *resumed)]
        path = tmp_path / str(i)
        path.mkdir()
        assert read_train_run(_write_run(path, lines, toml)).step_times_s == [1.0] * 3
    lines = [json.dumps(r) for r in (base, *steps, base, *resumed)]
    assert len(read_train_run(_write_run(tmp_path, lines, toml)).step_times_s) == 3 + 3
