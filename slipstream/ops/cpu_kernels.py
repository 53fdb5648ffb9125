"""Small C kernels for the CPU, compiled on first use and called through ctypes.

PyTorch has no paged-attention kernel for the CPU, and gathering a batch's cache blocks into
dense tensors first triples the memory traffic of a decode step (read, write the copy, read it
again); `csrc/attention.c` reads the cache in place, for decodes and for prefill chunks.
`csrc/cpu_ops.c` fuses RMSNorm, the rotary embedding and SwiGLU's silu-and-multiply, each several
PyTorch ops (and several passes over memory) in eager mode, and has the matrix-vector product of
batch-1 decode, the panel GEMM of decode batches, a mixture-of-experts block's routed experts in
one call and the decode graph's layer loop. The files need
no PyTorch headers, so they build with the system C compiler into one library (about 1.1 s at
-O3, the two files in parallel) and it is cached under
`~/.cache/slipstream/kernels/`, keyed by the sources, the compiler flags and this CPU's features;
the engine starts that build on a thread first thing (`build_in_background`), so a first use
compiles while the weights load. Where no compiler is found or the build fails, `library()`
returns None and callers use their plain PyTorch path (which the tests check the kernels
against).

OpenMP: the library links the `libgomp.so.1` that PyTorch has already loaded (same soname), so
both share one thread pool instead of two pools competing for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from slipstream.cache import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "attention.c", CSRC / "cpu_ops.c")
"""Compiled in parallel (a first build takes ~1.1 s instead of ~1.9 as one file), then linked."""
HEADERS = (CSRC / "common.h",)
# -ffast-math only when compiling: linking with it would add startup code that sets the CPU's
# flush-to-zero mode for the whole process (subnormals would vanish in PyTorch too).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
LDFLAGS = ["-shared", "-fopenmp"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

FP8_CACHE_CODES = {torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
"""The fp8 KV caches the kernels read and write (common.h's KV_DTYPE_*: the decode and prefill
attention, `write_kv` and the decode graph), under activations of a DTYPE_CODES dtype."""


def cache_dtype_code(dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
    """The kernels' dtype argument for activations of `dtype` over a cache of `cache_dtype`: the
    activations' code, and an fp8 cache's in bits 4-7."""
    assert dtype in DTYPE_CODES and (cache_dtype == dtype or cache_dtype in FP8_CACHE_CODES)
    return DTYPE_CODES[dtype] | FP8_CACHE_CODES.get(cache_dtype, 0) << 4


_LOCK = threading.Lock()
_NOT_LOADED = object()
_library: ctypes.CDLL | None | object = _NOT_LOADED


def library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot be built here. The first call builds
    it (or loads the cached build); concurrent first calls wait for that one build."""
    global _library
    lib = _library
    if lib is _NOT_LOADED:
        with _LOCK:
            if _library is _NOT_LOADED:
                _library = _load()
            lib = _library
    return lib


def build_in_background() -> None:
    """Start building (or loading) the library on a thread, so that a first use's compilation
    (about 2 s) runs while the caller does other work, such as reading a model's weights."""
    if _library is _NOT_LOADED:
        threading.Thread(target=library, name="slipstream-cpu-kernels", daemon=True).start()


