"""A roofline per op of a trace recorded with `record_shapes=True`: each op whose work is known in
closed form from its input shapes, priced in FLOPs and bytes moved, against the time it took.

- **Products.** `aten::mm`, `addmm`, `bmm`, `baddbmm`: 2 x M x K x N FLOPs per product (a
  multiply and an add per term; a bias is read, not counted in FLOPs), as PyTorch's
  `torch.utils.flop_counter` counts them. `aten::linear` and `aten::matmul` only where no product
  inside them is priced (an op decomposed into `addmm` is counted there, once).
- **Attention.** The `scaled_dot_product_attention` ops (the public one where no variant inside it
  is priced; flash, efficient, cuDNN and the CPU's flash, and their backwards): QK^T and AV,
  2 x B x H x P x (E + Ev) for P (query, key) pairs, as flop_counter counts them; a backward
  recomputes QK^T and takes four more products, 2 x B x H x P x (3E + 2Ev). P is L x S, or
  under `is_causal` (from the trace's "Concrete Inputs") the pairs PyTorch's top-left mask keeps,
  about half (flop_counter charges every pair; TraceLens halves L x S).
- **oneDNN's linear** (`mkldnn::_linear_pointwise`, and `slipstream::onednn_mm_nt`, the trainer's
  custom op around it) as `aten::linear`: slipstream's CPU linears run there. Its C kernels
  (matrix-vector and panel products, the CPU decode graph), called through ctypes, are no
  profiler ops and are not in the trace at all.
- **Element-wise ops and normalisations** by the bytes alone (no FLOPs: memory-bound by design).

Bytes moved are the tensor inputs and outputs at their element sizes, each once: a lower bound
on the memory traffic (a product that does not fit in cache reads its inputs more than once).
Each priced op is timed by its own span (inclusive of its children), or on a GPU trace by the
kernels launched inside it (the runtime calls' `correlation`). The roofline bound of one call is
max(FLOPs / peak, bytes / bandwidth) on the chosen hardware; the op's fraction of it is that
bound over the measured time, and it is compute-bound where the FLOP term is the larger.

An op of these names whose shapes or element types the trace does not give (or gives oddly) is
listed as unpriced with the reason, never dropped. TraceLens (`TraceLens/PerfModel`) prices ops
the same way, per op name and shape; HTA's trace has no per-op roofline.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from slipstream.perf.accelerators import Accelerator, dtype_key
from slipstream.perf.flops import dtype_bytes
from slipstream.perf.kineto import Event, OpInputs
from slipstream.perf.trace_gpu import KERNEL_CATEGORIES, LAUNCH_CATEGORIES
from slipstream.perf.trace_tree import by_thread, innermost, parents

# The profiler's names of element types ("Input type"), as torch's dtype names.
_TYPE_NAMES = {
    "float": "float32", "double": "float64", "c10::BFloat16": "bfloat16", "c10::Half": "float16",
    "c10::Float8_e4m3fn": "float8_e4m3fn", "c10::Float8_e5m2": "float8_e5m2",
    "signed char": "int8", "unsigned char": "uint8",
}
_INTEGER_BYTES = {"long int": 8, "long": 8, "int": 4, "short int": 2, "short": 2, "bool": 1}
"""Element sizes of the integer types `flops.dtype_bytes` does not list (index and mask tensors),
as GCC's builds name them ("long int") and Clang's ("long")."""
_NOT_TENSORS = frozenset({"", "Scalar", "ScalarList", "GenericList"})
"""The profiler's types of arguments that are no tensor: scalars, lists of them, anything else
("": None, a string, a device)."""


class Unpriced(Exception):
    """An op of a priced name whose inputs do not give its work; the message says why."""


class _Call:
    """The tensors of one call: sizes and element sizes by argument position."""

    def __init__(self, name: str, inputs: OpInputs):
        self.name = name
        self.dims = inputs.dims
        self.types = inputs.types
        self.concrete = inputs.concrete

    def is_tensor(self, i: int) -> bool:
        if i >= len(self.types):
            return False
        kind = self.types[i]
        if kind in _NOT_TENSORS:
            return False
        if kind not in _TYPE_NAMES and kind not in _INTEGER_BYTES:
            raise Unpriced(f"input {i} has element type {kind!r}")
        return True

    def shape(self, i: int, rank: int | None = None) -> tuple[int, ...]:
        if not self.is_tensor(i):
            raise Unpriced(f"input {i} is no tensor")
        dims = self.dims[i]
        if dims is None:
            raise Unpriced(f"input {i} has no sizes")
        if rank is not None and len(dims) != rank:
            raise Unpriced(f"input {i} has {len(dims)} dimensions, {rank} expected")
        return dims

    def element_bytes(self, i: int) -> int:
        kind = self.types[i]
        return _INTEGER_BYTES[kind] if kind in _INTEGER_BYTES else dtype_bytes(_TYPE_NAMES[kind])

    def nbytes(self, i: int) -> int:
        return math.prod(self.shape(i)) * self.element_bytes(i)

    def tensor_bytes(self) -> int:
        """Every tensor argument's bytes (read once)."""
        return sum(self.nbytes(i) for i in range(len(self.dims)) if self.is_tensor(i))

    def dtype(self) -> str:
        """The element type the op computes in: its first tensor argument's that is no mask
        (where's condition), else its first's."""
        kinds = [self.types[i] for i in range(len(self.dims)) if self.is_tensor(i)]
        return next((kind for kind in kinds if kind != "bool"), kinds[0] if kinds else "")


