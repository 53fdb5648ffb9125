"""Training model's collectives, counted by hand: FSDP2's per-unit all-gathers and reduce-scatters,
the trainer's per-step scalar all-reduces, and overlap only where the link is the device's own."""

from __future__ import annotations

import dataclasses

import pytest

from slipstream.perf.accelerators import Accelerator, get_accelerator
from slipstream.perf.collectives import MeasuredCost
from slipstream.perf.efficiency import default_efficiency
from slipstream.perf.hardware import HostAccelerator
from slipstream.perf.model import Layout, TrainSetup, predict_training
from slipstream.perf.shapes import resolve_model

H100 = get_accelerator("h100")
ALPHA_S, LINK_BYTES_PER_S = 150e-6, 1e9
"""A host link as `calibrate_link` gives one: per-step latency and all-reduce bus bandwidth."""
MEASURED = "given by the test"
# The tiny preset (6 layers, hidden 384, 6 query and 2 KV heads of 64, SwiGLU 1024, vocabulary
# 8192, untied), counted from its widths: q and o 384 x 384, k and v 384 x 128, three MLP
# matrices 384 x 1024, two RMSNorm weights; the root holds the embedding, the lm_head, the norm.
LAYERS = 6
LAYER_PARAMS = 2 * 384 * 384 + 2 * 384 * 128 + 3 * 384 * 1024 + 2 * 384
ROOT_PARAMS = 2 * 8192 * 384 + 384


def _cpu_ranks() -> Accelerator:
    """Two ranks of a calibrated CPU joined by a measured (gloo) link."""
    return Accelerator(name="test cpu (1 threads, calibrated) x 2 ranks over gloo",
                       peak_flops_per_s={"fp32": 1e11}, memory_bandwidth_bytes_per_s=2e10,
                       memory_bytes=2**34, intra_node_bytes_per_s=LINK_BYTES_PER_S, devices_per_node=2,
                       calibrated=True,
                       sources=dict.fromkeys(("peak_flops_per_s", "memory_bandwidth_bytes_per_s",
                                              "memory_bytes", "intra_node_bytes_per_s", "devices_per_node"),
                                             MEASURED))


def _predict(setup: TrainSetup, layout: Layout, acc: Accelerator):
    latency = ALPHA_S if acc.host_link else None
    return predict_training(setup, layout, acc, default_efficiency(acc, latency))


def _tiny(**kw) -> TrainSetup:
    return TrainSetup(shape=resolve_model("tiny"), seq_len=256,
                      **({"dtype": "fp32", "global_batch_size": 8, "micro_batch_size": 2} | kw))


def _all_reduce_s(num_params: float) -> float:
    """An fp32 all-reduce among 2 ranks over the test link: 2 alpha + S / B."""
    return 2 * ALPHA_S + 4 * num_params / LINK_BYTES_PER_S


def _fsdp_microbatch_s(gather_alpha_s: float, gather_busbw: float) -> float:
    """One micro-batch's FSDP2 collectives of the tiny preset over 2 ranks, by hand: an all-gather
    per unit forward (6 layers + the root) and per layer backward, each alpha + (S / 2) / busbw,
    and a gradient all-reduce per unit (gloo's reduce-scatter)."""
    def gather(num_params: float) -> float:
        return gather_alpha_s + 4 * num_params / 2 / gather_busbw

    return (2 * LAYERS * gather(LAYER_PARAMS) + gather(ROOT_PARAMS)
            + LAYERS * _all_reduce_s(LAYER_PARAMS) + _all_reduce_s(ROOT_PARAMS))


def test_fsdp_on_a_host_link_pays_every_units_collectives_exposed():
    """Guards FSDP2's per-unit collectives against a hand count over 2 gloo ranks (fp32, 2
    micro-batches): per micro-batch one all-gather per unit forward (6 layers + the root) and one
    per layer backward (the root stays gathered) and one reduce-scatter per unit (the trainer keeps
    FSDP2's gradient sync on, as torchtitan does), priced as gloo runs it, an all-reduce of the
    unit's gradients; each with its alpha-beta time (2 ranks:
    all-gather alpha + S / 2B, all-reduce 2 alpha + S / B), none hidden under compute."""
    p = _predict(_tiny(), Layout(dp=2, zero_stage=3), _cpu_ranks())
    m = 8 // (2 * 2)
    per_microbatch = _fsdp_microbatch_s(ALPHA_S, LINK_BYTES_PER_S)
    latencies = m * (2 * LAYERS + 1 + 2 * (LAYERS + 1))
    print(f"FSDP: {latencies} alphas, {1e3 * p.parts['data_parallel'].comm_s:.3f} ms")
    assert p.parts["data_parallel"].comm_s == pytest.approx(m * per_microbatch, rel=1e-9)
    assert p.parts["data_parallel"].comm_bytes == pytest.approx(
        4 * m * (2 * LAYERS * LAYER_PARAMS + ROOT_PARAMS + LAYERS * LAYER_PARAMS + ROOT_PARAMS))
    assert LAYER_PARAMS * LAYERS + ROOT_PARAMS == resolve_model("tiny").num_params()


