"""What the `slipstream perf ...` subcommands compute: each returns (text table, JSON-ready dict).

`slipstream/cli.py` declares the arguments and prints; the work happens here so that the CLI
holds no logic and the same functions serve tests and notebooks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slipstream.perf import (
    hardware,
    measured,
    planner,
    report,
    report_html,
    roofline,
    serving,
    trace,
    trace_report,
    validation,
    whatif,
)
from slipstream.perf.accelerators import Accelerator, dtype_key
from slipstream.perf.efficiency import Efficiency, check_fractions, default_efficiency, max_fraction
from slipstream.perf.fit import MAX_SCALE, MIN_SCALE, apply_scales
from slipstream.perf.hardware import get_accelerator, is_local
from slipstream.perf.model import Layout, TrainSetup, predict_training
from slipstream.perf.records import (
    METRICS_FILE,
    EngineStep,
    engines_by,
    read_engine_file,
    read_engine_headers,
    read_engine_steps,
    read_train_run,
    threads_per_rank,
)
from slipstream.perf.shapes import resolve_model
from slipstream.perf.work import Work

Result = tuple[str, dict[str, Any]]


def efficiency_for(args: argparse.Namespace, accelerator,
                   link_latency_s: float | None = None) -> tuple[Efficiency, str]:
    """--efficiency FILE (from `perf fit`), --profile NAME (fitted to published runs), or defaults
    (with `link_latency_s`, a calibrated CPU's measured link: `default_efficiency`); a file may not
    claim more of the accelerator's peaks than `max_fraction` allows.

    A file whose sources name no `link_latency_s` was fitted where no link was known (a calibrated
    CPU's one-process run): its link knobs are the dataclass's placeholders, which the measured
    link's replace, so that compute fitted to one process prices a multi-rank run with the link
    measured for it.
    """
    if getattr(args, "efficiency", None):
        efficiency = _read_efficiency(args.efficiency)
        try:
            check_fractions(efficiency, accelerator)
        except ValueError as e:
            raise ValueError(f"--efficiency {args.efficiency}: {e}") from e
        if link_latency_s is None or "link_latency_s" in efficiency.sources:
            return efficiency, f"file {args.efficiency}"
        measured = default_efficiency(accelerator, link_latency_s)
        link = {k: getattr(measured, k) for k in ("link_fraction", "link_latency_s")}
        sources = dict(efficiency.sources) | {k: measured.sources[k] for k in link}
        return efficiency.replace(**link, sources=sources), f"file {args.efficiency}, link measured"
    profile = getattr(args, "profile", None)
    if profile:
        data = validation.load()
        if profile not in data["profiles"]:
            raise ValueError(f"unknown profile {profile!r}; known: {', '.join(data['profiles'])}")
        scales = validation.profile_scales(profile, data)
        efficiency = apply_scales(default_efficiency(accelerator, link_latency_s), scales,
                                  max_fraction(accelerator))
        return efficiency, f"profile {profile} {scales}"
    return default_efficiency(accelerator, link_latency_s), "defaults (datasheet x public measurements)"


def _read_efficiency(path: str) -> Efficiency:
    try:
        d = json.loads(_input_file(path, "--efficiency").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--efficiency {path} is not valid JSON: {e}") from e
    try:
        return Efficiency.from_dict(d)
    except ValueError as e:
        raise ValueError(f"--efficiency {path}: {e}") from e


def _input_file(path: str, flag: str) -> Path:
    """`path` as a file to read; a directory or a missing file is an error naming `flag`."""
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a directory; expected a file")
    if not Path(path).is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file")
    return Path(path)


MAX_DECODE_BATCH = 2**20
"""The largest decode batch `--batch` (and an engine step record) takes: each sequence is
modelled one by one."""


def _records_file(path: str, flag: str) -> Path:
    """`path` as a file of engine records: the file itself, or the metrics.jsonl of a directory
    (the serving engine's metrics_dir)."""
    if Path(path).is_dir():
        records = Path(path) / METRICS_FILE
        if not records.is_file():
            raise FileNotFoundError(f"{flag} {path} is a directory without {METRICS_FILE} (expected a "
                                    "records file or the serving engine's metrics directory)")
        return records
    return _input_file(path, flag)


def _engine_steps(path: str, flag: str, setup: serving.ServeSetup) -> list[EngineStep]:
    """The well-formed engine step records in `path` (a file or a metrics directory) that `setup`'s
    model can run (read_engine_file: at most MAX_DECODE_BATCH sequences within its positions), at
    least one."""
    steps = read_engine_file(_records_file(path, flag), MAX_DECODE_BATCH, setup.shape.max_position_embeddings)
    if not steps:
        raise ValueError(f"{flag} {path}: no well-formed engine_step records (kind \"engine_step\", phase "
                         "prefill or decode, batch_size, prompt_len or context_len, step_s) within "
                         f"{MAX_DECODE_BATCH:,} sequences and {setup.shape.name}'s positions")
    return steps


def _ints(text: str, flag: str, maximum: int | None = None) -> list[int]:
    """A comma-separated list of at least one integer >= 1 (and <= `maximum`)."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"{flag} expects comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1 or (maximum is not None and max(values) > maximum):
        bound = "" if maximum is None else f" and <= {maximum:,}"
        raise ValueError(f"{flag} expects comma-separated integers >= 1{bound}, got {text!r}")
    return values


def train_setup(args: argparse.Namespace) -> TrainSetup:
    """The trained model as the flags describe it; ValueError naming --seq-len beyond the model's
    max_position_embeddings (as `perf serve` refuses such a context)."""
    shape = resolve_model(args.model)
    serving.check_positions(shape, f"--seq-len {args.seq_len}", args.seq_len)
    return TrainSetup(shape=shape, global_batch_size=args.global_batch,
                      seq_len=args.seq_len, micro_batch_size=args.micro_batch, dtype=args.dtype,
                      recompute=args.recompute, attention=args.attention, pointwise=args.pointwise,
                      mixed_precision=args.mixed_precision)


def layout_from(args: argparse.Namespace) -> Layout:
    for flag in ("devices", "tp", "pp", "cp", "vp"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    model_parallel = args.tp * args.pp * args.cp
    if args.devices % model_parallel:
        raise ValueError(f"--devices {args.devices} is not a multiple of tp*pp*cp = {model_parallel}")
    return Layout(dp=args.devices // model_parallel, tp=args.tp, pp=args.pp, cp=args.cp,
                  sequence_parallel=args.tp > 1 and not args.no_sp, zero_stage=args.zero,
                  virtual_stages=args.vp, gpipe=args.gpipe)


def _training_hardware(args: argparse.Namespace) -> tuple[Accelerator, Efficiency, str]:
    """--hardware and the efficiency for a training step on --devices ranks: on this CPU, ranks as
    `slipstream train --nproc` starts them (`train_accelerator`)."""
    acc, latency_s = train_accelerator(args.hardware, [("--devices", {"world_size": args.devices})])
    return acc, *efficiency_for(args, acc, latency_s)


def train(args: argparse.Namespace) -> Result:
    layout = layout_from(args)
    acc, eff, source = _training_hardware(args)
    p = predict_training(train_setup(args), layout, acc, eff)
    d = p.to_dict() | {"hardware": acc.name, "model": args.model, "efficiency": source}
    m = p.memory
    text = "\n".join([
        f"{args.model} on {p.layout.num_devices} x {acc.name}, {p.layout.describe()}"
        + (f", {p.layout.schedule} schedule" if p.layout.pp > 1 else ""),
        f"step time   {p.step_time_s:.3f} s   ({p.tokens_per_s:,.0f} tokens/s, bound by {p.work.bound()})",
        f"MFU         {100 * p.mfu:.1f}%   (HFU {100 * p.hfu:.1f}%)",
        "breakdown   " + ", ".join(f"{k} {v:.3f}" for k, v in p.breakdown_s.items()),
        f"memory      {m.total_bytes / 2**30:.1f} GiB per device of {acc.memory_bytes / 2**30:.0f} "
        f"({'fits' if p.fits else 'DOES NOT FIT'}): weights {m.weights_bytes / 2**30:.1f}, grads "
        f"{m.gradients_bytes / 2**30:.1f}, optimizer {m.optimizer_bytes / 2**30:.1f}, activations "
        f"{m.activations_bytes / 2**30:.1f}, reserved {m.reserved_bytes / 2**30:.1f}",
        f"efficiency  {source}",
    ])
    return text, d


MAX_NUM_SEQS = 256
"""The --max-num-seqs default (vLLM's), for the commands that take no --max-num-seqs."""

CPU_DECODE_GRAPH_MAX_BATCH = 256
"""Decode batches the serving engine's CPU decode graph takes (`ops.linear.MAX_PANEL_ROWS` rows
of its panel GEMMs); it runs fp32 and bf16 models, where slipstream's C kernels do."""


def decode_graph_max_batch(args: argparse.Namespace) -> int:
    """Up to which batch decode-only steps replay a graph, as the serving engine runs them on
    --hardware unless --enforce-eager: CUDA graphs for up to --max-num-seqs sequences on an
    accelerator (slipstream's runner; vLLM's default captures decode batches up to min(2 x
    max_num_seqs, 512) tokens, 1024 on Blackwell, so all of them up to 512 sequences, 1024 there),
    the CPU decode graph for up to 256 fp32 or bf16 sequences on this machine."""
    if getattr(args, "enforce_eager", False):
        return 0
    if is_local(args.hardware):
        return CPU_DECODE_GRAPH_MAX_BATCH if dtype_key(args.dtype) in ("fp32", "bf16") else 0
    return getattr(args, "max_num_seqs", MAX_NUM_SEQS)


def _serve_setup(args: argparse.Namespace) -> serving.ServeSetup:
    """The served model as the flags describe it; ValueError naming the flag for a length beyond
    the model's max_position_embeddings."""
    # `plan --serve` has no --tp: it tries every degree.
    shape = resolve_model(args.model)
    if hasattr(args, "context"):  # a decode step holds its context and the new token
        serving.check_positions(shape, f"--context {args.context} (and the new token)", args.context + 1)
    if hasattr(args, "output_len"):
        serving.check_positions(shape, "--input-len + --output-len", args.input_len + args.output_len)
    elif hasattr(args, "input_len"):
        serving.check_positions(shape, "--input-len", args.input_len)
    kv_dtype = getattr(args, "kv_cache_dtype", None)
    if kv_dtype is not None:
        try:
            serving.kv_cache_dtype(kv_dtype)
        except ValueError as e:
            raise ValueError(f"--kv-cache-dtype: {e}") from None
    _refuse_tensor_parallel_on_a_cpu(args)
    return serving.ServeSetup(shape=shape, tp=getattr(args, "tp", 1), dtype=args.dtype, kv_dtype=kv_dtype,
                              decode_graph_max_batch=decode_graph_max_batch(args))


CPU_KV_CACHE_BYTES, CPU_KV_CACHE_FRACTION = 4 * 2**30, 0.4
"""The serving engine's default KV budget on a CPU (`EngineConfig.kv_cache_memory`): at most 4 GiB
and 40% of memory, not a fraction of all of it as on a GPU."""


def serve(args: argparse.Namespace) -> Result:
    _refuse_tensor_parallel_on_a_cpu(args)
    acc = get_accelerator(args.hardware)
    eff, source = efficiency_for(args, acc)
    kv_bytes = args.kv_cache_memory
    if kv_bytes is None and is_local(args.hardware):
        kv_bytes = min(CPU_KV_CACHE_BYTES, CPU_KV_CACHE_FRACTION * acc.memory_bytes)
    setup = dataclasses.replace(_serve_setup(args), kv_cache_bytes=kv_bytes, block_size=args.block_size)
    serving.check_weights_fit(setup, acc)
    try:
        serving.check_kv_budget_fits(setup, acc)
    except ValueError as e:
        flag = "--kv-cache-memory" if args.kv_cache_memory is not None else "the CPU default KV budget"
        raise ValueError(f"{flag} {kv_bytes:g}: {e}") from None
    prefill = serving.step_time(setup, acc, prefill_lens=[args.input_len], efficiency=eff)
    rows, lines = [], [
        f"{args.model} on {args.tp} x {acc.name} (tp {args.tp}), {args.dtype}; efficiency {source}",
        f"prefill of {args.input_len} tokens: {1e3 * prefill.total_s:.2f} ms (bound by {prefill.bound()})",
        f"{'batch':>6}{'context':>9}{'decode ms/token':>17}{'tokens/s/user':>15}{'tokens/s':>11}  bound"]
    # A decode step's sequences each hold their context and the new token in the KV cache.
    room = serving.kv_capacity(setup, acc, args.context + 1).max_sequences
    for batch in _ints(args.batch, "--batch", MAX_DECODE_BATCH):
        work = serving.step_time(setup, acc, decode_contexts=[args.context] * batch, efficiency=eff)
        rows.append({"batch_size": batch, "context_len": args.context, "decode_s_per_token": work.total_s,
                     "bound": work.bound(), "fits": batch <= room, "work": work.to_dict()})
        lines.append(f"{batch:>6}{args.context:>9}{1e3 * work.total_s:>17.3f}{1 / work.total_s:>15.1f}"
                     f"{batch / work.total_s:>11.0f}  {work.bound()}"
                     + ("" if batch <= room else f"  DOES NOT FIT: the KV cache holds {room} such sequences"))
    cap = serving.kv_capacity(setup, acc, args.input_len + args.output_len)
    lines.append(f"KV cache: {cap.max_tokens:,} tokens per device, {cap.max_sequences} sequences of "
                 f"{cap.context_len} tokens")
    d = {"model": args.model, "hardware": acc.name, "efficiency": source, "prefill_s": prefill.total_s,
         "prefill_tokens": args.input_len, "decode": rows,
         "decode_s_per_token": rows[0]["decode_s_per_token"], "kv_capacity": cap.to_dict()}
    if args.rate is not None:
        load = serving.under_load(setup, acc, args.rate, args.input_len, args.output_len,
                                  args.max_num_seqs, eff)
        d["load"] = load.to_dict()
        lines.append(f"at {args.rate:g} req/s: TTFT {1e3 * load.ttft_s:.1f} ms, "
                     f"TPOT {1e3 * load.tpot_s:.2f} ms, {load.output_tokens_per_s:,.0f} output tokens/s, "
                     f"{load.concurrency:.1f} running (sustainable up to {load.max_request_rate:.3g} req/s)")
    return "\n".join(lines), d


_TRAINING_OPTIONS = ("global_batch", "seq_len", "micro_batch", "recompute", "attention", "pointwise",
                     "mixed_precision")
_LAYOUT_OPTIONS = ("devices", "pp", "cp", "vp", "zero", "no_sp", "gpipe")
_REQUEST_OPTIONS = ("input_len", "output_len", "max_num_seqs")


def _refuse_unread(args: argparse.Namespace, names: tuple[str, ...], why: str) -> None:
    """ValueError, worded as argparse's, for the first option of `names` set to other than its
    default (`args.default_of`, the parser's `get_default`): the command's path would drop it; `why`
    says so."""
    for name in names:
        if hasattr(args, name) and getattr(args, name) != args.default_of(name):
            raise ValueError(f"argument --{name.replace('_', '-')}: not allowed {why}")


def _refuse_eager_for_training(args: argparse.Namespace, serving: bool, how: str) -> None:
    """ValueError for --enforce-eager where the command takes its training path, which has no
    decode step to run eagerly and would ignore it; `how` says how to take the serving path."""
    if args.enforce_eager and not serving:
        raise ValueError(f"--enforce-eager is for decode steps, which a training step has none of; {how}")


def plan(args: argparse.Namespace) -> Result:
    _refuse_eager_for_training(args, args.serve, "add --serve to plan serving")
    if args.devices < 1 or args.top < 1:
        raise ValueError(f"--devices and --top must be >= 1, got {args.devices} and {args.top}")
    if args.serve:
        acc = get_accelerator(args.hardware)
        eff, source = efficiency_for(args, acc)
        _refuse_unread(args, _TRAINING_OPTIONS, "with --serve (it describes a training step)")
        plans = planner.plan_serving(_serve_setup(args), args.devices, acc, args.input_len,
                                     args.output_len, args.max_num_seqs, eff)[:args.top]
        if not plans:
            raise ValueError(f"no tensor-parallel degree of {args.model} fits on {args.devices} x {acc.name}")
        lines = [f"{args.model} serving on {args.devices} x {acc.name}, {args.input_len} in / "
                 f"{args.output_len} out; efficiency {source}",
                 f"{'tp':>4}{'replicas':>10}{'ms/token (bs1)':>16}{'max batch':>11}{'tokens/s':>12}"]
        lines += [f"{p.tp:>4}{p.replicas:>10}{p.decode_ms_per_token_batch1:>16.2f}{p.max_batch:>11}"
                  f"{p.throughput_tokens_per_s:>12,.0f}" for p in plans]
        return "\n".join(lines), {"plans": [p.to_dict() for p in plans], "efficiency": source}
    _refuse_unread(args, _REQUEST_OPTIONS, "without --serve (it describes served requests: add --serve)")
    _refuse_unread(args, ("micro_batch", "recompute"), "with perf plan (it tries micro-batches "
                   f"{', '.join(map(str, planner.MICRO_BATCH_SIZES))} and each recomputation, keeping the "
                   "fastest that fits; perf train prices one)")
    setup = train_setup(args)
    acc, eff, source = _training_hardware(args)
    plans = planner.plan_training(setup, args.devices, acc, eff, top=args.top)
    if not plans:
        raise ValueError(f"no layout of {args.model} fits on {args.devices} x {acc.name}")
    lines = [f"{args.model} on {args.devices} x {acc.name}: global batch {args.global_batch} x "
             f"{args.seq_len} tokens, {args.dtype}; efficiency {source}",
             f"{'#':>3}  {'layout':<32}{'mb':>3} {'recompute':<10}{'step s':>8}{'MFU':>7}"
             f"{'GiB/dev':>9}  bound"]
    for i, p in enumerate(plans, start=1):
        r = p.prediction
        lines.append(f"{i:>3}  {r.layout.describe():<32}{p.setup.micro_batch_size:>3} {p.setup.recompute:<10}"
                     f"{r.step_time_s:>8.2f}{100 * r.mfu:>6.1f}%{r.memory_bytes_per_device / 2**30:>9.1f}  "
                     f"{r.work.bound()}")
    lines += planner.explain(plans, acc)
    return "\n".join(lines), {"plans": [p.to_dict() for p in plans], "efficiency": source}


def _scaled(acc: Accelerator, text: str | None) -> Accelerator:
    """`acc` scaled as --scale NAME=FACTOR,... asks; ValueError naming --scale."""
    scales = {}
    for part in (text or "").split(","):
        if part.strip():
            key, _, value = part.partition("=")
            try:
                scales[key.strip()] = float(value)
            except ValueError as e:
                raise ValueError(f"--scale expects NAME=FACTOR pairs, got {part.strip()!r}") from e
    try:
        return acc.scaled(**scales)
    except ValueError as e:
        raise ValueError(f"--scale {text}: {e}") from None


def what_if(args: argparse.Namespace) -> Result:
    """The workload on the device and on --scale's copy of it, a sweep of each resource, what
    reaches a target, and whether it fits in memory on each (a training step's memory per device,
    a decode batch in the KV cache; memory_capacity changes only that)."""
    _refuse_eager_for_training(args, args.serve, "add --serve for a decode step")
    if not args.serve:
        _refuse_unread(args, ("batch", "context"),
                       "without --serve (it describes a decode step: add --serve)")
        if args.target_tokens_per_s_per_user is not None:
            raise ValueError("--target-tokens-per-s-per-user is for a decode step: add --serve")
        setup, layout = train_setup(args), layout_from(args)
        acc, eff, source = _training_hardware(args)
        scaled = _scaled(acc, args.scale)

        def predict(a):
            return predict_training(setup, layout, a, eff)
        base, new = predict(acc), predict(scaled)
        needed = base.memory_bytes_per_device
        factor = whatif.capacity_factor(needed, acc)
        fit_line = (f"  memory {needed / 2**30:.1f} GiB per device: {acc.memory_bytes / 2**30:.1f} GiB "
                    f"{_fit_word(base.fits)} -> {scaled.memory_bytes / 2**30:.1f} GiB {_fit_word(new.fits)}"
                    + ("" if base.fits else f" (fits from memory_capacity x{factor:.2f})"))
        lines, d = _what_if_case(f"training step of {args.model}", lambda a: predict(a).work, acc, scaled,
                                 args.target_step_s, fit_line)
        d |= {"memory_bytes_per_device": needed, "fits": {"baseline": base.fits, "scaled": new.fits},
              "memory_capacity_factor": factor}
        return "\n".join(lines), d | {"scaled_hardware": scaled.name, "efficiency": source}
    _refuse_unread(args, _LAYOUT_OPTIONS + _TRAINING_OPTIONS,
                   "with --serve (it describes a training step; a decode step runs on --tp devices)")
    _refuse_tensor_parallel_on_a_cpu(args)
    acc = get_accelerator(args.hardware)
    eff, source = efficiency_for(args, acc)
    scaled = _scaled(acc, args.scale)
    if args.target_step_s is not None:
        raise ValueError("--target-step-s is for a training step; with --serve use "
                         "--target-tokens-per-s-per-user")
    per_user = args.target_tokens_per_s_per_user
    if per_user is not None and not per_user > 0:
        raise ValueError(f"--target-tokens-per-s-per-user must be > 0, got {per_user}")
    setup = _serve_setup(args)
    room = [_kv_room(setup, a, args.hardware, args.context) for a in (acc, scaled)]
    lines, cases = [], []
    for batch in _ints(args.batch, "--batch", MAX_DECODE_BATCH):
        # Priced where it fits or not: the fit is reported, and a larger memory_capacity may make it.
        def workload(a, batch=batch):
            return serving.step_time(setup, a, decode_contexts=[args.context] * batch, efficiency=eff,
                                     check_memory=False)
        fit_line = (f"  KV cache holds {room[0]:,} such sequences: {_fit_word(batch <= room[0])} -> "
                    f"{room[1]:,}: {_fit_word(batch <= room[1])}")
        label = f"decode step (batch {batch}, context {args.context}) of {args.model}"
        case_lines, case = _what_if_case(label, workload, acc, scaled, per_user and 1.0 / per_user, fit_line)
        lines += case_lines
        cases.append({"batch_size": batch, "context_len": args.context} | case
                     | {"kv_max_sequences": {"baseline": room[0], "scaled": room[1]},
                        "fits": {"baseline": batch <= room[0], "scaled": batch <= room[1]}})
    return "\n".join(lines), {"decode": cases, "scaled_hardware": scaled.name, "efficiency": source}


def _kv_room(setup: serving.ServeSetup, acc: Accelerator, hardware: str, context: int) -> int:
    """How many sequences of `context` tokens and the new one (a decode step's) the KV cache of
    `acc` holds under the engine's default budget, as `perf serve` takes it (on --hardware cpu
    the CPU default); 0 where the weights leave no room."""
    if is_local(hardware):
        budget = min(CPU_KV_CACHE_BYTES, CPU_KV_CACHE_FRACTION * acc.memory_bytes)
        if setup.weights_bytes_per_device() + budget > acc.memory_bytes:
            return 0
        setup = dataclasses.replace(setup, kv_cache_bytes=budget)
    return serving.kv_capacity(setup, acc, context + 1).max_sequences


def _fit_word(fits: bool) -> str:
    return "fits" if fits else "DOES NOT FIT"


def _what_if_case(label: str, workload: Callable[[Accelerator], Work], acc: Accelerator, scaled: Accelerator,
                  target: float | None, fit_line: str) -> tuple[list[str], dict[str, Any]]:
    """One workload's what-if lines and record: baseline against scaled, `fit_line`, the sweep of
    each resource, and what reaches `target` seconds when given."""
    base, new = workload(acc), workload(scaled)
    lines = [f"{label}: {acc.name} {base.total_s * 1e3:.3f} ms (bound by {base.bound()})"
             f" -> {scaled.name} {new.total_s * 1e3:.3f} ms (bound by {new.bound()}), "
             f"x{base.total_s / new.total_s:.2f}", fit_line]
    rows = whatif.sweep(workload, acc)
    lines += [f"  {r['resource']:<17} x{r['factor']:<4g} {1e3 * r['time_s']:>10.3f} ms  bound by {r['bound']}"
              for r in rows]
    d = {"baseline": base.to_dict(), "scaled": new.to_dict(), "sweep": rows}
    if target is not None:
        reqs = whatif.requirements(workload, acc, target)
        d["target_s"], d["requirements"] = target, [r.to_dict() for r in reqs]
        lines.append(f"to reach {1e3 * target:.3f} ms:")
        lines += [f"  {r.resource:<17} " + (f"x{r.factor:.2f}" if r.factor else
                  f"cannot (x1000 still leaves {1e3 * r.floor_s:.3f} ms)") for r in reqs]
    return lines, d


def roofline_cmd(args: argparse.Namespace) -> Result:
    args = _with_engine_header(args, args.records, "--records")
    _refuse_tensor_parallel_on_a_cpu(args)
    acc = _engine_accelerator(args)
    eff, source = efficiency_for(args, acc)
    setup = _serve_setup(args)
    points = [roofline.point(f"prefill {args.input_len}",
                             serving.step_time(setup, acc, prefill_lens=[args.input_len], efficiency=eff))]
    for batch in _ints(args.batch, "--batch", MAX_DECODE_BATCH):
        work = serving.step_time(setup, acc, decode_contexts=[args.context] * batch, efficiency=eff)
        points.append(roofline.point(f"decode bs{batch}", work))
    for step in _engine_steps(args.records, "--records", setup) if args.records else []:
        work = measured.engine_step_work(step, setup, acc, eff)
        points.append(roofline.point(f"{step.phase} bs{step.batch_size} len{step.length}", work, step.step_s))
    d = {"hardware": acc.name, "dtype": args.dtype, "efficiency": source,
         "points": [p.to_dict() | {"above_roof": roofline.above_roof(p, acc, args.dtype)} for p in points]}
    text = roofline.format_points(points, acc, args.dtype)
    if args.out:
        try:
            d["png"] = str(roofline.plot_png(points, acc, args.dtype, args.out))
            text += f"\nwrote {args.out}"
        except RuntimeError as e:  # matplotlib is optional: the table still stands
            d["png_error"] = str(e)
            text += f"\nno PNG: {e}"
    return text, d


def collectives(args: argparse.Namespace) -> Result:
    from slipstream.perf import collectives_bench

    if args.world_size < 2:
        raise ValueError(f"--world-size must be >= 2, got {args.world_size}")
    sizes = collectives_bench.distinct_sizes(_ints(args.sizes, "--sizes"), args.world_size)
    if len(sizes) < 2:
        raise ValueError(f"--sizes {args.sizes}: the alpha-beta fit needs at least two distinct message "
                         f"sizes, and over {args.world_size} ranks these are one message (whole fp32 "
                         "elements, a multiple of the ranks)")
    timings, errors = collectives_bench.measure(args.world_size, args.backend, sizes,
                                                iterations=args.iterations)
    fits = collectives_bench.fit(timings)
    d = {"timings": [t.to_dict() for t in timings], "errors": errors,
         "warnings": collectives_bench.fit_warnings(fits),
         "fits": [dataclasses.asdict(f) | {"busbw_bytes_per_s": f.busbw_bytes_per_s} for f in fits]}
    return collectives_bench.format_report(timings, fits, errors), d


def validate(args: argparse.Namespace) -> Result:
    results = validation.run()
    return validation.format_table(results), {
        "points": [dataclasses.asdict(r) | {"error": r.error} for r in results],
        "summary": validation.summary(results)}


def fit(args: argparse.Namespace) -> Result:
    """Fit the efficiency to this machine's records, starting from --profile's or --efficiency's
    (the defaults without them), and write it as JSON for --efficiency."""
    _refuse_eager_for_training(args, bool(args.engine_records),
                               "it prices --engine-records' decode steps, not --run-dir's training runs")
    args = _with_engine_header(args, args.engine_records, "--engine-records")
    if args.engine_records:
        acc = _engine_accelerator(args)
        eff, _ = efficiency_for(args, acc)
        setup = _serve_setup(args)
        steps = _engine_steps(args.engine_records, "--engine-records", setup)
        cal = measured.fit_engine_steps(steps, setup, acc, eff)
        works = [measured.engine_step_work(s, setup, acc, cal.efficiency) for s in steps]
        rows = [measured.Comparison(f"{s.phase} bs{s.batch_size} len{s.length}", s.step_s, w.total_s)
                for s, w in zip(steps, works, strict=True)]
    else:
        runs = [read_train_run(d) for d in args.run_dir]
        acc, latency_s = train_accelerator(args.hardware, [(str(r.run_dir), r.run_record) for r in runs])
        eff, _ = efficiency_for(args, acc, latency_s)
        cal = measured.fit_train_runs(runs, acc, eff)
        rows = [measured.Comparison(str(r.run_dir), r.median_step_s,
                                    measured.train_run_work(r, acc, cal.efficiency).total_s) for r in runs]
    if args.out:
        Path(args.out).write_text(json.dumps(cal.efficiency.to_dict(), indent=2) + "\n")
    warnings = [f"the {name.removesuffix('_s')} multiplier sits at its bound {scale:g} (fits keep them in "
                f"[{MIN_SCALE:g}, {MAX_SCALE:g}]): the measurements are far from what {acc.name} would "
                "take; are --hardware and the model right?" for name, scale in cal.scales.items()
                if scale in (MIN_SCALE, MAX_SCALE)]
    text = measured.format_comparisons(rows) + f"\nfitted multipliers: {cal.scales}"
    text += "".join(f"\nwarning: {w}" for w in warnings)
    text += f"\nwrote {args.out}" if args.out else ""
    return text, {"hardware": acc.name, "calibration": cal.to_dict(), "rows": [r.to_dict() for r in rows],
                  "warnings": warnings}


ENGINE_RECORD_DEFAULTS = {"model": "llama3-8b", "dtype": "bf16", "hardware": "h100"}
"""--model, --dtype and --hardware of `perf fit` and `perf roofline` where neither the flags nor
the engine records' header name them: the other perf commands' defaults."""


def _with_engine_header(args: argparse.Namespace, path: str | None, flag: str) -> argparse.Namespace:
    """`args` with the defaults `_with_engine_headers` takes from the header records the serving
    engine wrote into `path` (a records file or its metrics directory)."""
    headers = read_engine_headers(_records_file(path, flag)) if path else []
    return _with_engine_headers(args, headers, f"{flag} {path}")


def _with_engine_headers(args: argparse.Namespace, headers: list[dict[str, Any]],
                         where: str) -> argparse.Namespace:
    """`args` with --model, --dtype and --hardware, where not given, taken from the serving engine's
    header records `headers` (its model directory, dtype and device: "cpu" for a CPU, a GPU's
    datasheet name), else `ENGINE_RECORD_DEFAULTS`, and enforce_eager set where every engine ran
    eagerly; ValueError, its message starting with `where`, where the engines that wrote them
    disagree, the model directory is gone, the GPU is not in the accelerator table, or the engines
    served quantized weights, whose GEMMs the serving model does not price."""
    quantized = engines_by(headers, lambda h: h.get("quantization"))
    if quantized:
        raise ValueError(f"{where}: written by engines serving {' and '.join(quantized)} weights "
                         "(EngineConfig.quantization), whose GEMMs perf's serving model does not price; its "
                         "predictions and fits take unquantized engines' records")
    given = {}
    for name, default in ENGINE_RECORD_DEFAULTS.items():
        if getattr(args, name) is not None:
            continue
        if name == "hardware":
            by_value = engines_by(headers, lambda h: _header_hardware(h, where))
        else:
            by_value = engines_by(headers, lambda h, key=name: h.get(key))
        if len(by_value) > 1:
            seen = "; ".join(value + (f" (engines {', '.join(ids)})" if ids else "")
                             for value, ids in by_value.items())
            raise ValueError(f"{where}: written by engines of several {name}s: {seen}; give --{name}")
        given[name] = next(iter(by_value), default)
        if name == "model" and by_value and not (Path(given[name]) / "config.json").is_file():
            raise ValueError(f"{where}: the engine's model directory {given[name]} has no config.json "
                             "any more; give --model")
    if headers and all(h.get("enforce_eager") for h in headers):
        given["enforce_eager"] = True  # the engines ran every step module by module: price them so
    given |= _header_tensor_parallel(args, headers, given.get("hardware", args.hardware) or "", where)
    threads = {h.get("num_threads") for h in headers}
    if is_local(given.get("hardware", args.hardware) or "") and len(threads) == 1 and None not in threads:
        given["engine_threads"] = threads.pop()  # the CPU's peaks at the engine's thread count
    return argparse.Namespace(**vars(args) | given)


def _engine_accelerator(args: argparse.Namespace) -> Accelerator:
    """`get_accelerator(args.hardware)`; for a CPU engine's records, this CPU calibrated at the
    thread count the engine ran with (`engine_threads`, from its header), whose peaks its MFU and
    bandwidth use were against, not at this process's."""
    threads = getattr(args, "engine_threads", None)
    if threads is None:
        return get_accelerator(args.hardware)
    return hardware.local_accelerator(_cpu_calibration(threads))


def _cpu_calibration(threads: int | None) -> hardware.Calibration:
    """This CPU's calibration at `threads` torch threads (this process's count where None)."""
    import torch  # only here: the other perf commands run without it

    previous = torch.get_num_threads()
    if threads is None or threads == previous:
        return hardware.calibrate(device="cpu")
    torch.set_num_threads(threads)
    try:
        return hardware.calibrate(device="cpu")
    finally:
        torch.set_num_threads(previous)


def train_accelerator(hardware_name: str, runs: list[tuple[str, dict[str, Any]]]
                      ) -> tuple[Accelerator, float | None]:
    """(accelerator, measured link latency or None) to price training runs on, given as (where,
    `run` record) pairs: `hardware_name` as the table has it, or for this CPU ("cpu") its
    calibration at the threads each rank computed with (`records.threads_per_rank`) and, for runs
    of several ranks, the gloo link among that many ranks (`hardware.calibrate_link`: measured
    the first time, a few seconds, then cached); ValueError for runs of several thread counts or
    world sizes, which one accelerator cannot price."""
    if not is_local(hardware_name):
        return get_accelerator(hardware_name), None
    threads = {where: threads_per_rank(run) for where, run in runs}
    worlds = {where: world for where, run in runs
              if isinstance(world := run.get("world_size", 1), int) and world > 1}
    for name, values in (("thread counts", threads), ("world sizes", worlds)):
        if len(set(values.values())) > 1:
            raise ValueError(f"--hardware cpu prices runs of one {name[:-1]} at a time; these ran at "
                             f"several {name}: " + ", ".join(f"{w}: {v}" for w, v in values.items()))
    calibration = _cpu_calibration(next(iter(threads.values()), None))
    if not worlds:
        return hardware.local_accelerator(calibration), None
    link = hardware.calibrate_link(next(iter(worlds.values())))
    return hardware.local_accelerator(calibration, link), link.link.latency_s


def _refuse_tensor_parallel_on_a_cpu(args: argparse.Namespace) -> None:
    """ValueError for serving at --tp > 1 on --hardware cpu (see _CPU_TENSOR_PARALLEL); the serving
    commands ask first, before the CPU's calibration is looked up."""
    if getattr(args, "tp", 1) > 1 and is_local(getattr(args, "hardware", None) or ""):
        raise ValueError(f"--tp {args.tp} on --hardware {args.hardware}: " + _CPU_TENSOR_PARALLEL)


_CPU_TENSOR_PARALLEL = ("perf prices tensor-parallel serving on GPUs, not a CPU's ranks, which share its "
                        "memory and exchange through shared memory (serve/shm_collectives.py), for which "
                        "the model has no link")


def _header_tensor_parallel(args: argparse.Namespace, headers: list[dict[str, Any]], hardware: str,
                            where: str) -> dict[str, int]:
    """{"tp": size} for records of engines split over `tensor_parallel_size` > 1 GPUs (priced at
    that layout); ValueError where the engines disagree, --tp says otherwise, or the ranks were a
    CPU's: they share its memory and exchange through shared memory (serve/shm_collectives.py),
    which the model has no link for."""
    sizes = {h.get("tensor_parallel_size") or 1 for h in headers}
    if len(sizes) > 1:
        raise ValueError(f"{where}: written by engines of several tensor_parallel_sizes "
                         f"({', '.join(map(str, sorted(sizes)))})")
    size = sizes.pop() if sizes else 1
    if size == 1:
        return {}
    if is_local(hardware):
        raise ValueError(f"{where}: written by an engine split over {size} CPU processes "
                         f"(tensor_parallel_size {size}); " + _CPU_TENSOR_PARALLEL)
    if getattr(args, "tp", 1) not in (1, size):
        raise ValueError(f"{where}: written by an engine of tensor_parallel_size {size}, not --tp {args.tp}")
    return {"tp": size}


def _header_hardware(header: dict[str, Any], where: str) -> str | None:
    """The --hardware an engine ran on: "cpu" for a CPU, a GPU's datasheet name; None where the
    header names no device; ValueError for a GPU the accelerator table does not know."""
    device, name = header.get("device"), header.get("hardware")
    if device is None:
        return None
    if str(device).startswith("cpu"):
        return "cpu"
    if name and not is_local(str(name)):
        try:
            return get_accelerator(str(name)).name
        except ValueError:
            pass
    raise ValueError(f"{where}: the engine ran on {device} ({name or 'no datasheet'}), which the "
                     "accelerator table does not know; give --hardware (a100, h100, ..., cpu)")


def trace_cmd(args: argparse.Namespace) -> Result:
    step = args.critical_step if args.critical_step is not None else \
        trace.SLOWEST if args.critical_path else None
    report = trace.analyze(args.traces, args.top, args.baseline, args.hardware, critical_path=step)
    return trace_report.format_report(report, args.top), report


def report_cmd(args: argparse.Namespace) -> Result:
    """A run's HTML report (perf.report), written to --out or RUN/report.html; the text summary,
    or with --json the summary less the per-step series the charts draw."""
    run = report.load_run(args.run)
    _refuse_eager_for_training(args, run.kind == "serve", "RUN is a training run")
    if run.kind == "train":
        acc, latency_s = train_accelerator(args.hardware or report.run_hardware(run),
                                           [(f"RUN {args.run}", (run.of_kind("run") or [{}])[-1])])
        eff, source = efficiency_for(args, acc, latency_s)
        summary = report.train_report(run, acc, eff, source, args.model)
    else:
        # The header's model, dtype and hardware as `perf fit` and `roofline` read them: one reading.
        header = report.engine_header(run)
        args = _with_engine_headers(argparse.Namespace(**vars(args) | {"dtype": None}),
                                    run.of_kind("engine_config"), f"RUN {args.run}")
        acc = _engine_accelerator(args)
        eff, source = efficiency_for(args, acc)
        args.max_num_seqs = header.get("max_num_seqs") or MAX_NUM_SEQS
        setup = _serve_setup(args)
        steps = read_engine_steps(run.records, MAX_DECODE_BATCH, setup.shape.max_position_embeddings)
        summary = report.serve_report(run, setup, steps, acc, eff, source)
    out = Path(args.out) if args.out else run.directory / report.REPORT_FILE
    page, charts = report_html.render(summary)
    out.write_text(page)
    summary |= {"html": str(out), "charts": charts, "charts_missing": report_html.charts_missing()}
    text = report.format_text(summary) + (f"\nno charts: {summary['charts_missing']}"
                                          if summary["charts_missing"] else "")
    return text + f"\nwrote {out}", {k: v for k, v in summary.items() if k != "series"}