def _load() -> ctypes.CDLL | None:
    # CC may hold arguments ("ccache gcc"), as make reads it.
    found = shutil.which("gcc") or shutil.which("cc")
    compiler = shlex.split(os.environ.get("CC", "")) or ([found] if found else [])
    if not compiler:
        logger.warning("no C compiler found: using PyTorch for attention, norms and rotary")
        return None
    try:
        path = cache_dir() / "kernels" / f"cpu_ops-{_build_key(compiler)}.so"
        if not path.is_file():
            _compile(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:  # no such compiler, a failed build or load
        logger.warning("building the CPU kernels failed (%s): using PyTorch", e)
        return None
    lib.paged_decode_attention.restype = ctypes.c_int
    lib.paged_decode_attention.argtypes = (
        [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float] * 2 + [ctypes.c_int] * 2
        + [ctypes.c_void_p]
    )
    lib.arithmetic_dtype.restype = ctypes.c_int
    lib.arithmetic_dtype.argtypes = [ctypes.c_int]
    lib.min_panel_rows.restype = ctypes.c_int
    lib.min_panel_rows.argtypes = [ctypes.c_int]
    lib.has_prefill_attention.restype = ctypes.c_int
    lib.has_prefill_attention.argtypes = [ctypes.c_int64]
    lib.paged_prefill_attention.restype = ctypes.c_int
    lib.paged_prefill_attention.argtypes = (
        [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7
        + [ctypes.c_float] * 2 + [ctypes.c_int] * 2 + [ctypes.c_void_p]
    )
    lib.gemv.restype = None
    lib.gemv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.has_panel_gemm.restype = ctypes.c_int
    lib.has_panel_gemm.argtypes = [ctypes.c_int]
    lib.panel_gemm_takes_all_rows.restype = ctypes.c_int
    lib.panel_gemm_takes_all_rows.argtypes = [ctypes.c_int]
    lib.panel_gemm_uses_amx.restype = ctypes.c_int
    lib.panel_gemm_uses_amx.argtypes = []
    lib.panel_numel.restype = ctypes.c_int64
    lib.panel_numel.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.pack_panels.restype = None
    lib.pack_panels.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    lib.panel_gemm.restype = ctypes.c_int
    lib.panel_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.has_int8_gemm.restype = ctypes.c_int
    lib.has_int8_gemm.argtypes = []
    lib.int8_panel_numel.restype = ctypes.c_int64
    lib.int8_panel_numel.argtypes = [ctypes.c_int64] * 2
    lib.pack_int8_panels.restype = None
    lib.pack_int8_panels.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.int8_panel_gemm.restype = ctypes.c_int
    lib.int8_panel_gemm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.write_kv.restype = ctypes.c_int
    lib.write_kv.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2
    lib.rms_norm.restype = None
    lib.rms_norm.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float] + [ctypes.c_int] * 3
    )
    lib.add_rms_norm.restype = None
    lib.add_rms_norm.argtypes = (
        [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float] + [ctypes.c_int] * 3
    )
    lib.rotary_embedding.restype = None
    lib.rotary_embedding.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_int] * 2
    lib.act_and_mul.restype = None
    lib.act_and_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3
    lib.argmax_rows.restype = None
    lib.argmax_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    lib.moe_experts.restype = ctypes.c_int
    lib.moe_experts.argtypes = (
        [ctypes.POINTER(MoeExpert), ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p]
        + [ctypes.c_int64] * 5 + [ctypes.c_int] * 2
    )
    lib.decode_workspace_bytes.restype = ctypes.c_int64
    lib.decode_workspace_bytes.argtypes = [ctypes.POINTER(DecodeShape), ctypes.c_int64]
    lib.decode_layers.restype = ctypes.c_int
    lib.decode_layers.argtypes = (
        [ctypes.POINTER(DecodeLayer), ctypes.POINTER(DecodeShape), ctypes.POINTER(DecodeModel)]
        + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int]
    )
    lib.decode_greedy.restype = ctypes.c_int
    lib.decode_greedy.argtypes = (
        [ctypes.POINTER(DecodeLayer), ctypes.POINTER(DecodeShape), ctypes.POINTER(DecodeModel)]
        + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 6 + [ctypes.c_int]
    )
    return lib


class MoeExpert(ctypes.Structure):
    """One expert's weights for `moe_experts` (cpu_ops.c's `moe_expert`)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "gate_up_rows", "gate_up_panels", "gate_up_bias", "down_rows", "down_panels", "down_bias",
    )]


class DecodeMoe(ctypes.Structure):
    """A mixture-of-experts layer's block for `decode_layers` (cpu_ops.c's `decode_moe`)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "router_weight", "router_bias", "router_panels", "experts",
        "shared_gate_up_weight", "shared_gate_up_bias", "shared_gate_up_panels",
        "shared_down_weight", "shared_down_bias", "shared_down_panels",
        "shared_gate_weight", "shared_gate_bias", "shared_gate_panels",
    )] + [("max_panel_rows", ctypes.c_int64), ("renormalize", ctypes.c_int32),
          ("round_weights", ctypes.c_int32)]