def test_fsdp_on_a_host_link_measured_per_collective_pays_each_calls_own_cost():
    """Guards FSDP2's collectives on a host whose link was measured collective by collective
    (`hardware.HostAccelerator`): the same hand count as above, each all-gather now at the
    all-gather's own fitted line, 290 us + (S / 2) / 0.8 GB/s (the ring priced one step, 150 us, at
    the link's 1 GB/s), each gradient all-reduce at the all-reduce's, the link itself."""
    gather_alpha, gather_busbw = 290e-6, 0.8e9
    costs = {"all_reduce": MeasuredCost(2.0, 1.0),
             "all_gather": MeasuredCost(gather_alpha / ALPHA_S, gather_busbw / LINK_BYTES_PER_S)}
    acc = HostAccelerator(**{f.name: getattr(_cpu_ranks(), f.name) for f in dataclasses.fields(Accelerator)},
                          collective_costs=costs)
    p = _predict(_tiny(), Layout(dp=2, zero_stage=3), acc)
    m = 8 // (2 * 2)
    per_microbatch = _fsdp_microbatch_s(gather_alpha, gather_busbw)
    assert p.parts["data_parallel"].comm_s == pytest.approx(m * per_microbatch, rel=1e-9)
    assert p.parts["loss_sync"].comm_s == pytest.approx(_all_reduce_s(1), rel=1e-9)


def test_fsdp_on_a_gpu_reduce_scatters_and_moves_the_same_bytes():
    """Guards the per-unit count on an H100 pair: the same all-gathered and reduce-scattered bytes
    as the hand count (reduce-scatters now, NCCL has them), hidden under the step's compute as
    before (the tiny model's collectives on NVLink take microseconds)."""
    p = _predict(_tiny(), Layout(dp=2, zero_stage=3), H100)
    m = 2
    assert p.parts["data_parallel"].comm_bytes == pytest.approx(
        4 * m * (2 * LAYERS * LAYER_PARAMS + ROOT_PARAMS + LAYERS * LAYER_PARAMS + ROOT_PARAMS))
    assert p.parts["data_parallel"].comm_s == 0.0


def test_ddp_gradients_hide_on_a_gpu_and_not_on_a_host_link():
    """Guards DDP's all-reduce against the alpha-beta formula by hand: on 8 H100s (NVLink at 400 of
    its 450 GB/s per direction, 0.936 us a ring step: ASTRA-sim's validated figures) Llama-3 8B's
    fp32 gradients (4 x 8,030,261,248 bytes) cost 14 alpha + 2 x 7/8 x S / B = 0.14054 s unhidden,
    and nothing once hidden under the backward, unchanged by this model's host-link rule; over a
    gloo link `dp_overlap` changes nothing: 2 alpha + S / B, exposed either way."""
    gpu = TrainSetup(shape=resolve_model("llama3-8b"), global_batch_size=64, seq_len=4096, dp_overlap=False)
    exposed = _predict(gpu, Layout(dp=8, zero_stage=0), H100).parts["data_parallel"].comm_s
    grads = 4 * 8_030_261_248
    assert exposed == pytest.approx(14 * 0.936e-6 + 2 * 7 / 8 * grads / 400e9, rel=1e-9)
    assert exposed == pytest.approx(0.14054, abs=1e-5)
    hidden = _predict(dataclasses.replace(gpu, dp_overlap=True), Layout(dp=8, zero_stage=0), H100)
    assert hidden.parts["data_parallel"].comm_s == 0.0

    cpu = {overlap: _predict(_tiny(dp_overlap=overlap), Layout(dp=2, zero_stage=0), _cpu_ranks())
           for overlap in (True, False)}
    expected = 2 * ALPHA_S + 4 * resolve_model("tiny").num_params() / LINK_BYTES_PER_S
    for p in cpu.values():
        assert p.parts["data_parallel"].comm_s == pytest.approx(expected, rel=1e-9)


