"""CPU memory placement: keep freed memory in the process, and back streamed buffers with huge pages.

PyTorch has no caching allocator on the CPU: every intermediate tensor is a malloc/free. glibc
serves large allocations with fresh mmap'd pages and trims the heap on free, so each forward
pass pays page faults on all of its activations again. On the development VM a page fault costs
about 2.5 us, which made elementwise ops over 16 MB activations 5-10x slower than their memory
traffic (a 2048-token prefill step: 1.66 s -> 1.04 s once memory is kept). This is the same
problem vLLM's CPU backend answers by preloading tcmalloc; here we tell glibc directly
(`keep_freed_memory`). glibc maps allocations beyond 32 MiB directly whatever the threshold, so
`keep_large_freed_memory` turns that off for the loops whose sizes repeat. The fp32 gate/up
product of a 2,048-token prefill chunk of the ~125M model is exactly 32 MiB, one allocation
header past that limit, so every layer of every chunk mapped it afresh and faulted it in: the 64
prompts of serve_offline.py's workload, prefilled alone (max_tokens=1, an ad-hoc probe on the
Zen 3), spent 1.7-1.9 s of system time per run, 0.2-0.3 s after (13.1-14.5 s per run, against
14.3-17.0).

Buffers that are streamed whole from memory at every step (the weights batch-1 decode reads)
go on transparent huge pages where the system gives them on request (THP mode "madvise", the
default of many distributions): with 4 KiB pages a stream takes a TLB miss and restarts the
hardware prefetcher every 4 KiB. On the development VM the batch-1 matrix-vector products of the
~125M model read ~9% faster from 2 MiB pages (bf16: 41-44 -> 45-48 GB/s; fp32: 45 -> 49 GB/s).
The panel-packed copies of decode batches go there too (`linear.pack_linears`): on a Zen 3,
where bf16 takes them from one row, benchmarks/weight_pages_ab.py measured whole decode steps
1.07-1.08x at batch 1 and 1.08-1.10x at batch 4 in bf16, fp32 1.03-1.05x at batch 4, even at
batch 64. The cost is start-up, as faulting in 2 MiB pages is slower there than 4 KiB ones (1.6
against 0.4 s per GiB): the script's fp32 engine built in 2.00 s with every copy on huge pages
against 1.04 s with none (an upper bound: the first engine also pays the process's first-use
costs); in fresh processes fp32 `LLM()` to first token went from 1.7-2.3 to 2.0-2.3 s, and bf16
(200 MB of panels) was not measurably slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_MAX_MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's upper limit on 64-bit systems


def _mallopt():
    """glibc's mallopt, or None (with a log line) where there is none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        logger.info("no glibc mallopt here; leaving the allocator alone")
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Serve allocations up to 32 MiB from the heap and never trim it (glibc only; a no-op
    returning False elsewhere). Process-wide and idempotent: engines and trainers call it."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD_BYTES) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    logger.info("glibc allocator %s to keep freed memory", "set" if ok else "could not be set")
    return ok


@functools.cache
def keep_large_freed_memory() -> bool:
    """Serve every later allocation from the heap (glibc's M_MMAP_MAX = 0), so that freed tensors
    beyond glibc's 32 MiB limit on the mmap threshold are reused too instead of unmapped; with
    `keep_freed_memory`, which stops the heap being trimmed. Process-wide and idempotent; a no-op
    returning False where glibc's mallopt is absent. For loops whose tensor sizes repeat: CPU
    training (the logits and their gradients) and the engine's steps once its weights and KV
    cache are in place (an fp32 prefill chunk of 2,048 tokens has a 32 MiB gate/up product per
    layer). Memory freed afterwards stays with the process."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_MAX, 0) == 1
    logger.info("glibc allocator %s to serve large allocations from the heap", "set" if ok else "not set")
    return ok


HUGE_PAGE_BYTES = 2 * 2**20


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor on 2 MiB-aligned memory that the kernel is asked to back
    with transparent huge pages (madvise MADV_HUGEPAGE, before any page is touched). Where that
    advice is not available the memory is an ordinary anonymous mapping, and where anonymous
    mappings are not (Windows) an ordinary tensor; the tensor keeps the mapping alive."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as e:  # no THP here, or not Linux
        logger.debug("no transparent huge pages: %s", e)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[offset : offset + nbytes].view(dtype)