class DecodeLayer(ctypes.Structure):
    """One decoder layer's weights and cache for `decode_layers` (cpu_ops.c's `decode_layer`)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "qkv_weight", "qkv_bias", "q_norm", "k_norm", "o_weight", "o_bias",
        "post_norm", "gate_up_weight", "gate_up_bias", "down_weight", "down_bias", "k_cache", "v_cache",
        "qkv_panels", "o_panels", "gate_up_panels", "down_panels",
    )] + [("moe", ctypes.POINTER(DecodeMoe))] + [(name, ctypes.c_void_p) for name in (
        "qkv_scale", "o_scale", "gate_up_scale", "down_scale",
    )]


class DecodeShape(ctypes.Structure):
    """The model's shape for `decode_layers` (cpu_ops.c's `decode_shape`)."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
        "block_size", "window", "vocab_size", "rotary_dim",
        "num_experts", "top_k", "moe_intermediate_size", "shared_intermediate_size",
    )] + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("dtype", ctypes.c_int),
          ("kv_dtype", ctypes.c_int)]


class DecodeModel(ctypes.Structure):
    """The tensors around the layers for `decode_layers` (cpu_ops.c's `decode_model`)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "embedding", "final_norm", "lm_head_weight", "lm_head_bias", "lm_head_panels", "rope_cos", "rope_sin",
    )] + [("rope_positions", ctypes.c_int64)]


def paged_decode_attention(
    q: torch.Tensor,  # (B, H, D)
    k_cache: torch.Tensor,  # (P, S, K, D)
    v_cache: torch.Tensor,  # (P, S, K, D)
    block_tables: torch.Tensor,  # (B, max_blocks) int64
    seq_lens: torch.Tensor,  # (B,) int64
    sliding_window: int | None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,)
) -> torch.Tensor:  # (B, H, D)
    """One decode query per sequence against its paged keys and values (see the C source): scores
    times `scale` (None: head_dim**-0.5), soft-capped at `softcap` where given, each head's `sinks`
    logit in its softmax's denominator where given. The cache is of q's dtype or an fp8 one
    (`FP8_CACHE_CODES`)."""
    lib = library()
    assert lib is not None and q.dtype in DTYPE_CODES and q.device.type == "cpu"
    assert k_cache.dtype == v_cache.dtype
    dtype = cache_dtype_code(q.dtype, k_cache.dtype)
    q, block_tables, seq_lens = q.contiguous(), block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    sinks = _fp32_sinks(sinks, num_heads)
    status = lib.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(),
        num_seqs, block_tables.shape[1], num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        sliding_window or 0, head_dim**-0.5 if scale is None else scale, softcap or 0.0, dtype,
        torch.get_num_threads(), None if sinks is None else sinks.data_ptr(),
    )
    if status != 0:
        raise RuntimeError(f"paged_decode_attention kernel failed with status {status}")
    return out


def _fp32_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """The kernels' sinks: `num_heads` contiguous fp32 logits (None stays None). A ValueError
    otherwise: the kernels read `num_heads` floats whatever the tensor holds."""
    if sinks is None:
        return None
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must hold one logit per query head, shape ({num_heads},), got "
                         f"{tuple(sinks.shape)}")
    return sinks.detach().to(torch.float32).contiguous()


def supports_prefill_attention(q: torch.Tensor) -> bool:
    """Whether `paged_prefill_attention_` takes queries like `q` (N, H, D): AVX-512 or AVX2, D 64,
    128 or 256."""
    return supports(q) and bool(library().has_prefill_attention(q.shape[-1]))


@functools.cache
def arithmetic_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the C kernels' products (panel, matrix-vector, prefill attention) multiply in for
    inputs of `dtype`: bf16 on a CPU with AVX512-BF16 (vdpbf16ps, fp32 sums), else fp32 (bf16
    widened exactly)."""
    lib = library()
    assert lib is not None and dtype in DTYPE_CODES
    code = lib.arithmetic_dtype(DTYPE_CODES[dtype])
    return next(d for d, c in DTYPE_CODES.items() if c == code)


