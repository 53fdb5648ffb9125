"""CPU memory placement: huge-page buffers hold what is copied into them, aligned to 2 MiB."""

from __future__ import annotations

import mmap

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
