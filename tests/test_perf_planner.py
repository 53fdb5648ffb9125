"""Planner (feasible layouts, ranking, explanation) and what-if hardware."""

from __future__ import annotations

import dataclasses

import pytest

from slipstream.perf.accelerators import Accelerator, get_accelerator
from slipstream.perf.efficiency import Efficiency
from slipstream.perf.model import Layout, TrainSetup, layout_error, predict_training
from slipstream.perf.planner import candidate_layouts, explain, plan_serving, plan_training
from slipstream.perf.serving import ServeSetup, step_time
from slipstream.perf.shapes import resolve_model
from slipstream.perf.whatif import requirements, sweep

H100 = get_accelerator("h100")


def test_plan_ranks_feasible_layouts():
    """Guards the planner: every plan fits, uses all devices, and plans are sorted by speed."""
    setup = TrainSetup(shape=resolve_model("llama3-8b"), global_batch_size=64, seq_len=4096)
    plans = plan_training(setup, 16, H100, top=5)
    assert plans, "no plan"
    times = [p.prediction.step_time_s for p in plans]
    assert times == sorted(times)
    for p in plans:
        assert p.prediction.fits and p.prediction.layout.num_devices == 16
    lines = explain(plans, H100)
    print("\n".join(lines))
    assert lines[0].startswith("#1 ") and "bound by" in lines[0]


def test_candidates_respect_node_and_shape():
    """Guards enumeration: TP stays within a node and divides the heads; degrees multiply to N."""
    setup = TrainSetup(shape=resolve_model("llama3-70b"), global_batch_size=256, seq_len=8192)
    layouts = candidate_layouts(setup, 64, H100)
    assert layouts and all(lay.num_devices == 64 for lay in layouts)
    assert all(lay.tp <= 8 and 64 % lay.tp == 0 for lay in layouts)


def test_tensor_parallelism_splits_kv_heads_as_megatron_and_vllm_do():
    """Guards TP against K/V heads: training needs tp to divide them (Megatron's query groups);
    serving also takes a tp that is a multiple of them, replicating them (vLLM). A Qwen2.5-1.5B
    shape (2 K/V heads) trains at tp 1 or 2 only; 4 K/V heads serve at tp 8 but do not train at it;
    a tp of 6 over 4 K/V heads is refused; Qwen2.5-7B's 18,944 MLP columns take no
    tp of 7 (vLLM refuses it)."""
    base = resolve_model("llama3-8b")
    qwen_1_5b = dataclasses.replace(base, num_heads=12, num_kv_heads=2, hidden_size=1536,
                                    ffn_hidden_size=8960, num_layers=28)
    setup = TrainSetup(shape=qwen_1_5b, global_batch_size=64, seq_len=4096)
    assert {lay.tp for lay in candidate_layouts(setup, 8, H100)} == {1, 2}
    four_kv = dataclasses.replace(base, num_kv_heads=4)
    ServeSetup(shape=four_kv, tp=8)  # each rank holds a copy of one K/V head
    with pytest.raises(ValueError, match="K/V heads"):
        predict_training(TrainSetup(shape=four_kv, global_batch_size=8, seq_len=4096), Layout(tp=8), H100)
    with pytest.raises(ValueError, match="K/V heads"):
        ServeSetup(shape=dataclasses.replace(four_kv, num_heads=24, ffn_hidden_size=24576), tp=6)
    qwen_7b = dataclasses.replace(base, num_heads=28, num_kv_heads=4, hidden_size=3584, ffn_hidden_size=18944)
    assert all(plan.tp != 7 for plan in plan_serving(ServeSetup(shape=qwen_7b), 7, H100, 1024, 256))


def test_interleaved_pipeline_needs_micro_batches_in_multiples_of_pp():
    """Guards Megatron's rule for the interleaved schedule: the micro-batches per step are a
    multiple of pp; Llama 3 70B on 64 H100s at a global batch of 6 was planned at pp 8, v 4."""
    setup = TrainSetup(shape=resolve_model("llama3-70b"), global_batch_size=6, seq_len=4096)
    plans = plan_training(setup, 64, H100, top=50)
    for plan in plans:
        layout = plan.prediction.layout
        assert layout.virtual_stages == 1 or plan.setup.num_microbatches(layout) % layout.pp == 0
    interleaved = Layout(tp=8, pp=8, virtual_stages=4)
    with pytest.raises(ValueError, match="interleaved"):
        predict_training(dataclasses.replace(setup, micro_batch_size=1), interleaved, H100)