def paged_prefill_attention_(
    out: torch.Tensor,  # (N, H, D): the chunks' rows are written, the others left as they are
    q: torch.Tensor,  # (N, H, D)
    k_cache: torch.Tensor,  # (P, S, K, D)
    v_cache: torch.Tensor,  # (P, S, K, D)
    chunk_rows: torch.Tensor,  # (C,) int64: first row of each chunk in q and out
    chunk_lens: torch.Tensor,  # (C,) int64: its new tokens, the last of its sequence
    seq_lens: torch.Tensor,  # (C,) int64: all tokens of its sequence
    block_tables: torch.Tensor,  # (C, max_blocks) int64
    sliding_window: int | None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,)
) -> torch.Tensor:
    """Causal attention of prefill chunks over their paged keys and values (see the C source),
    `scale`, `softcap` and `sinks` as in `paged_decode_attention`, the cache of q's dtype or an fp8
    one. q may be a view whose rows are strided (the fused q/k/v product's queries): it is read in
    place."""
    lib = library()
    assert lib is not None and supports_prefill_attention(q) and out.is_contiguous()
    assert k_cache.dtype == v_cache.dtype
    dtype = cache_dtype_code(q.dtype, k_cache.dtype)
    q = _rows_of_heads(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    sinks = _fp32_sinks(sinks, num_heads)
    status = lib.paged_prefill_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        chunk_rows.data_ptr(), chunk_lens.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
        len(chunk_rows), block_tables.shape[1], num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        sliding_window or 0, head_dim**-0.5 if scale is None else scale, softcap or 0.0, dtype,
        torch.get_num_threads(), None if sinks is None else sinks.data_ptr(),
    )
    if status != 0:
        raise RuntimeError(f"paged_prefill_attention kernel failed with status {status}")
    return out


MAX_GEMV_ROWS = 4  # as in cpu_ops.c


@functools.cache
def min_panel_rows(dtype: torch.dtype) -> int:
    """The fewest rows of `dtype` that take the panel kernel where its copies are kept; fewer take
    the matrix-vector kernel (3, or 1 for bf16 on a CPU without bf16 arithmetic or with AMX: see
    cpu_ops.c)."""
    lib = library()
    assert lib is not None and dtype in DTYPE_CODES
    return lib.min_panel_rows(DTYPE_CODES[dtype])


def gemv(
    x: torch.Tensor,  # (..., K) with at most MAX_GEMV_ROWS rows
    weight: torch.Tensor,  # (N, K) row-major, as nn.Linear stores it
    bias: torch.Tensor | None,  # (N,)
) -> torch.Tensor:  # (..., N)
    """x W^T + b for a few rows, streaming the weight once (the batch-1 decode inner loop)."""
    lib = library()
    num_rows = x.numel() // x.shape[-1]
    assert lib is not None and supports(x) and num_rows <= MAX_GEMV_ROWS and weight.is_contiguous()
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
    lib.gemv(weight.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
             num_rows, weight.shape[0], weight.shape[1], DTYPE_CODES[x.dtype], torch.get_num_threads())
    return out


def supports_panel_gemm(weight: torch.Tensor) -> bool:
    """Whether `panel_gemm` handles this weight here (fp32 or bf16 on a CPU with AVX-512, or AVX2
    with FMA)."""
    return supports(weight) and bool(library().has_panel_gemm(DTYPE_CODES[weight.dtype]))


@functools.cache
def panel_gemm_uses_amx() -> bool:
    """Whether bf16 panel products run on the AMX tile unit here (Intel Xeons from Sapphire Rapids
    on, where Linux grants the process the tiles), for inputs whose width is a multiple of 32; the
    others, and every CPU without AMX, take the vector kernels (see cpu_ops.c)."""
    lib = library()
    return lib is not None and bool(lib.panel_gemm_uses_amx())


@functools.cache
def panel_gemm_takes_all_rows(dtype: torch.dtype) -> bool:
    """Whether the panel kernel should take inputs of `dtype` of every size, prefill chunks
    included, even where oneDNN could take them (see cpu_ops.c)."""
    lib = library()
    assert lib is not None and dtype in DTYPE_CODES
    return bool(lib.panel_gemm_takes_all_rows(DTYPE_CODES[dtype]))


def pack_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`weight` (N, K) in the panel layout of `panel_gemm` (see cpu_ops.c), flat: into `out` where
    given (contiguous, `panel_numel` elements of the weight's dtype), else a new tensor."""
    lib = library()
    assert lib is not None and supports_panel_gemm(weight)
    weight = weight.contiguous()
    out_features, in_features = weight.shape
    numel = panel_numel(out_features, in_features, weight.dtype)
    if out is None:
        out = torch.empty(numel, dtype=weight.dtype)
    elif out.numel() != numel or out.dtype != weight.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {weight.dtype} tensor of {numel} elements, got "
                         f"{out.dtype} {tuple(out.shape)}")
    lib.pack_panels(weight.data_ptr(), out.data_ptr(), out_features, in_features, DTYPE_CODES[weight.dtype],
                    torch.get_num_threads())
    return out