def _mm(c: _Call, a: int, b: int, reads: Sequence[int] = ()) -> tuple[float, float]:
    (m, k), (k2, n) = c.shape(a, 2), c.shape(b, 2)
    _same_inner(k, k2)
    reads_bytes = c.nbytes(a) + c.nbytes(b) + sum(c.nbytes(i) for i in reads)
    return 2 * m * k * n, reads_bytes + m * n * c.element_bytes(a)


def _bmm(c: _Call, a: int, b: int, reads: Sequence[int] = ()) -> tuple[float, float]:
    (batch, m, k), (batch2, k2, n) = c.shape(a, 3), c.shape(b, 3)
    _same_inner(k, k2)
    if batch != batch2:
        raise Unpriced(f"batches {batch} and {batch2} differ")
    return (2 * batch * m * k * n,
            c.nbytes(a) + c.nbytes(b) + sum(c.nbytes(i) for i in reads) + batch * m * n * c.element_bytes(a))


def _linear(c: _Call) -> tuple[float, float]:
    x, (n, k) = c.shape(0), c.shape(1, 2)
    if not x or x[-1] != k:
        raise Unpriced(f"input of sizes {list(x)} against a weight of {k} columns")
    rows = math.prod(x[:-1])
    bias = c.nbytes(2) if c.is_tensor(2) else 0
    return 2 * rows * k * n, c.nbytes(0) + c.nbytes(1) + bias + rows * n * c.element_bytes(0)


def _matmul(c: _Call) -> tuple[float, float]:
    """torch.matmul's product: 1-D operands become a row or a column, batch dimensions broadcast."""
    a, b = c.shape(0), c.shape(1)
    if not a or not b:
        raise Unpriced("a 0-dimensional operand")
    m, k = (1, a[0]) if len(a) == 1 else a[-2:]
    k2, n = (b[0], 1) if len(b) == 1 else b[-2:]
    _same_inner(k, k2)
    batch = math.prod(_broadcast([a[:-2], b[:-2]]))
    return 2 * batch * m * k * n, c.nbytes(0) + c.nbytes(1) + batch * m * n * c.element_bytes(0)


def _same_inner(k: int, k2: int) -> None:
    if k != k2:
        raise Unpriced(f"inner sizes {k} and {k2} differ")


def _attention(c: _Call) -> tuple[float, float]:
    """Forward attention of query, key, value (inputs 0, 1, 2: batch, heads, length, dim)."""
    b, heads, e, ev, pairs = _attention_sizes(c, 0)
    out = b * heads * (pairs.length * ev) * c.element_bytes(0)
    return 2 * b * heads * pairs.count * (e + ev), c.tensor_bytes() + out


def _attention_backward(c: _Call) -> tuple[float, float]:
    """(grad_out, query, key, value, ...): the gradients of query, key and value are written."""
    b, heads, e, ev, pairs = _attention_sizes(c, 1)
    grads = c.nbytes(1) + c.nbytes(2) + c.nbytes(3)
    return 2 * b * heads * pairs.count * (3 * e + 2 * ev), c.tensor_bytes() + grads


