"""Training step time, memory per device and MFU for a shape, a batch and a parallel layout.

A step is `m = global_batch / (dp * micro_batch)` micro-batches through a pipeline of `pp`
stages, each device holding `L / pp` layers split `tp` ways over `num_tokens = b * s / cp` tokens:

- per layer and micro-batch: forward, backward (2x the GEMMs), recomputation (full: the forward
  again, with its collectives; selective: the attention core, Korthikanti et al. 2022 section 5),
  tensor-parallel collectives from the alpha-beta model (`collectives.py`); pointwise work eager
  (op by op, as slipstream's trainer runs it) or fused (`TrainSetup.pointwise`);
- overlap, stated: tensor-parallel collectives are exposed in the forward; in the backward they
  overlap the weight-gradient GEMMs (`tp_overlap="backward"`, as Megatron does, Korthikanti et al.
  section 6.2), or not at all, or fully (`"full"`, asynchronous TP);
- pipeline: the slowest stage sets the pace, plus the bubble `(p - 1) / v` stage-times (1F1B:
  Narayanan et al. 2021, arXiv 2104.04473, section 2.2; interleaved with v chunks per device:
  section 2.2.2; GPipe's bubble is 1F1B's, Huang et al. 2019), plus point-to-point sends of each
  micro-batch's activations;
- data parallel: gradient all-reduce (ZeRO-1/2: reduce-scatter + all-gather, same bytes) once per
  step, hidden under the last micro-batch's backward when `dp_overlap`; ZeRO-3/FSDP unit by unit
  as FSDP2 runs it (each layer and the root: all-gathers forward and backward and reduce-scatters,
  every micro-batch, as torchtitan runs it), prefetched under compute; with pp > 1 as torch's
  `PipelineStage` runs FSDP2: each unit all-gathered once (the first forward) and reduce-scattered
  once, after the schedule;
- with pp > 1 and tied embeddings: the first and last stages' copies of the table sum their
  gradients (an all-reduce between two ranks) after the schedule, exposed;
- on a host link (`Accelerator.host_link`: gloo among processes of one CPU) no collective overlaps
  compute: `dp_overlap` and `tp_overlap` change nothing there;
- the trainer's scalar all-reduces: the logged loss after every step, the gradient norm where
  the gradients are split (FSDP, tensor parallelism) and over the pipeline stages;
- context parallel: ring attention passes K and V around the group, overlapped with attention;
- the optimizer step streams each local parameter's weights, gradient and Adam moments.

MFU is PaLM's (appendix B): model FLOPs per token `6 N + 12 L H Q T` (no causal halving, no
recomputation) times tokens per second, over the dense peak of all devices; HFU adds recomputation.
For a mixture-of-experts shape N is the active weights (the router, k experts, the shared expert:
Megatron's and torchtitan's MoE MFU), while memory, gradients and the optimizer hold every expert.
Its layers are priced by kind (`layers.layer_kinds`); pipeline stages of whole layers need every
layer alike, so a shape that mixes dense and MoE layers takes pp = 1. Expert parallelism (experts
whole on different devices, all-to-all dispatch) is not modeled: tensor parallelism splits every
expert as it splits the dense MLP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slipstream.perf.accelerators import Accelerator, dtype_key
from slipstream.perf.efficiency import Efficiency, default_efficiency
from slipstream.perf.flops import expected_experts_touched
from slipstream.perf.layers import (
    ATTENTION_KERNELS,
    POINTWISE_KERNELS,
    Device,
    LayerSpec,
    attention_recompute,
    layer_backward,
    layer_forward,
    layer_kinds,
    tp_collectives,
)
from slipstream.perf.memory import (
    RECOMPUTE_MODES,
    MemoryBreakdown,
    pipeline_error,
    stage_layers,
    stage_params,
    training_memory,
)
from slipstream.perf.shapes import TransformerShape
from slipstream.perf.work import Work, total

TP_OVERLAP = ("none", "backward", "full")
MIXED_PRECISION = ("autocast", "parameters")
OPTIMIZER_BYTES_PER_PARAM = 38
"""Adam step traffic per local parameter: read fp32 master, grad, m, v (16 B), write master, m, v
and the 16-bit weight (14 B), plus the gradient-norm read and the zeroing write (8 B)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """How N devices split the work: data, tensor, pipeline and context parallel degrees."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 1
    """0: plain data parallel; 1-2: sharded optimizer (and gradients); 3: FSDP."""
    virtual_stages: int = 1
    """Model chunks per device: 1 is 1F1B, more is the interleaved schedule."""
    gpipe: bool = False
    """GPipe's schedule (Huang et al. 2019, arXiv 1811.06965) instead of 1F1B: every micro-batch's
    forward, then every backward. The same bubble, but each stage holds the activations of all
    m micro-batches (Narayanan et al. 2021, section 2.2.1), the last stage their logits too."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"layout.{name} must be a positive integer, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"layout.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        if self.virtual_stages > 1 and self.pp == 1:
            raise ValueError("virtual_stages > 1 (interleaved schedule) needs pp > 1")
        if not isinstance(self.gpipe, bool):
            raise ValueError(f"layout.gpipe must be a bool, got {self.gpipe!r}")
        if self.gpipe and (self.pp == 1 or self.virtual_stages > 1):
            raise ValueError("gpipe (GPipe's schedule) needs pp > 1 and one stage per device "
                             "(virtual_stages=1)")

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def schedule(self) -> str:
        if self.pp == 1:
            return "none"
        return "interleaved-1f1b" if self.virtual_stages > 1 else "gpipe" if self.gpipe else "1f1b"

    def describe(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"cp{self.cp}"]
        extras = (["sp"] if self.sequence_parallel else []) + [f"zero{self.zero_stage}"]
        extras += [f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []
        extras += ["gpipe"] if self.gpipe else []
        return " ".join(parts + extras)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSetup:
    """What is trained: the shape, the batch, the numerics and the implementation choices."""

    shape: TransformerShape
    global_batch_size: int
    """Sequences per optimizer step over all data-parallel ranks."""
    seq_len: int
    micro_batch_size: int = 1
    dtype: str = "bf16"
    recompute: str = "none"
    attention: str = "flash"
    """The attention kernel of a shape that leaves the choice open (see `attention_kernel`)."""
    pointwise: str = "eager"
    """"eager": norms, activation and rotary embeddings op by op, as slipstream's trainer and
    torchtitan without torch.compile run them; "fused": one kernel each (Megatron, torch.compile)."""
    dropout: bool = False
    mixed_precision: str = "autocast"
    """How 16-bit training holds its numbers (no effect in fp32/tf32). "autocast": slipstream's
    trainer, fp32 parameters under `torch.autocast`, so each micro-batch casts the weights to 16
    bits and their gradients back to fp32, and the residual stream (embedding output, residual
    adds, norm inputs) stays fp32. "parameters": 16-bit parameters (Megatron; torchtitan's FSDP
    `param_dtype`), so the residual stream is 16-bit and nothing is cast per micro-batch."""
    weight_bytes: float | None = None
    grad_bytes: float | None = None
    optimizer_bytes: float | None = None
    """Bytes per parameter; None follows `dtype` and `mixed_precision` (see
    `state_bytes_per_param`)."""
    tp_overlap: str = "backward"
    dp_overlap: bool = True
    reserved_bytes: float = 2 * 2**30
    """CUDA context, communication buffers, allocator fragmentation (the cookbook's 'misc')."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "seq_len", "micro_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        dtype_key(self.dtype)
        checks = (("recompute", RECOMPUTE_MODES), ("attention", ATTENTION_KERNELS),
                  ("pointwise", POINTWISE_KERNELS), ("mixed_precision", MIXED_PRECISION),
                  ("tp_overlap", TP_OVERLAP))
        for name, valid in checks:
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {valid}, got {getattr(self, name)!r}")
        for name in ("weight_bytes", "grad_bytes", "optimizer_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value >= 0):
                raise ValueError(f"{name} must be None or >= 0 bytes per parameter, got {value!r}")

    @property
    def attention_kernel(self) -> str:
        """The kernel the trainer runs: `attention`, but "unfused" for soft-capped scores (Gemma 2)
        and attention sinks (gpt-oss), which slipstream computes with explicit matmuls whatever a
        fused kernel could do."""
        return "unfused" if self.shape.attention_softcap or self.shape.attention_sinks else self.attention

    @property
    def activation_bytes(self) -> int:
        """Bytes per saved activation element: 4 in fp32/tf32, else 2 (autocast's bf16/fp16)."""
        return 4 if dtype_key(self.dtype) in ("fp32", "tf32") else 2

    @property
    def autocast(self) -> bool:
        """16-bit compute on fp32 parameters through `torch.autocast` (see `mixed_precision`)."""
        return self.activation_bytes == 2 and self.mixed_precision == "autocast"

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the residual stream: 4 in fp32 and under autocast, else 2."""
        return 4 if self.autocast else self.activation_bytes

    def state_bytes_per_param(self) -> tuple[float, float, float]:
        """Weight, gradient and optimizer bytes per parameter; explicit fields win.

        As slipstream's trainer runs it (`slipstream/train`): parameters, gradients and AdamW's
        two moments are fp32 (4, 4, 8 bytes); under autocast a 16-bit copy of every weight also
        lives from the forward to the backward (its cast cache, saved for the input gradient), so
        weights cost 4 + 2 bytes. With 16-bit `parameters` the fp32 master weights are counted
        with the optimizer (weight 2, grad 4, optimizer 12: Megatron's split).
        """
        if self.activation_bytes == 2 and not self.autocast:
            defaults = (2.0, 4.0, 12.0)
        else:
            defaults = (6.0 if self.autocast else 4.0, 4.0, 8.0)
        given = (self.weight_bytes, self.grad_bytes, self.optimizer_bytes)
        return tuple(d if g is None else float(g) for g, d in zip(given, defaults, strict=True))

    def num_microbatches(self, layout: Layout) -> int:
        per_rank, rem = divmod(self.global_batch_size, layout.dp * self.micro_batch_size)
        if rem or per_rank == 0:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of dp "
                f"({layout.dp}) x micro_batch_size ({self.micro_batch_size})"
            )
        return per_rank

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


@dataclasses.dataclass(frozen=True)
class TrainingPrediction:
    """The model's answer for one (setup, layout, accelerator)."""

    layout: Layout
    step_time_s: float
    mfu: float
    hfu: float
    tokens_per_s: float
    memory: MemoryBreakdown
    fits: bool
    work: Work
    breakdown_s: dict[str, float]
    model_flops_per_step: float
    parts: dict[str, Work] = dataclasses.field(default_factory=dict)
    """The step's Work by phase: "pipeline" (forward, backward), "bubble", "data_parallel",
    "embedding_sync" (the tied table's gradient summed between the first and last stages),
    "optimizer" (with the gradient norm's all-reduces), "loss_sync" (the logged loss's all-reduce,
    after the optimizer); they sum to `work`."""

    @property
    def memory_bytes_per_device(self) -> float:
        return self.memory.total_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": dataclasses.asdict(self.layout) | {"describe": self.layout.describe()},
            "step_time_s": self.step_time_s, "mfu": self.mfu, "hfu": self.hfu,
            "tokens_per_s": self.tokens_per_s, "memory_bytes_per_device": self.memory_bytes_per_device,
            "memory": self.memory.to_dict(), "fits": self.fits, "bound": self.work.bound(),
            "breakdown_s": self.breakdown_s, "work": self.work.to_dict(),
            "model_flops_per_step": self.model_flops_per_step,
        }


def predict_training(
    setup: TrainSetup, layout: Layout, accelerator: Accelerator, efficiency: Efficiency | None = None,
) -> TrainingPrediction:
    """Step time, MFU and memory per device; see the module docstring for what is modeled."""
    _check_layout(setup, layout)
    device = _device(setup, accelerator, efficiency)
    m = setup.num_microbatches(layout)
    spec = _layer_spec(setup, layout)
    layer = _layer_microbatch(setup, layout, spec, device)
    stages = _stage_works(setup, layout, spec, device, layer)
    slowest = max(stages, key=lambda w: w.total_s)
    average = total(stages) * (1.0 / len(stages))
    bubble = average * ((layout.pp - 1) / layout.virtual_stages)
    pipeline = slowest * m + bubble
    dp, optimizer = _data_parallel(setup, layout, device, layer, m), _optimizer_step(setup, layout, device)
    embedding_sync, loss_sync = _tied_embedding_sync(setup, layout, device), _loss_all_reduce(layout, device)
    work = pipeline + dp + embedding_sync + optimizer + loss_sync
    flops = setup.tokens_per_step * setup.shape.train_flops_per_token(setup.seq_len)
    peak = accelerator.peak_flops(setup.dtype) * layout.num_devices
    hardware_flops = flops + _recompute_flops(setup) * setup.tokens_per_step
    memory = training_memory(setup, layout, accelerator)
    return TrainingPrediction(
        layout=layout, step_time_s=work.total_s, mfu=flops / work.total_s / peak,
        hfu=hardware_flops / work.total_s / peak, tokens_per_s=setup.tokens_per_step / work.total_s,
        memory=memory, fits=memory.total_bytes <= accelerator.memory_bytes, work=work,
        breakdown_s={"pipeline_s": (slowest * m).total_s, "bubble_s": bubble.total_s,
                     "data_parallel_s": dp.total_s, "embedding_sync_s": embedding_sync.total_s,
                     "optimizer_s": optimizer.total_s,
                     "loss_sync_s": loss_sync.total_s, "exposed_comm_s": work.comm_s},
        model_flops_per_step=flops,
        parts={"pipeline": slowest * m, "bubble": bubble, "data_parallel": dp,
               "embedding_sync": embedding_sync, "optimizer": optimizer, "loss_sync": loss_sync},
    )


def layer_passes(
    setup: TrainSetup, layout: Layout, accelerator: Accelerator, efficiency: Efficiency | None = None,
) -> dict[str, Work]:
    """One layer, one micro-batch: "forward" and "backward" (with recomputation), exposed comm
    included; what Korthikanti et al. Table 4 measures for the 22B model. With both dense and MoE
    layers, the mean layer."""
    device = _device(setup, accelerator, efficiency)
    return _mean_layer_passes(setup, layout, _layer_spec(setup, layout), device)


def _mean_layer_passes(setup: TrainSetup, layout: Layout, spec: LayerSpec, device: Device
                       ) -> dict[str, Work]:
    """Each pass of the mean layer: dense and MoE layers weighted by their share of the layers."""
    mean = {"forward": Work(), "backward": Work()}
    for moe, share in layer_kinds(setup.shape):
        passes = _layer_passes(setup, layout, dataclasses.replace(spec, moe=moe), device)
        mean = {name: mean[name] + passes[name] * share for name in mean}
    return mean


def _layer_passes(setup: TrainSetup, layout: Layout, spec: LayerSpec, device: Device) -> dict[str, Work]:
    per_node = device.accelerator.devices_per_node
    forward, backward = layer_forward(spec, device), layer_backward(spec, device)
    comm, backward_comm = tp_collectives(spec, device, per_node), None
    if spec.moe and spec.tp > 1:
        comm, backward_comm = _moe_tp_collectives(spec, device, per_node)
    backward_comm = backward_comm or comm
    recompute = Work()
    if setup.recompute == "full":
        recompute = forward + comm
    elif setup.recompute == "selective":
        recompute = attention_recompute(spec, device)
    overlap = "none" if device.accelerator.host_link else setup.tp_overlap
    if overlap == "full":
        exposed_forward, exposed_backward = Work(), Work()
    elif overlap == "backward":  # hidden under the weight-gradient GEMMs (half the GEMMs)
        exposed_forward = comm
        exposed_backward = backward_comm + Work(comm_s=-min(backward_comm.comm_s, 0.5 * backward.gemm_s))
    else:
        exposed_forward, exposed_backward = comm, backward_comm
    if layout.sequence_parallel:  # the extra all-gather of each block's sharded input (sec. 4.2.2);
        # overlapped in Megatron, yet Table 4 shows SP's backward no faster: charged as exposed
        size = spec.num_tokens * setup.shape.hidden_size * device.element_bytes
        exposed_backward = exposed_backward + device.collective("all_gather", size, layout.tp, per_node) * 2
    cp = _context_parallel(setup, layout, spec, device)
    return {"forward": forward + exposed_forward + cp * (1 / 3),
            "backward": backward + recompute + exposed_backward + cp * (2 / 3)}


def _moe_tp_collectives(spec: LayerSpec, device: Device, per_node: int) -> tuple[Work, Work]:
    """Forward and backward tensor-parallel communication of a layer with experts as the trainer
    splits it (train/parallel.py `_layer_plan`): its attention's as a dense layer's; each expert
    that gets tokens (`expected_experts_touched`) all-reduces its output rows in the forward and
    its gate and up products' input gradients in the backward, as does a shared expert over every
    token; with sequence parallelism the block all-gathers its input in the forward and its
    output's gradient in the backward (it cuts the whole output to the rank's slice, and the
    input's gradient arrives whole)."""
    shape, n, tp = spec.shape, spec.num_tokens, spec.tp
    row = shape.hidden_size * device.element_bytes
    attention = tp_collectives(spec, device, per_node) * 0.5  # one of the dense layer's two blocks
    touched = expected_experts_touched(shape.num_experts, shape.experts_per_token, n)
    rows = n * shape.experts_per_token / touched  # each touched expert's share of the n k choices
    experts = device.collective("all_reduce", rows * row, tp, per_node) * touched
    if shape.shared_expert_ffn_hidden_size:
        experts = experts + device.collective("all_reduce", n * row, tp, per_node)
    gather = device.collective("all_gather", n * row, tp, per_node) if spec.sequence_parallel else Work()
    return attention + gather + experts, attention + gather + experts * 2


def _layer_microbatch(setup: TrainSetup, layout: Layout, spec: LayerSpec, device: Device) -> Work:
    passes = _mean_layer_passes(setup, layout, spec, device)
    return passes["forward"] + passes["backward"]


def _device(setup: TrainSetup, accelerator: Accelerator, efficiency: Efficiency | None) -> Device:
    """The device as training sees it: attention at the training kernel's fraction."""
    efficiency = efficiency or default_efficiency(accelerator)
    training = efficiency.replace(attention_fraction=efficiency.training_attention_fraction)
    return Device(accelerator=accelerator, efficiency=training, dtype=dtype_key(setup.dtype),
                  element_bytes=setup.activation_bytes)


def _layer_spec(setup: TrainSetup, layout: Layout) -> LayerSpec:
    tokens = setup.micro_batch_size * setup.seq_len
    keys = _keys_computed(setup)
    return LayerSpec(shape=setup.shape, num_tokens=tokens // layout.cp, tp=layout.tp,
                     sequence_parallel=layout.sequence_parallel, attention=setup.attention_kernel,
                     pointwise=setup.pointwise, dropout=setup.dropout,
                     attention_pairs=tokens * keys / layout.cp, residual_bytes=setup.residual_bytes,
                     autocast_weights=setup.autocast)


def _keys_computed(setup: TrainSetup) -> float:
    """Keys the mean layer's attention computes per query, as the trainer runs it: every key with
    explicit matmuls (unfused; soft caps); a fused kernel's causal mask skips the future's blocks,
    but a layer whose sliding window is shorter than the sequence hands SDPA an additive T x T mask
    (`ops.attention.dense_causal_attention`), with which it computes every block, the future's and
    those past the window included (MFU's model FLOPs count T keys per query either way)."""
    seq_len, shape = setup.seq_len, setup.shape
    if setup.attention_kernel == "unfused":
        return float(seq_len)
    causal = (seq_len + 1) / 2
    if shape.sliding_window is None or shape.sliding_window >= seq_len:
        return causal
    share = shape.windowed_layer_share
    return share * seq_len + (1.0 - share) * causal


def _context_parallel(setup: TrainSetup, layout: Layout, spec: LayerSpec, device: Device) -> Work:
    """All-gather of the other ranks' K and V before attention, forward and (again, plus the
    reduce-scatter of their gradients) backward; exposed on the critical path, as in Llama 3's
    all-gather based context parallelism (Dubey et al. 2024, section 3.3.2)."""
    if layout.cp == 1:
        return Work()
    shape = setup.shape
    kv = spec.num_tokens * 2 * shape.kv_dim / layout.tp * device.element_bytes * layout.cp
    per_node = device.accelerator.devices_per_node // layout.tp
    gather = device.collective("all_gather", kv, layout.cp, max(per_node, 1))
    scatter = device.collective("reduce_scatter", kv, layout.cp, max(per_node, 1))
    return gather * 2 + scatter


def _stage_works(
    setup: TrainSetup, layout: Layout, spec: LayerSpec, device: Device, layer: Work
) -> list[Work]:
    """Per-micro-batch time of the first, middle and last stages (embedding / logits differ)."""
    shape = setup.shape
    first, middle_layers, last = stage_layers(shape.num_layers, layout)
    tokens, v, h, r = spec.num_tokens, shape.vocab_size, shape.hidden_size, setup.residual_bytes
    logits = device.gemm(tokens, h, v / layout.tp, count=3)  # forward + 2 backward
    if setup.autocast:  # the lm_head weight cast to 16 bits, its gradient back
        logits = logits + device.stream(12.0 * h * v / layout.tp, 2)
    logit_bytes = _loss_bytes_per_logit(setup)
    loss = device.stream(logit_bytes[0] * tokens * v / layout.tp, logit_bytes[1])
    # Rows gathered and their gradient scattered into a dense fp32 table gradient.
    embedding = device.stream(3.0 * r * tokens * h + 4.0 * v * h / layout.tp, 2)
    if layout.pp == 1:
        return [layer * shape.num_layers + logits + loss + embedding]
    # Scatter-gather (Narayanan et al. 2021, section 4.1): each TP rank sends 1/t of the
    # activations across stages and the receiving node all-gathers them over its fast link.
    full = tokens * shape.hidden_size * device.element_bytes
    crosses = layout.tp * layout.cp * layout.dp >= device.accelerator.devices_per_node
    p2p = device.p2p(full / layout.tp, crosses)
    if not layout.sequence_parallel:
        p2p = p2p + device.collective("all_gather", full, layout.tp, device.accelerator.devices_per_node)
    p2p = p2p * (2.0 * layout.virtual_stages)
    return [layer * first + p2p + embedding, layer * middle_layers + p2p,
            layer * last + p2p + logits + loss]


def _loss_bytes_per_logit(setup: TrainSetup) -> tuple[float, int]:
    """(bytes per logit, kernels) of the fp32 cross-entropy, forward and backward. Fused (Megatron's
    vocab-parallel kernel): read the logits, write and read back their gradient. Eager, as
    `Trainer.loss` runs it: 16-bit logits cast to fp32 (read e, write 4), log_softmax (8), the
    NLL's scalar, its backward's dense gradient (4), log_softmax's backward (12), the cast back.
    Eager soft-capped logits (Gemma 2) add the cap before it: the division, tanh and product
    forward (each reading and writing e), and backward the product's and division's gradients and
    tanh's backward (which also reads tanh's output)."""
    if setup.pointwise == "fused":
        return 12.0, 3
    e = setup.activation_bytes
    cast = 0.0 if e == 4 else e + 4.0
    softcap = (13.0 * e, 6) if setup.shape.logit_softcap else (0.0, 0)
    return 24.0 + 2 * cast + softcap[0], 4 + (2 if cast else 0) + softcap[1]


def _data_parallel(setup: TrainSetup, layout: Layout, device: Device, layer: Work, m: int) -> Work:
    """Gradient (and FSDP weight) collectives over the data-parallel x context-parallel group.

    Hidden under compute (DDP's all-reduce under 2/3 of the last micro-batch's backward GEMMs, its
    buckets filling as the backward runs; FSDP's under 90% of the step's compute, each unit's
    all-gather prefetched during the previous unit's compute) where the collectives have a
    device's link to themselves; on a host link (`Accelerator.host_link`) they take the cores that
    compute and every second of them is exposed. FSDP with pp > 1 (`_fsdp_collectives`): the
    all-gathers hide under 90% of the first micro-batch's forward (a third of its compute), the
    reduce-scatters, issued after the schedule, are exposed."""
    group = layout.dp * layout.cp
    if group == 1:
        return Work()
    overlaps = not device.accelerator.host_link
    if layout.zero_stage >= 3:
        gathers, scatters = _fsdp_collectives(setup, layout, device, m)
        compute = layer * (setup.shape.num_layers / layout.pp) * (m if layout.pp == 1 else 1 / 3)
        hideable = gathers + scatters if layout.pp == 1 else gathers
        hidden = min(hideable.comm_s, 0.9 * (compute.gemm_s + compute.memory_s)) if overlaps else 0.0
        return gathers + scatters + Work(comm_s=-hidden)
    params = max(stage_params(setup.shape, layout))  # each stage's group at once: the largest sets the pace
    grads = params * setup.state_bytes_per_param()[1]
    comm = device.collective("all_reduce", grads, group, _dp_ranks_per_node(layout, device))
    if setup.dp_overlap and overlaps:
        window = (layer * (setup.shape.num_layers / layout.pp)).gemm_s * (2 / 3)
        return comm + Work(comm_s=-min(comm.comm_s, window))
    return comm


def _dp_ranks_per_node(layout: Layout, device: Device) -> int:
    return max(device.accelerator.devices_per_node // (layout.tp * layout.cp * layout.pp), 1)


def _fsdp_units(setup: TrainSetup, layout: Layout) -> tuple[int, float, float]:
    """(layers, parameters per device of one layer, of the root) on the largest pipeline stage, as
    slipstream's trainer wraps them for FSDP (`train.parallel.apply_fsdp`, as torchtitan's
    `apply_fsdp`): each decoder layer one unit, the root one more holding the rest (the embedding,
    the final norm, the lm_head)."""
    shape = setup.shape
    layers = max(stage_layers(shape.num_layers, layout))
    layer_params = shape.layers_params() / shape.num_layers / layout.tp
    return layers, layer_params, max(stage_params(shape, layout)) - layers * layer_params


def _fsdp_collectives(setup: TrainSetup, layout: Layout, device: Device, m: int) -> tuple[Work, Work]:
    """FSDP2's all-gathers and reduce-scatters in one step, unit by unit, each paying its latency.

    PyTorch's `fully_shard` (torch/distributed/fsdp/_fully_shard/_fully_shard.py, its docstring
    and `FSDPState._lazy_init`): a unit's parameters are all-gathered before its forward and,
    resharded after it, again before its backward; its gradients are reduce-scattered after its
    backward; `reshard_after_forward` left unset is True for every unit but the root, whose
    parameters the backward needs at once. So per micro-batch one all-gather per unit forward, one
    per layer backward and one reduce-scatter per unit: the trainer leaves FSDP2's gradient sync
    on, as torchtitan does, so gradients accumulate sharded (`train.parallel.set_gradient_sync`).
    All-gathers move the weights in the dtype FSDP
    holds them: fp32 under autocast (slipstream's trainer gives `fully_shard` no
    `MixedPrecisionPolicy`, so autocast casts the gathered fp32 weights per op), 16 bits with
    16-bit `parameters` (torchtitan's `param_dtype`, cast before the all-gather); reduce-scatters
    move the gradients. gloo (a host link) runs a reduce-scatter as an all-reduce of the
    whole buffer (a profile of the trainer's 2-rank FSDP2 step: one gloo all-reduce per
    reduce-scatter), and is priced so there.

    With pp > 1 torch's `PipelineStage` turns gradient sync and resharding after the backward off
    for every micro-batch (`backward_maybe_with_nosync`) and reduces after the schedule
    (`perform_reduce_grad`), and the trainer wraps the stages with `reshard_after_forward=False`:
    each unit is all-gathered once, before the first forward, and reduce-scattered once per step;
    its parameters and gradients stay whole until then (`memory.training_memory`).
    """
    group, per_node = layout.dp * layout.cp, _dp_ranks_per_node(layout, device)
    layers, layer_params, root_params = _fsdp_units(setup, layout)
    weight = 4.0 if setup.autocast else device.element_bytes
    grad = setup.state_bytes_per_param()[1]
    scatter = "all_reduce" if device.accelerator.host_link else "reduce_scatter"
    per_step = layout.pp > 1
    gathers = device.collective("all_gather", layer_params * weight, group, per_node) * (
        layers if per_step else 2 * layers)
    scatters = device.collective(scatter, layer_params * grad, group, per_node) * layers
    if root_params > 0:
        gathers = gathers + device.collective("all_gather", root_params * weight, group, per_node)
        scatters = scatters + device.collective(scatter, root_params * grad, group, per_node)
    return (gathers, scatters) if per_step else (gathers * m, scatters * m)


def _tied_embedding_sync(setup: TrainSetup, layout: Layout, device: Device) -> Work:
    """With pp > 1 a tied embedding's table has a copy on the first stage (the embedding) and one
    on the last (the output layer); after the schedule the two ranks of each pair sum their
    gradients (`train.pipeline.sum_tied_embedding_grads`, as Megatron-LM does): one all-reduce of
    the table's fp32 gradient split by tensor parallelism, and by FSDP, which has reduce-scattered
    it by then; exposed, nothing left to hide it under. The pair spans a node unless every rank of
    the layout is on one."""
    if layout.pp == 1 or not setup.shape.tied_embeddings:
        return Work()
    shards = layout.tp * (layout.dp * layout.cp if layout.zero_stage >= 3 else 1)
    size = setup.shape.embedding_params() * setup.state_bytes_per_param()[1] / shards
    one_node = layout.num_devices <= device.accelerator.devices_per_node
    return device.collective("all_reduce", size, 2, 2 if one_node else 1)


def _optimizer_step(setup: TrainSetup, layout: Layout, device: Device) -> Work:
    """AdamW's update of each local parameter, after the gradient norm (`clip_grad_norm_`): under
    FSDP or tensor parallelism each rank holds a part of the gradients (DTensors), and their norm
    takes an all-reduce of one scalar over the ranks that split them; with pp > 1 each stage's
    squared norm is then summed over the pipeline group, one more scalar all-reduce."""
    params = max(stage_params(setup.shape, layout))
    if layout.zero_stage >= 1:
        params /= layout.dp * layout.cp
    split = (layout.dp * layout.cp if layout.zero_stage >= 3 else 1) * layout.tp
    norm = device.collective("all_reduce", 4.0, split, device.accelerator.devices_per_node)
    norm = norm + device.collective("all_reduce", 4.0, layout.pp, _pp_ranks_per_node(layout, device))
    return device.stream(OPTIMIZER_BYTES_PER_PARAM * params, 8) + norm


def _pp_ranks_per_node(layout: Layout, device: Device) -> int:
    """Ranks of one pipeline group on a node: the stages are the slowest-varying mesh dimension,
    num_devices / pp ranks apart."""
    return max(device.accelerator.devices_per_node * layout.pp // layout.num_devices, 1)


def _loss_all_reduce(layout: Layout, device: Device) -> Work:
    """The mean loss over every rank, all-reduced once per step for the step's record (one fp32
    scalar; `Trainer.train_step`), after the optimizer: nothing left to hide it under."""
    return device.collective("all_reduce", 4.0, layout.num_devices, device.accelerator.devices_per_node)


def _recompute_flops(setup: TrainSetup) -> float:
    """Extra FLOPs per token from recomputation (HFU minus MFU numerator)."""
    shape = setup.shape
    if setup.recompute == "full":
        return setup.shape.train_flops_per_token(setup.seq_len) / 3
    if setup.recompute == "selective" and setup.attention_kernel == "unfused":
        return shape.attention_flops_per_token(setup.seq_len)
    return 0.0


def layout_error(setup: TrainSetup, layout: Layout) -> str | None:
    """Why `layout` cannot run `setup` (its stages, tensor or context parallelism, or micro-batch
    count), or None: what the planner skips a layout for, where every other error is the device's."""
    try:
        _check_layout(setup, layout)
    except ValueError as e:
        return str(e)
    return None


def _check_layout(setup: TrainSetup, layout: Layout) -> None:
    shape = setup.shape
    first, _, last = stage_layers(shape.num_layers, layout)
    if layout.pp * layout.virtual_stages > shape.num_layers + 2 or min(first, last) < 0:
        raise ValueError(f"{shape.num_layers} layers (+ embedding and output chunks) cannot fill "
                         f"pp={layout.pp} x "
                         f"virtual_stages={layout.virtual_stages} chunks")
    if error := shape.tensor_parallel_error(layout.tp):
        raise ValueError(error)
    if error := pipeline_error(shape, layout.pp):
        raise ValueError(error)
    if setup.seq_len % layout.cp:
        raise ValueError(f"cp={layout.cp} does not divide seq_len={setup.seq_len}")
    microbatches = setup.num_microbatches(layout)
    if layout.virtual_stages > 1 and microbatches % layout.pp:  # Megatron's interleaved schedule
        raise ValueError(f"the interleaved schedule (virtual_stages={layout.virtual_stages}) needs the "
                         f"{microbatches} micro-batches per step to be a multiple of pp={layout.pp}")