def panel_numel(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    lib = library()
    assert lib is not None
    return lib.panel_numel(out_features, in_features, DTYPE_CODES[dtype])


def panel_gemm(
    x: torch.Tensor,  # (..., K), the weight's dtype
    panels: torch.Tensor,  # pack_panels(weight) of an (N, K) weight
    bias: torch.Tensor | None,  # (N,)
    out_features: int,
) -> torch.Tensor:  # (..., N)
    """x W^T + b through the packed panels (the matrix-product kernel of cpu_ops.c)."""
    lib = library()
    assert lib is not None and x.dtype == panels.dtype and (bias is None or bias.is_contiguous())
    x = x.contiguous()
    in_features = x.shape[-1]
    assert panels.numel() >= panel_numel(out_features, in_features, x.dtype)
    out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    status = lib.panel_gemm(x.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                            out.data_ptr(), x.numel() // in_features, out_features, in_features,
                            DTYPE_CODES[x.dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"panel_gemm kernel failed with status {status}")
    return out


def supports_int8(x: torch.Tensor) -> bool:
    """Whether the weight-only int8 kernel (`int8_panel_gemm`) takes activations like `x` here: fp32
    or bf16 on the CPU, with AVX-512 or AVX2 and FMA."""
    return supports(x) and bool(library().has_int8_gemm())


def pack_int8_panels(qweight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """An int8 weight (N, K) in the panel layout of `int8_panel_gemm` (see cpu_ops.c), flat: into
    `out` where given (contiguous int8, `int8_panel_numel` elements), else a new tensor."""
    lib = library()
    assert lib is not None and lib.has_int8_gemm() and qweight.dtype == torch.int8 and qweight.dim() == 2
    qweight = qweight.contiguous()
    numel = int8_panel_numel(*qweight.shape)
    if out is None:
        out = torch.empty(numel, dtype=torch.int8)
    elif out.numel() != numel or out.dtype != torch.int8 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int8 tensor of {numel} elements, got {out.dtype} "
                         f"{tuple(out.shape)}")
    lib.pack_int8_panels(qweight.data_ptr(), out.data_ptr(), *qweight.shape, torch.get_num_threads())
    return out


def int8_panel_numel(out_features: int, in_features: int) -> int:
    lib = library()
    assert lib is not None
    return lib.int8_panel_numel(out_features, in_features)


def int8_panel_gemm(
    x: torch.Tensor,  # (..., K) fp32 or bf16
    panels: torch.Tensor,  # pack_int8_panels(q) of an (N, K) int8 weight
    scale: torch.Tensor,  # (N,) fp32
    bias: torch.Tensor | None,  # (N,), x's dtype
    out_features: int,
) -> torch.Tensor:  # (..., N)
    """scale * (x q^T) + bias through the int8 panels, for any number of rows (batch-1 decode
    included: see cpu_ops.c)."""
    lib = library()
    assert lib is not None and supports_int8(x) and panels.dtype == torch.int8
    assert scale.dtype == torch.float32 and scale.is_contiguous()
    assert bias is None or (bias.dtype == x.dtype and bias.is_contiguous())
    x = x.contiguous()
    in_features = x.shape[-1]
    assert panels.numel() >= int8_panel_numel(out_features, in_features)
    out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    status = lib.int8_panel_gemm(x.data_ptr(), panels.data_ptr(), scale.data_ptr(),
                                 None if bias is None else bias.data_ptr(), out.data_ptr(),
                                 x.numel() // in_features, out_features, in_features, DTYPE_CODES[x.dtype],
                                 torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"int8_panel_gemm kernel failed with status {status}")
    return out


MOE_WORKSPACE_LIMIT_BYTES = 256 * 2**20
"""`moe_experts_` declines a call whose workspace would pass this (a 2,048-token prefill chunk of
Mixtral 8x7B in fp32 would take 0.8 GiB in each layer's call)."""


def moe_workspace_bytes(
    num_pairs: float, hidden_size: int, intermediate_size: int, element_bytes: int
) -> float:
    """The rows `moe_experts` holds at once for `num_pairs` (token, expert) pairs: each pair's
    gathered input and output row and its gate/up and activation rows (cpu_ops.c's
    moe_workspace_bytes, less its index arrays), which MOE_WORKSPACE_LIMIT_BYTES bounds."""
    return num_pairs * (2 * hidden_size + 3 * intermediate_size) * element_bytes


class ExpertWeights:
    """The experts of a mixture-of-experts block as `moe_experts_` reads them: for each expert its
    fused gate/up linear (2F, E) and its down linear (E, F), each as (row-major weight or None,
    panel-packed weight, bias or None), in the dtype. Holds the tensors, so that the pointers of
    its table stay valid. The row-major weights are needed where an expert can get fewer than
    `min_panel_rows(dtype)` rows."""

    def __init__(
        self,
        gate_up: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]],
        down: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]],
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
    ) -> None:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype must be one of {list(DTYPE_CODES)}, got {dtype}")
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(f"gate_up and down must list the same experts, got {len(gate_up)} and "
                             f"{len(down)}")
        E, F = hidden_size, intermediate_size
        for t in (t for copies in (gate_up, down) for expert in copies for t in expert if t is not None):
            if t.device.type != "cpu":
                raise ValueError(f"expert weights must be CPU tensors, got one on {t.device}")
        for name, copies, shape in (("gate_up", gate_up, (2 * F, E)), ("down", down, (E, F))):
            for e, (rows, panels, bias) in enumerate(copies):
                _check_copies(f"{name}[{e}]", rows, panels, bias, *shape, dtype)
        self.hidden_size, self.intermediate_size, self.dtype = E, F, dtype
        self._tensors = [t for copies in (gate_up, down) for expert in copies for t in expert]
        self.table = (MoeExpert * len(gate_up))(*(
            MoeExpert(*map(_pointer, (*up, *dn))) for up, dn in zip(gate_up, down, strict=True)))

    @property
    def num_experts(self) -> int:
        return len(self.table)


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_copies(name: str, rows: torch.Tensor | None, panels: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int, in_features: int, dtype: torch.dtype) -> None:
    numel = panel_numel(out_features, in_features, dtype)
    if panels.dtype != dtype or not panels.is_contiguous() or panels.numel() < numel:
        raise ValueError(f"{name}'s panels must be a contiguous {dtype} tensor of {numel} elements "
                         f"(pack_panels), got {panels.dtype} {tuple(panels.shape)}")
    if rows is not None and (rows.dtype != dtype or not rows.is_contiguous()
                             or rows.shape != (out_features, in_features)):
        raise ValueError(f"{name}'s row-major weight must be a contiguous {dtype} tensor of shape "
                         f"{(out_features, in_features)}, got {rows.dtype} {tuple(rows.shape)}")
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()
                             or bias.shape != (out_features,)):
        raise ValueError(f"{name}'s bias must be a contiguous {dtype} tensor of shape ({out_features},), "
                         f"got {bias.dtype} {tuple(bias.shape)}")


