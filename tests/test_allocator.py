"""CPU memory placement: huge-page buffers hold what is copied into them, aligned to 2 MiB."""

from __future__ import annotations

import mmap
import platform
import subprocess
import sys

import pytest
import torch

from slipstream.ops.allocator import HUGE_PAGE_BYTES, huge_page_empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(0,), (7,), (1000, 768), (3, 5, 2, 64)])
def test_huge_page_buffer_is_aligned_and_holds_a_copy(dtype, shape):
    source = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.randint(-9, 9, shape)
    copy = huge_page_empty(source.numel(), dtype).view(shape).copy_(source)
    assert copy.shape == source.shape and copy.dtype == source.dtype and copy.is_contiguous()
    assert torch.equal(copy, source)
    assert copy.data_ptr() % HUGE_PAGE_BYTES == 0
    assert source.numel() == 0 or copy.data_ptr() != source.data_ptr()  # empty tensors have no memory


def test_huge_page_memory_outlives_its_mapping_object():
    """The tensor keeps the mapping alive: writing after every other reference is gone is safe."""
    tensor = huge_page_empty(3 * HUGE_PAGE_BYTES // 4, torch.float32)
    tensor.fill_(1.5)
    assert tensor.sum().item() == 1.5 * tensor.numel()


def test_without_huge_page_advice_the_buffer_still_works(monkeypatch):
    """On a system without MADV_HUGEPAGE (not Linux, or an old kernel) the memory is ordinary."""
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    tensor = huge_page_empty(1024, torch.bfloat16)
    tensor.copy_(torch.arange(1024))
    assert torch.equal(tensor, torch.arange(1024).to(torch.bfloat16))


def test_without_anonymous_mappings_it_is_an_ordinary_tensor(monkeypatch):
    """Windows has no MAP_ANONYMOUS: the buffer is a plain tensor there."""
    monkeypatch.delattr(mmap, "MAP_ANONYMOUS", raising=False)
    tensor = huge_page_empty(10, torch.float32)
    assert tensor.shape == (10,) and tensor.dtype == torch.float32


LARGE_REUSE_SCRIPT = """
import ctypes, ctypes.util, torch
from slipstream.ops.allocator import keep_freed_memory, keep_large_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
numel = 48 * 2**20 // 4  # 48 MiB: beyond glibc's largest mmap threshold (32 MiB)
assert keep_freed_memory()
large = torch.empty(numel)
assert libc.mallinfo2().hblkhd >= 4 * numel  # mmap'd: unmapped again when freed
del large
assert keep_large_freed_memory() and keep_large_freed_memory()  # idempotent
heaps = []
for _ in range(40):  # as a loop's step allocates and frees its tensors
    large = torch.empty(numel).fill_(1.0)
    assert libc.mallinfo2().hblkhd < 4 * numel  # from the heap
    del large
    heaps.append(libc.mallinfo2().arena)
assert len(set(heaps[-20:])) == 1, heaps  # the heap stops growing: tensors reuse freed memory
print("ok")
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and mallinfo2")
def test_large_freed_tensors_are_reused_after_keep_large_freed_memory():
    """Process-wide, so in a fresh process: before, a 48 MiB tensor is mmap'd (and unmapped when
    freed); after, tensors of that size come from the heap, which stops growing after a few (64-byte
    aligned blocks do not always fit the hole the last one left): each reuses freed memory."""
    result = subprocess.run([sys.executable, "-c", LARGE_REUSE_SCRIPT], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
