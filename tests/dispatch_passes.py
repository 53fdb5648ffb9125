"""What torch's dispatcher runs outside matrix products, for the perf tests that price eager
kernels: bytes read plus written and kernels launched."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MATMULS = ("mm", "addmm", "bmm", "_scaled_dot_product")
"""Ops priced as matrix products (and attention), not as passes over memory."""


class NonMatmulPasses(TorchDispatchMode):
    """Bytes read plus written, and kernels, of the ops torch runs outside `skip` (matmuls and
    attention); views and aliases (an output sharing an input's storage) are free. With
    `expanded_as_storage`, an expanded input counts its storage, not its broadcast size.
    Subclasses say which ops count (`counts`) and which inputs they read (`read`)."""

    def __init__(self, *, skip: tuple[str, ...] = MATMULS, expanded_as_storage: bool = False) -> None:
        super().__init__()
        self.skip, self.expanded_as_storage = skip, expanded_as_storage
        self.bytes, self.kernels = 0, 0

    def counts(self, func) -> bool:
        return not func.__name__.startswith(self.skip) if self.skip else True

    def read(self, func, inputs: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        return inputs

    def _nbytes(self, t: torch.Tensor) -> int:
        nbytes = t.numel() * t.element_size()
        return min(nbytes, t.untyped_storage().nbytes()) if self.expanded_as_storage else nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        if self.counts(func) and not any(t.untyped_storage().data_ptr() in storages for t in outputs):
            self.bytes += sum(self._nbytes(t) for t in [*self.read(func, inputs), *outputs])
            self.kernels += 1
        return out