def moe_experts_(
    out: torch.Tensor,  # (N, E), added into
    x: torch.Tensor,  # (N, E)
    expert_ids: torch.Tensor,  # (N, k) int64
    weights: torch.Tensor,  # (N, k), fp32 or x's dtype
    experts: ExpertWeights,
    max_panel_rows: int | None = None,
) -> bool:
    """out += each token's routed experts' outputs (SwiGLU) times its routing weights, in one call
    (cpu_ops.c's moe_experts), rounded as `SparseMoeBlock._routed` rounds them. False, with out
    untouched, where an expert would get more than `max_panel_rows` rows (None: no limit), which
    the panel kernel should not take, or where the call's workspace (every routed row's
    intermediates at once) would pass MOE_WORKSPACE_LIMIT_BYTES or cannot be allocated: the
    block's own path, one expert at a time, needs less."""
    lib = library()
    assert lib is not None
    E, dtype = experts.hidden_size, experts.dtype
    if x.dtype != dtype or out.dtype != dtype or x.dim() != 2 or x.shape[1] != E or out.shape != x.shape:
        raise ValueError(f"x and out must both be (N, {E}) {dtype} tensors, got x {x.dtype} "
                         f"{tuple(x.shape)} and out {out.dtype} {tuple(out.shape)}")
    if not out.is_contiguous() or any(t.device.type != "cpu" for t in (x, out, expert_ids, weights)):
        raise ValueError("out must be a contiguous CPU tensor, and x, expert_ids and weights on the CPU")
    if expert_ids.dtype != torch.int64 or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids must be an int64 tensor of shape ({x.shape[0]}, top_k), got "
                         f"{expert_ids.dtype} {tuple(expert_ids.shape)}")
    if weights.shape != expert_ids.shape or weights.dtype not in (torch.float32, dtype):
        raise ValueError(f"weights must be a float32 or {dtype} tensor of shape {tuple(expert_ids.shape)}, "
                         f"got {weights.dtype} {tuple(weights.shape)}")
    if not 1 <= expert_ids.shape[1] <= experts.num_experts:
        raise ValueError(f"top_k (expert_ids' columns) must lie in [1, {experts.num_experts}], got "
                         f"{expert_ids.shape[1]}")
    if moe_workspace_bytes(expert_ids.numel(), E, experts.intermediate_size, dtype.itemsize) > \
            MOE_WORKSPACE_LIMIT_BYTES:
        return False
    x, expert_ids, weights = x.contiguous(), expert_ids.contiguous(), weights.contiguous()
    status = lib.moe_experts(experts.table, experts.num_experts, x.data_ptr(), expert_ids.data_ptr(),
                             weights.data_ptr(), DTYPE_CODES[weights.dtype], out.data_ptr(), x.shape[0],
                             expert_ids.shape[1], E, experts.intermediate_size, max_panel_rows or 0,
                             DTYPE_CODES[dtype], torch.get_num_threads())
    if status == 3:
        raise ValueError(f"expert_ids must lie in [0, {experts.num_experts}), got "
                         f"[{expert_ids.min().item()}, {expert_ids.max().item()}]")
    if status not in (0, 1, 6):  # 1: no memory for the workspace, 6: an expert over max_panel_rows
        raise RuntimeError(f"moe_experts kernel failed with status {status}")
    return status == 0