def test_the_trainers_scalar_all_reduces_are_priced_where_they_run():
    """Guards the trainer's per-step scalars over 2 gloo ranks: the logged loss's all-reduce (2 alpha
    + 4 bytes / B) after every step; the gradient norm's inside the optimizer phase where the
    gradients are split (FSDP, tensor parallelism), not under DDP, whose gradients are whole."""
    scalar = 2 * ALPHA_S + 4 / LINK_BYTES_PER_S
    layouts = {"ddp": Layout(dp=2, zero_stage=0), "fsdp": Layout(dp=2, zero_stage=3),
               "tp": Layout(tp=2, sequence_parallel=True)}
    for name, layout in layouts.items():
        setup = _tiny(global_batch_size=4) if name == "tp" else _tiny()
        p = _predict(setup, layout, _cpu_ranks())
        assert p.parts["loss_sync"].comm_s == pytest.approx(scalar, rel=1e-12)
        assert p.parts["optimizer"].comm_s == (0.0 if name == "ddp" else pytest.approx(scalar, rel=1e-12))
    single = _predict(_tiny(global_batch_size=4), Layout(), _cpu_ranks())
    assert single.parts["loss_sync"].comm_s == 0.0 and single.parts["optimizer"].comm_s == 0.0


def test_tensor_parallel_collectives_overlap_only_on_a_devices_link():
    """Guards `tp_overlap` on each kind of link: over gloo ("backward", Megatron's overlap with the
    weight-gradient GEMMs) prices exactly what "none" does, since the collectives take the cores
    that compute; on H100s "backward" hides part of them."""
    layout = Layout(tp=2, sequence_parallel=True)
    for acc, same in ((_cpu_ranks(), True), (H100, False)):
        comm = {o: _predict(_tiny(global_batch_size=4, tp_overlap=o), layout, acc).work.comm_s
                for o in ("backward", "none")}
        assert (comm["backward"] == comm["none"]) is same, (acc.name, comm)


@pytest.mark.parametrize(("mixed_precision", "gathered_bytes"), [("autocast", 4), ("parameters", 2)])
def test_fsdp_gathers_weights_in_the_dtype_it_holds_them(mixed_precision, gathered_bytes):
    """Guards the all-gathered bytes of bf16 FSDP2: slipstream's trainer shards fp32 parameters
    with no MixedPrecisionPolicy (train/parallel.py), so under autocast each unit gathers 4 bytes a
    parameter and autocast casts them after; with 16-bit parameters (torchtitan's param_dtype) 2.
    Gradients are reduce-scattered in fp32 either way (4 bytes)."""
    p = _predict(_tiny(dtype="bf16", mixed_precision=mixed_precision), Layout(dp=2, zero_stage=3), H100)
    m = 2
    gathered = m * (2 * LAYERS * LAYER_PARAMS + ROOT_PARAMS)
    assert p.parts["data_parallel"].comm_bytes == pytest.approx(
        gathered_bytes * gathered + 4 * m * (LAYERS * LAYER_PARAMS + ROOT_PARAMS))


def test_tensor_parallel_experts_all_reduce_each_their_rows():
    """Guards a mixture-of-experts layer's tensor-parallel collectives against a hand count of what
    the trainer runs (train/parallel.py splits each expert; no sequence parallelism here): per
    layer and micro-batch, attention's all-reduce of the N x E stream, then each of the experts
    the N tokens touch (all 8 of tiny-moe's at N = 512) all-reduces its N k / 8 output rows in the
    forward and the input gradients of its gate and up products in the backward; attention's
    all-reduce again in the backward. Each all-reduce among 2 ranks: 2 alpha + S / B."""
    shape = resolve_model("tiny-moe")
    assert (shape.num_layers, shape.hidden_size, shape.num_experts, shape.experts_per_token) == (6, 384, 8, 2)
    setup = TrainSetup(shape=shape, seq_len=256, dtype="fp32", global_batch_size=4, micro_batch_size=2)
    p = _predict(setup, Layout(tp=2), _cpu_ranks())
    n, row = 2 * 256, 384 * 4

    def all_reduce_s(nbytes: float) -> float:
        return 2 * ALPHA_S + nbytes / LINK_BYTES_PER_S

    attention, experts = all_reduce_s(n * row), 8 * all_reduce_s(n * 2 / 8 * row)
    per_layer = (attention + experts) + (attention + 2 * experts)
    assert p.parts["pipeline"].comm_s == pytest.approx(6 * 2 * per_layer, rel=1e-9)


# Llama-3 8B's widths (hidden 4096, 32 query and 8 KV heads of 128, SwiGLU 14336, vocabulary
# 128256, untied): a layer's matrices and two RMSNorm weights; the last stage's root the lm_head
# and the final norm.
LLAMA8B_LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
LLAMA8B_HEAD = 128256 * 4096 + 4096
NVLINK_STEP_S, NVLINK_BYTES_PER_S = 0.936e-6, 400e9
"""An H100's ring step latency and NVLink bandwidth in its default efficiency (see the DDP test)."""


def _host_of(devices_per_node: int) -> Accelerator:
    return dataclasses.replace(_cpu_ranks(), devices_per_node=devices_per_node)