class _Pairs:
    """The (query, key) pairs attention computes: every one, or under `is_causal` (PyTorch's mask
    is aligned top left) the query at row i with keys 0 .. i."""

    def __init__(self, length: int, keys: int, causal: bool):
        self.length = length
        if causal:
            ramp = min(length, keys)
            self.count = ramp * (ramp + 1) // 2 + (length - ramp) * keys
        else:
            self.count = length * keys


def _attention_sizes(c: _Call, q: int) -> tuple[int, int, int, int, _Pairs]:
    (b, heads, length, e), (_, kv_heads, keys, e2), (_, _, _, ev) = (c.shape(q + i, 4) for i in range(3))
    if e != e2 or kv_heads == 0 or heads % kv_heads:
        raise Unpriced(f"query {list(c.shape(q))} and key {list(c.shape(q + 1))} do not match")
    return b, heads, e, ev, _Pairs(length, keys, _is_causal(c))


def _is_causal(c: _Call) -> bool:
    where = _IS_CAUSAL.get(c.name)
    return where is not None and where < len(c.concrete) and c.concrete[where] == "True"


_IS_CAUSAL = {f"aten::{name}": where for name, where in (
    ("scaled_dot_product_attention", 5), ("_scaled_dot_product_flash_attention", 4),
    ("_scaled_dot_product_flash_attention_for_cpu", 4), ("_scaled_dot_product_efficient_attention", 6),
    ("_scaled_dot_product_cudnn_attention", 6), ("_scaled_dot_product_flash_attention_backward", 11),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", 7),
    ("_scaled_dot_product_efficient_attention_backward", 11),
    ("_scaled_dot_product_cudnn_attention_backward", 14))}
"""Where each attention op takes `is_causal` (its schema's position), read from "Concrete Inputs"
(a trace without them prices every pair)."""


def _elementwise(c: _Call) -> tuple[float, float]:
    """Out of place: the inputs read, the broadcast output written in the type of the first input
    that is not a mask; with `out=` (a last tensor past the op's own arguments), that tensor is
    the output, counted once; in place (a trailing _): the first input written too; a copy or
    fill writes its first input only."""
    tensors = [i for i in range(len(c.dims)) if c.is_tensor(i)]
    if not tensors:
        raise Unpriced("no tensor input")
    base = c.name.removeprefix("aten::")
    if base in ("copy_", "fill_", "zero_"):
        return 0.0, c.tensor_bytes()
    if base.endswith("_"):
        return 0.0, c.tensor_bytes() + c.nbytes(tensors[0])
    if len(c.dims) - 1 in _ARGUMENTS[base] and tensors[-1] == len(c.dims) - 1:
        return 0.0, c.tensor_bytes()
    values = next(i for i in tensors if c.types[i] == c.dtype())
    out = math.prod(_broadcast([c.shape(i) for i in tensors])) * c.element_bytes(values)
    return 0.0, c.tensor_bytes() + out


def _normalization(c: _Call) -> tuple[float, float]:
    """A norm or softmax over its first input: its tensors read, an output of the input's size."""
    return 0.0, c.tensor_bytes() + c.nbytes(0)