def write_kv(
    k: torch.Tensor,  # (N, K, D)
    v: torch.Tensor,  # (N, K, D)
    k_cache: torch.Tensor,  # (P, S, K, D)
    v_cache: torch.Tensor,  # (P, S, K, D)
    slot_mapping: torch.Tensor,  # (N,) int64
) -> None:
    """Store the new tokens' keys and values at their cache slots, reading k and v in place where
    their rows are strided (the fused q/k/v product's keys and values). A cache of k's dtype takes
    their bytes; an fp8 one (`FP8_CACHE_CODES`) each value saturated and rounded to nearest even,
    as `paged_attention.to_cache_dtype` converts it."""
    lib = library()
    assert lib is not None and supports(k) and k_cache.dtype == v_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    dtype = cache_dtype_code(k.dtype, k_cache.dtype)
    k, v, slot_mapping = _rows_of_heads(k), _rows_of_heads(v), slot_mapping.contiguous()
    status = lib.write_kv(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          slot_mapping.data_ptr(), k.shape[0], k.shape[1] * k.shape[2], k.stride(0),
                          v.stride(0), dtype, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"write_kv kernel failed with status {status}")


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x (..., heads, D) as (rows, heads, D) whose heads are contiguous within each row, rows
    x.stride(0) apart: a view of x where its rows allow one (as the fused q/k/v product's splits
    do), else a contiguous copy."""
    heads, head_dim = x.shape[-2], x.shape[-1]
    try:
        rows = x.view(-1, heads, head_dim)
    except RuntimeError:  # rows no single stride apart
        return x.reshape(-1, heads, head_dim).contiguous()
    overlapping = rows.shape[0] > 1 and rows.stride(0) < heads * head_dim  # an expanded x
    if rows.stride(2) != 1 or rows.stride(1) != head_dim or overlapping:
        return rows.contiguous()
    return rows


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, one_plus_weight: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dimension, rounding as Hugging Face's implementation does; with
    `one_plus_weight` Gemma's: times (1 + weight), all in fp32, rounded once at the end."""
    lib = library()
    assert lib is not None and supports(x) and weight.dtype == x.dtype
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    lib.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps, one_plus_weight,
                 DTYPE_CODES[x.dtype], torch.get_num_threads())
    return out