def test_fsdp_with_pipeline_stages_gathers_and_reduces_each_unit_once_a_step():
    """Guards FSDP2 under torch's `PipelineStage` (gradient sync and resharding after the backward
    off for every micro-batch, `perform_reduce_grad` after the schedule; the stages wrapped with
    `reshard_after_forward=False`): over 2 gloo ranks per stage (dp 2 x pp 2, fp32, 2 micro-batches)
    each unit of the larger stage (3 layers and the last stage's root: lm_head and norm) is
    all-gathered once and its gradients all-reduced once a step, whatever m, exposed."""
    host = _host_of(4)
    for batch in (8, 16):  # 2 and 4 micro-batches a step
        p = _predict(_tiny(global_batch_size=batch), Layout(dp=2, pp=2, zero_stage=3), host)
        root = 8192 * 384 + 384

        def gather(num_params: float) -> float:
            return ALPHA_S + 4 * num_params / 2 / LINK_BYTES_PER_S

        expected = (3 * gather(LAYER_PARAMS) + gather(root)
                    + 3 * _all_reduce_s(LAYER_PARAMS) + _all_reduce_s(root))
        assert p.parts["data_parallel"].comm_s == pytest.approx(expected, rel=1e-9)
        assert p.parts["data_parallel"].comm_bytes == pytest.approx(4 * 2 * (3 * LAYER_PARAMS + root))


def test_fsdp_with_pipeline_stages_exposes_the_reduce_scatters_after_the_schedule():
    """Guards the overlap of FSDP2 under a pipeline on 8 H100s (dp 4 x pp 2, one node): the
    all-gathers hide under the first micro-batch's forward (16 Llama-3 8B layers at 4096 tokens,
    tens of milliseconds), the reduce-scatters of the fp32 gradients run after the schedule with
    nothing to hide under: per unit of the last stage (16 layers, the lm_head and norm) a 4-rank
    ring, 3 steps + 3/4 S / B."""
    setup = TrainSetup(shape=resolve_model("llama3-8b"), global_batch_size=16, seq_len=4096)
    p = _predict(setup, Layout(dp=4, pp=2, zero_stage=3), H100)

    def scatter(num_params: float) -> float:
        return 3 * NVLINK_STEP_S + 3 / 4 * 4 * num_params / NVLINK_BYTES_PER_S

    expected = 16 * scatter(LLAMA8B_LAYER) + scatter(LLAMA8B_HEAD)
    assert p.parts["data_parallel"].comm_s == pytest.approx(expected, rel=1e-9)


def test_a_tied_embedding_is_summed_between_the_first_and_last_stages():
    """Guards the tied table's gradient sum with pp > 1 (`train.pipeline.sum_tied_embedding_grads`):
    one all-reduce between the two ranks holding its copies, of its fp32 gradient (V x H / tp, and
    / dp under FSDP, which has reduce-scattered it by then), after the schedule and exposed; none
    untied or with one stage. On H100s of one node a 2-rank ring: 2 steps + S / B. Over a gloo
    link (tiny, pp 2): 2 alpha + S / B, and the gradient norm's scalar summed over the stages."""
    shape = resolve_model("llama3.2-1b")  # tied: vocabulary 128256 x hidden 2048
    assert shape.tied_embeddings
    setup = TrainSetup(shape=shape, global_batch_size=16, seq_len=2048)
    table = 4 * 128256 * 2048

    def pair_s(size: float) -> float:
        return 2 * NVLINK_STEP_S + size / NVLINK_BYTES_PER_S

    cases = {Layout(pp=2): pair_s(table), Layout(pp=2, dp=2, zero_stage=0): pair_s(table),
             Layout(pp=2, dp=2, zero_stage=3): pair_s(table / 2),
             Layout(pp=2, tp=2, sequence_parallel=True): pair_s(table / 2), Layout(dp=2): 0.0}
    for layout, expected in cases.items():
        p = _predict(setup, layout, H100)
        assert p.parts["embedding_sync"].comm_s == pytest.approx(expected, rel=1e-9), layout.describe()
        assert p.step_time_s == pytest.approx(sum(w.total_s for w in p.parts.values()), rel=1e-12)
    untied = dataclasses.replace(setup, shape=dataclasses.replace(shape, tied_embeddings=False))
    assert _predict(untied, Layout(pp=2), H100).parts["embedding_sync"].comm_s == 0.0

    tied = dataclasses.replace(resolve_model("tiny"), tied_embeddings=True)
    tiny = dataclasses.replace(_tiny(), shape=tied)
    p = _predict(tiny, Layout(pp=2), _cpu_ranks())
    assert p.parts["embedding_sync"].comm_s == pytest.approx(_all_reduce_s(8192 * 384), rel=1e-9)
    assert p.parts["optimizer"].comm_s == pytest.approx(2 * ALPHA_S + 4 / LINK_BYTES_PER_S, rel=1e-12)