def _broadcast(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(rank):
        sizes = {s[len(s) - rank + axis] for s in shapes if len(s) - rank + axis >= 0} - {1}
        if len(sizes) > 1:
            raise Unpriced(f"shapes {[list(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


_ARGUMENTS = {
    **dict.fromkeys(("neg", "exp", "log", "sqrt", "rsqrt", "abs", "relu", "silu", "sigmoid", "tanh"), {1}),
    **dict.fromkeys(("mul", "pow", "gelu", "silu_backward", "sigmoid_backward", "tanh_backward"), {2}),
    **dict.fromkeys(("add", "sub", "clamp", "where", "masked_fill", "gelu_backward", "threshold_backward"),
                    {3}),
    "div": {2, 3},
}
"""How many arguments each element-wise op's out-of-place overloads record (add's alpha, gelu's
`approximate`, div's `rounding_mode` included): its `out=` overloads record one tensor more."""
_POINTWISE = tuple(_ARGUMENTS)
_PRICES: dict[str, Callable[[_Call], tuple[float, float]]] = {
    "aten::mm": lambda c: _mm(c, 0, 1),
    "aten::addmm": lambda c: _mm(c, 1, 2, reads=(0,)),
    "aten::bmm": lambda c: _bmm(c, 0, 1),
    "aten::baddbmm": lambda c: _bmm(c, 1, 2, reads=(0,)),
    "aten::linear": _linear,
    "aten::matmul": _matmul,
    # oneDNN's linear (x, weight (N, K), bias), which slipstream's CPU linears call (the engine's
    # packed weights, and the trainer's three products through its custom op): torch's own ops.
    "mkldnn::_linear_pointwise": _linear,
    "slipstream::onednn_mm_nt": _linear,
    **{name: _attention_backward if name.endswith("_backward") else _attention for name in _IS_CAUSAL},
    **{f"aten::{name}{suffix}": _elementwise for name in _POINTWISE for suffix in ("", "_")},
    "aten::copy_": _elementwise, "aten::fill_": _elementwise, "aten::zero_": _elementwise,
    **{f"aten::{name}": _normalization for name in (
        "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "native_group_norm",
        "softmax", "_softmax", "log_softmax", "_log_softmax")},
}
_PRODUCTS = frozenset({*(f"aten::{name}" for name in ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul")),
                       "mkldnn::_linear_pointwise", "slipstream::onednn_mm_nt"})
_ATTENTION = frozenset(n for n, f in _PRICES.items() if f in (_attention, _attention_backward))
_POINTWISE_OPS = frozenset(n for n, f in _PRICES.items() if f is _elementwise)
_NORMS = frozenset(n for n, f in _PRICES.items() if f is _normalization)
_COUNTED_INSIDE = {
    **dict.fromkeys(_PRODUCTS, _PRODUCTS),
    **dict.fromkeys(_ATTENTION, _PRODUCTS | _ATTENTION),
    **dict.fromkeys(_NORMS, _NORMS | _POINTWISE_OPS),
    **dict.fromkeys(_POINTWISE_OPS, _POINTWISE_OPS),
}
"""For each priced op, the ops that, found inside it, count its work instead (so that it is counted
once): a product inside a product (linear's addmm) or inside attention (the math path's bmm),
the element-wise pieces of a decomposed norm. A copy inside a product is work of its own."""


def price(name: str, inputs: OpInputs | None) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one call of op `name`; Unpriced when its inputs do not give them.
    KeyError for an op this module has no formula for."""
    formula = _PRICES[name]
    if inputs is None:
        raise Unpriced("no input shapes (record_shapes=False)")
    flops, nbytes = formula(_Call(name, inputs))
    try:
        return float(flops), float(nbytes)
    except OverflowError:
        raise Unpriced(f"sizes {[list(d) for d in inputs.dims if d is not None]} give more work than a "
                       "float holds") from None


def op_roofline(events: Sequence[Event]) -> dict[str, Any] | None:
    """The priced ops' groups by name, shapes and element type (time, FLOPs and bytes summed over
    calls), and the ops of priced names that could not be priced; None when the trace recorded no
    shapes or has no op of a priced name. Hardware fractions are added by `against`."""
    if not any(e.inputs is not None for e in events if e.cat == "cpu_op"):
        return None
    kernel_us: dict[int, float] = defaultdict(float)
    for k in events:
        if k.cat in KERNEL_CATEGORIES and k.correlation is not None:
            kernel_us[k.correlation] += k.dur_us
    launches = by_thread(events, LAUNCH_CATEGORIES)
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    unpriced: dict[tuple[str, str], dict[str, Any]] = {}
    # The trace shares one OpInputs per distinct set of inputs: each op name and set is priced once.
    prices: dict[tuple[str, int], _Priced] = {}
    for thread, spans in by_thread(events, ("cpu_op",)).items():
        counted = _counted(spans)
        device_us = _device_time(counted, launches.get(thread, []), kernel_us)
        for op, gpu_us in zip(counted, device_us, strict=True):
            key = (op.name, id(op.inputs))
            if key not in prices:
                prices[key] = _priced(op, groups, unpriced)
            found = prices[key]
            if isinstance(found, dict):
                found["calls"] += 1
                found["time_us"] += op.dur_us
            else:
                _add_call(*found, op, gpu_us)
    if not prices:
        return None
    return {"ops": sorted(groups.values(), key=lambda g: -g["time_us"]),
            "unpriced": sorted(unpriced.values(), key=lambda r: -r["time_us"]),
            "time_source": "kernels" if kernel_us else "host"}


def _counted(spans: Sequence[Event]) -> list[Event]:
    """The ops of priced names whose work no op inside them counts (`_COUNTED_INSIDE`)."""
    parent_of = parents(spans)
    inner: dict[int, set[str]] = defaultdict(set)  # span -> priced names found inside it
    for i, e in enumerate(spans):
        if e.name in _PRICES:
            at = parent_of[i]
            while at is not None:
                inner[at].add(e.name)
                at = parent_of[at]
    return [e for i, e in enumerate(spans)
            if e.name in _PRICES and not _COUNTED_INSIDE[e.name].intersection(inner.get(i, ()))]


def _device_time(ops: Sequence[Event], launches: Sequence[Event],
                 kernel_us: dict[int, float]) -> list[float | None]:
    """Each op's kernel time: the kernels of the launch calls made inside it (and in no counted op
    inside it); None for an op that launched none."""
    out: list[float | None] = [None] * len(ops)
    if not kernel_us:
        return out
    found = innermost(ops, [call.start_us for call in launches])
    for call, op in zip(launches, found, strict=True):
        if op is not None and call.correlation in kernel_us:
            out[op] = (out[op] or 0.0) + kernel_us[call.correlation]
    return out


_Priced = tuple[dict[str, Any], float, float] | dict[str, Any]
"""A group with one call's FLOPs and bytes, or a row of unpriced ops."""


def _priced(op: Event, groups: dict[tuple[str, str, str], dict[str, Any]],
            unpriced: dict[tuple[str, str], dict[str, Any]]) -> _Priced:
    """The group a call of `op`'s name and inputs adds to, with its FLOPs and bytes; or, where its
    inputs do not give them, its row of unpriced ops."""
    try:
        flops, nbytes = price(op.name, op.inputs)
    except Unpriced as e:
        return unpriced.setdefault((op.name, str(e)), {"name": op.name, "reason": str(e), "calls": 0,
                                                        "time_us": 0.0})
    assert op.inputs is not None  # price needs inputs
    cells = ["x".join(map(str, d)) if d else "-" for d in op.inputs.dims if d is not None]
    while cells and cells[-1] == "-":  # trailing scalars and Nones (sdpa's dropout, scale, ...)
        cells.pop()
    call = _Call(op.name, op.inputs)
    if _is_causal(call):
        cells.append("causal")
    shapes, dtype = ", ".join(cells), call.dtype()
    group = groups.setdefault((op.name, shapes, dtype), {
        "name": op.name, "shapes": shapes, "dtype": dtype, "calls": 0, "time_us": 0.0, "host_us": 0.0,
        "flops": 0.0, "bytes": 0.0, "host_timed_calls": 0})
    return group, flops, nbytes


def _add_call(group: dict[str, Any], flops: float, nbytes: float, op: Event, gpu_us: float | None) -> None:
    group["calls"] += 1
    group["host_us"] += op.dur_us
    group["time_us"] += op.dur_us if gpu_us is None else gpu_us
    group["host_timed_calls"] += gpu_us is None
    group["flops"] += flops
    group["bytes"] += nbytes


def against(roofline: dict[str, Any], accelerator: Accelerator | None) -> dict[str, Any]:
    """`roofline` with each group's achieved rates, intensity and, on `accelerator`, its bound and
    the fraction of the roofline it reached (None where the hardware lists no peak for its type)."""
    for g in roofline["ops"]:
        seconds = g["time_us"] / 1e6
        g["gflops_per_s"] = g["flops"] / seconds / 1e9 if seconds > 0 else None
        g["gbytes_per_s"] = g["bytes"] / seconds / 1e9 if seconds > 0 else None
        g["flops_per_byte"] = g["flops"] / g["bytes"] if g["bytes"] else None
        g["bound"], g["roofline_fraction"] = _bound(g, seconds, accelerator)
    roofline["hardware"] = accelerator.name if accelerator else None
    return roofline


def _bound(group: dict[str, Any], seconds: float,
           accelerator: Accelerator | None) -> tuple[str | None, float | None]:
    if accelerator is None:
        return None, None
    memory_s = group["bytes"] / accelerator.memory_bandwidth_bytes_per_s
    compute_s = 0.0
    if group["flops"]:
        try:
            peak = accelerator.peak_flops(dtype_key(_TYPE_NAMES.get(group["dtype"], "")))
        except ValueError:  # no peak for this element type (double, integers) on this hardware
            return None, None
        compute_s = group["flops"] / peak
    bound_s = max(compute_s, memory_s)
    return ("compute" if compute_s > memory_s else "memory"), (bound_s / seconds if seconds > 0 else None)