def add_rms_norm_(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
    one_plus_weight: bool = False,
) -> torch.Tensor:
    """residual += x in place (rounded as PyTorch's `residual + x`), then `rms_norm` of the new
    residual (Gemma's with `one_plus_weight`), in one pass over the rows; returns the normed rows."""
    lib = library()
    assert lib is not None and supports(x) and residual.is_contiguous() and residual.shape == x.shape
    assert residual.dtype == x.dtype == weight.dtype
    x = x.contiguous()
    out = torch.empty_like(residual)
    dim = residual.shape[-1]
    lib.add_rms_norm(residual.data_ptr(), x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                     residual.numel() // dim, dim, eps, one_plus_weight, DTYPE_CODES[x.dtype],
                     torch.get_num_threads())
    return out


def rotary_embedding_(
    x: torch.Tensor,  # (..., T, heads, D), rotated in place
    cos: torch.Tensor,  # (..., T, R)
    sin: torch.Tensor,  # (..., T, R)
) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin over the first R dimensions of each head (the rest pass
    through); returns the rotated tensor: x itself, rotated in place, wherever its rows are one
    stride apart with contiguous heads (contiguous tensors, and the fused q/k/v product's queries
    and keys), else a rotated copy."""
    lib = library()
    assert lib is not None and supports(x) and cos.dtype == x.dtype and cos.shape[-1] <= x.shape[-1]
    rows = _rows_of_heads(x)
    cos, sin = cos.contiguous(), sin.contiguous()
    num_heads, head_dim = x.shape[-2], x.shape[-1]
    lib.rotary_embedding(rows.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                         rows.shape[0], num_heads, head_dim, cos.shape[-1], rows.stride(0),
                         DTYPE_CODES[x.dtype], torch.get_num_threads())
    return x if rows.data_ptr() == x.data_ptr() else rows.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # (..., 2F) -> (..., F)
    """silu(gate) * up for x = [gate, up] along the last dimension, in one pass."""
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # (..., 2F) -> (..., F)
    """gelu(gate) * up (GELU's tanh approximation, Gemma's GeGLU) for x = [gate, up] along the last
    dimension, in one pass; in bf16 the activation rounds before the product, as in PyTorch."""
    return _act_and_mul(x, gelu=True)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    lib = library()
    assert lib is not None and supports(x) and x.shape[-1] % 2 == 0
    x = x.contiguous()
    width = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype)
    lib.act_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], width, gelu, DTYPE_CODES[x.dtype],
                    torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:  # (rows, width) -> (rows,) long
    """`x.argmax(-1)` of a 2-D tensor, as torch chooses (the first of equal largest values; the
    first NaN where there is one), without converting bf16 to fp32 first."""
    lib = library()
    assert lib is not None and supports(x) and x.dim() == 2 and x.shape[1] > 0
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], DTYPE_CODES[x.dtype],
                    torch.get_num_threads())
    return out


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels handle tensors like `x` (else use the PyTorch path)."""
    return x.device.type == "cpu" and x.dtype in DTYPE_CODES and library() is not None


def _build_key(compiler: list[str]) -> str:
    cpu_flags = ""
    try:
        cpu_flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        )
    except OSError:
        pass
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True).stdout
    sources = [path.read_text() for path in (*SOURCES, *HEADERS)]
    material = "\n".join([*sources, " ".join(CFLAGS + LDFLAGS), cpu_flags, version])
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def _compile(compiler: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        tmp_path = Path(tmp) / path.name
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        builds = [subprocess.Popen([*compiler, *CFLAGS, "-c", "-o", str(obj), str(source)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                  for source, obj in zip(SOURCES, objects, strict=True)]
        outputs = [build.communicate()[0] for build in builds]
        for build, output in zip(builds, outputs, strict=True):
            if build.returncode != 0:
                raise subprocess.CalledProcessError(build.returncode, build.args, output)
        subprocess.run([*compiler, *LDFLAGS, "-o", str(tmp_path), *map(str, objects), "-lm"],
                       check=True, capture_output=True, text=True)
        os.replace(tmp_path, path)  # atomic: concurrent builders race harmlessly
    logger.info("built %s", path)
