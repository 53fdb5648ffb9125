"""All-reduce and gather through shared memory, for tensor-parallel ranks on one CPU host.

gloo moves a tensor between two local processes over loopback TCP: about 300-400 us for an
all-reduce of a single 768-wide row on the development VM, where the whole exchange through a
shared buffer takes about 20 us (and 53 against 449 us at 64 rows; measured in one run, see
benchmarks/serve_tensor_parallel.py for the engine-level effect). vLLM's CPU backend sums its
tensor-parallel partials through shared memory too.

The buffer is an anonymous memory file (`memfd_create`: no name anywhere, so no rank's death
leaves it behind, and not bounded by a small /dev/shm such as a container's), its pages reserved
when it is made (so that a machine short of memory refuses it then, not with a SIGBUS mid-step),
passed to the workers as an inherited descriptor and mapped by every rank. It holds one flag per
rank (each on its own cache line) and two sets of one slot per rank. A collective of generation g writes this
rank's tensor into its slot of set g % 2, then publishes g in its flag, then waits until every
flag reaches g: a barrier, after which every slot of the set holds that collective's tensors.
A rank writes set g % 2 again only at g + 2, after the barrier of g + 1, which no rank passes
before every rank has finished reading at g. Every rank sums the slots in rank order, so all
ranks hold bitwise the same sum (the layers after it must agree). Ordering relies on x86's
total store order (a slot's bytes become visible before the flag written after them, loads are
not reordered with loads), so `SharedExchange.supported` is False elsewhere and gloo is used.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

FLAG_STRIDE = 8
"""int64s between two ranks' flags: one 64-byte cache line each, so that they do not share one."""
SPINS_BEFORE_YIELD = 2000
"""Spins on a flag (about 0.1 us each) before a waiting rank starts yielding its core, in case a
rank that it waits for shares it."""
CHECK_EVERY_S = 0.5


class SharedExchange:
    """One rank's view of the shared buffer: `all_reduce_` and `gather` of tensors of up to
    `slot_bytes`. `alive()` is asked while a rank waits long: False (a peer died) is an error."""

    def __init__(self, fd: int, rank: int, size: int, slot_bytes: int, alive: Callable[[], bool],
                 timeout_s: float) -> None:
        """Map the buffer `fd` refers to (the caller may close `fd` afterwards)."""
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.alive, self.timeout_s = alive, timeout_s
        self._header_bytes = header_bytes(size)
        self._map = mmap.mmap(fd, buffer_bytes(size, slot_bytes))
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=size * FLAG_STRIDE)
        self._generation = 0

    @staticmethod
    def supported(device: torch.device) -> bool:
        return (device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64")
                and hasattr(os, "memfd_create"))

    @staticmethod
    def create(size: int, slot_bytes: int) -> int:
        """A zeroed buffer for `size` ranks, its memory reserved; returns its descriptor (the caller
        closes it). OSError where the memory cannot be had."""
        fd = os.memfd_create("slipstream-tensor-parallel")
        try:
            os.ftruncate(fd, buffer_bytes(size, slot_bytes))
            os.posix_fallocate(fd, 0, buffer_bytes(size, slot_bytes))
        except OSError:
            os.close(fd)
            raise
        return fd

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (the same bits on every rank)."""
        parts = self._exchange(x)
        torch.add(parts[0], parts[1], out=x)
        for part in parts[2:]:
            x.add_(part)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` at rank 0, in rank order, as views of the buffer that hold until the
        collective after next (copy them before then); None on the others."""
        parts = self._exchange(x)
        return parts if self.rank == 0 else None

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish `x`, wait for every rank's, and return views of all of them (valid until the
        collective after next)."""
        self._generation += 1
        generation = self._generation
        num_bytes = x.numel() * x.element_size()
        self._slot(generation, self.rank, num_bytes).copy_(x.contiguous().view(-1).view(torch.uint8))
        self._flags[self.rank * FLAG_STRIDE] = generation
        for rank in range(self.size):
            if rank != self.rank:
                self._wait(rank, generation)
        return [self._slot(generation, rank, num_bytes).view(x.dtype).view(x.shape)
                for rank in range(self.size)]

    def _slot(self, generation: int, rank: int, num_bytes: int) -> torch.Tensor:
        start = self._header_bytes + ((generation % 2) * self.size + rank) * self.slot_bytes
        return self._bytes[start : start + num_bytes]

    def _wait(self, rank: int, generation: int) -> None:
        flags, index = self._flags, rank * FLAG_STRIDE
        spins = 0
        while flags[index] < generation:
            spins += 1
            if spins < SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            if spins == SPINS_BEFORE_YIELD:
                started = checked = time.monotonic()
            elif (now := time.monotonic()) - checked > CHECK_EVERY_S:
                checked = now
                if not self.alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} is gone: the collective cannot finish")
                if now - started > self.timeout_s:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not reach the collective "
                                       f"in {self.timeout_s:.0f} s")


def header_bytes(size: int) -> int:
    """The flags' bytes, in whole 4 KiB pages (so that the slots start page-aligned)."""
    return -(-size * FLAG_STRIDE * 8 // 4096) * 4096


def buffer_bytes(size: int, slot_bytes: int) -> int:
    return header_bytes(size) + 2 * size * slot_bytes