def test_too_small_a_cluster_has_no_plan():
    """Guards infeasibility: a 405B model does not fit on 8 GPUs, so no layout is returned."""
    setup = TrainSetup(shape=resolve_model("llama3-405b"), global_batch_size=16, seq_len=8192)
    assert plan_training(setup, 8, H100) == []


def test_serving_plan_prefers_replicas_when_the_model_fits():
    """Guards the serving planner: an 8B model on 8 GPUs is fastest as replicas, TP divides heads."""
    plans = plan_serving(ServeSetup(shape=resolve_model("llama3-8b")), 8, H100, 1024, 256)
    assert [p.tp * p.replicas for p in plans] == [8] * len(plans)
    assert plans[0].throughput_tokens_per_s >= plans[-1].throughput_tokens_per_s


def test_whatif_memory_bound_decode_needs_bandwidth_not_flops():
    """Guards what-if: batch-1 decode is memory-bound, so FLOP/s do not help and bandwidth does,
    about in proportion (no overheads, ideal efficiency)."""
    ideal = Efficiency(gemm_fraction=1, attention_fraction=1, memory_fraction=1, gemm_overhead_s=0,
                       kernel_overhead_s=0)
    setup = ServeSetup(shape=resolve_model("llama3-8b"))

    def workload(acc):
        return step_time(setup, acc, decode_contexts=[1024], efficiency=ideal)

    base = workload(H100).total_s
    rows = {(r["resource"], r["factor"]): r for r in sweep(workload, H100)}
    assert rows[("flops", 2.0)]["time_s"] == pytest.approx(base)
    assert rows[("memory_bandwidth", 2.0)]["time_s"] == pytest.approx(base / 2, rel=0.01)
    reqs = {r.resource: r for r in requirements(workload, H100, base / 1.5)}
    assert reqs["memory_bandwidth"].factor == pytest.approx(1.5, rel=0.01)
    assert reqs["flops"].factor is None and reqs["link"].factor is None
    with pytest.raises(ValueError, match="target"):
        requirements(workload, H100, 0)


@pytest.mark.parametrize("hardware, dtype, expected", [
    ("a100", "fp8", "A100 SXM 80GB lists no fp8 peak"),
    ("v5e", "fp32", "TPU v5e lists no fp32 peak"),
])
def test_plan_names_a_dtype_the_device_cannot_run(hardware, dtype, expected):
    """A dtype without a peak on the device is no layout's fault: the planner says so, in
    predict_training's words (`perf train`'s), where it used to answer "no layout fits"."""
    setup = TrainSetup(shape=resolve_model("llama3-8b"), global_batch_size=64, seq_len=4096, dtype=dtype)
    with pytest.raises(ValueError, match=expected) as planned:
        plan_training(setup, 8, get_accelerator(hardware))
    with pytest.raises(ValueError) as trained:
        predict_training(setup, Layout(dp=8), get_accelerator(hardware))
    assert str(planned.value) == str(trained.value)


def test_plan_names_a_device_without_links():
    """A device that lists no link (a CPU) cannot run any multi-device layout: the planner names
    the missing link, as `perf train` does, and still plans one device."""
    cpu = Accelerator(name="cpu-like", peak_flops_per_s={"fp32": 1e12}, memory_bandwidth_bytes_per_s=5e10,
                      memory_bytes=24 * 2**30,
                      sources=dict.fromkeys(("peak_flops_per_s", "memory_bandwidth_bytes_per_s",
                                             "memory_bytes"), "test"))
    setup = TrainSetup(shape=resolve_model("tiny"), global_batch_size=8, seq_len=256, dtype="fp32")
    with pytest.raises(ValueError, match="cpu-like lists no link bandwidth; collectives need one"):
        plan_training(setup, 4, cpu)
    with pytest.raises(ValueError, match="cpu-like lists no link bandwidth; collectives need one"):
        predict_training(setup, Layout(dp=2), cpu)
    assert plan_training(setup, 1, cpu)[0].prediction.fits


def test_plan_skips_layouts_only_for_their_shape():
    """`layout_error` is what the planner skips a layout for: an interleaved schedule whose
    micro-batches are no multiple of pp (Megatron's rule) is skipped, a valid one is not."""
    setup = TrainSetup(shape=resolve_model("llama3-8b"), global_batch_size=6, seq_len=4096)
    assert "multiple of pp=4" in layout_error(setup, Layout(dp=1, pp=4, virtual_stages=2))
    assert layout_error(dataclasses.replace(setup, global_batch_size=8),
                        Layout(dp=1, pp=4, virtual_stages=2)) is None
