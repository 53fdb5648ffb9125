"""Measure torch.distributed collectives over message sizes and fit alpha and beta.

`measure` spawns `world_size` processes that join a process group on 127.0.0.1 (gloo on a CPU,
NCCL on GPUs, one GPU per process), times each collective at each size (size by size, the
collectives in turn; after warm-up, the slowest rank's time, median over iterations, as nccl-tests
takes the slowest rank), and reports nccl-tests' algbw and busbw. `fit` turns the timings into
`collectives.AlphaBetaFit`s. Sizes follow nccl-tests (`collectives.py`): the full array.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import statistics
import time
from collections.abc import Sequence
from typing import Any

from slipstream.perf.collectives import AlphaBetaFit, algbw, busbw, fit_alpha_beta

logger = logging.getLogger(__name__)

MEASURED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
DEFAULT_SIZES = tuple(2**k for k in range(10, 25, 2))  # 1 KiB .. 16 MiB


@dataclasses.dataclass(frozen=True)
class Timing:
    collective: str
    size_bytes: int
    num_ranks: int
    time_s: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "algbw_bytes_per_s": algbw(self.size_bytes, self.time_s),
            "busbw_bytes_per_s": busbw(self.collective, self.size_bytes, self.time_s, self.num_ranks),
        }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(
    world_size: int = 2, backend: str = "gloo", sizes: Sequence[int] = DEFAULT_SIZES,
    collectives: Sequence[str] = MEASURED, iterations: int = 10, warmup: int = 2,
) -> tuple[list[Timing], dict[str, str]]:
    """(timings, collectives the backend could not run -> why). Spawns `world_size` processes."""
    import torch.multiprocessing as mp

    if world_size < 2:
        raise ValueError(f"world_size must be >= 2, got {world_size}")
    unknown = set(collectives) - set(MEASURED)
    if unknown:
        raise ValueError(f"unknown collectives {sorted(unknown)}; known: {', '.join(MEASURED)}")
    _check_backend(backend, world_size)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    args = (world_size, backend, _free_port(), list(sizes), list(collectives), iterations, warmup, queue)
    mp.start_processes(_worker, args=args, nprocs=world_size, join=True, start_method="spawn")
    timings, errors = queue.get()
    return [Timing(*t) for t in timings], errors


def _check_backend(backend: str, world_size: int) -> None:
    """ValueError, before any process starts, for a backend this PyTorch or machine cannot run."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError("backend nccl: this PyTorch build has no NCCL (a CPU build); use gloo")
        if torch.cuda.device_count() < world_size:
            raise ValueError(f"backend nccl needs a GPU per process: world_size {world_size}, "
                             f"{torch.cuda.device_count()} GPU(s) here")
    elif backend == "gloo" and not dist.is_gloo_available():
        raise ValueError("backend gloo: this PyTorch build has no gloo")


def _worker(rank: int, world_size: int, backend: str, port: int, sizes: list[int],
            collectives: list[str], iterations: int, warmup: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # else every rank's synchronize() waits on GPU 0
    timings, errors = [], {}
    try:
        # Size by size, each collective in turn: a burst of other work on the host falls on every
        # collective alike rather than on one (their fits are compared: `hardware.calibrate_link`).
        for size in sizes:
            for name in (n for n in collectives if n not in errors):
                try:
                    run = _operation(name, size, world_size, device)
                    elapsed = _time(run, iterations, warmup, device)
                except (RuntimeError, ValueError, NotImplementedError) as e:
                    errors[name] = str(e).splitlines()[0][:200]
                    continue
                timings.append((name, 4 * _count(size, world_size), world_size, elapsed))
        timings = [t for name in collectives for t in timings if t[0] == name]
    finally:
        if rank == 0:
            queue.put((timings, errors))
        dist.destroy_process_group()


def _count(size_bytes: int, n: int) -> int:
    """The fp32 elements a collective of about `size_bytes` over n ranks moves: a multiple of n,
    at least n (its bytes are what the timings report)."""
    return max(size_bytes // 4 // n * n, n)


def distinct_sizes(sizes_bytes: Sequence[int], n: int) -> list[int]:
    """The sizes, the first of each group that rounds to one message (`_count`): each would be
    timed again and fitted as a second point of one size."""
    first: dict[int, int] = {}
    for size in sizes_bytes:
        first.setdefault(_count(size, n), size)
    return list(first.values())


def fit_warnings(fits: Sequence[AlphaBetaFit]) -> list[str]:
    """One line per fit that found no bandwidth (its larger messages were not slower)."""
    return [f"warning: the {f.collective} fit over {f.num_ranks} ranks failed: its larger messages were "
            "not slower (noise, or sizes too close), so it has no bandwidth; measure more --iterations "
            "or sizes further apart" for f in fits if f.busbw_bytes_per_s is None]


def _operation(name: str, size_bytes: int, n: int, device: Any) -> Any:
    """A zero-argument callable running collective `name` on `_count(size_bytes, n)` fp32s."""
    import torch
    import torch.distributed as dist

    count = _count(size_bytes, n)
    full = torch.ones(count, device=device)
    shard = torch.ones(count // n, device=device)
    if name == "all_reduce":
        return lambda: dist.all_reduce(full)
    if name == "all_gather":  # the *_single names replace *_into_tensor / *_tensor in torch 2.13
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, shard)
    if name == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, full)
    if name == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
    return lambda: dist.broadcast(full, src=0)


def _time(run: Any, iterations: int, warmup: int, device: Any) -> float:
    """Median over iterations of the slowest rank's time (MAX all-reduce of each rank's time)."""
    import torch
    import torch.distributed as dist

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        run()
    sync()
    times = []
    for _ in range(iterations):
        dist.barrier()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def fit(timings: Sequence[Timing]) -> list[AlphaBetaFit]:
    """One alpha-beta fit per (collective, ranks) with at least two sizes."""
    groups: dict[tuple[str, int], list[Timing]] = {}
    for t in timings:
        groups.setdefault((t.collective, t.num_ranks), []).append(t)
    return [fit_alpha_beta(name, n, [t.size_bytes for t in ts], [t.time_s for t in ts])
            for (name, n), ts in groups.items() if len(ts) >= 2]


def format_report(timings: Sequence[Timing], fits: Sequence[AlphaBetaFit], errors: dict[str, str]) -> str:
    lines = [f"{'collective':<16}{'size':>12}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for t in timings:
        d = t.to_dict()
        lines.append(f"{t.collective:<16}{t.size_bytes:>12}{1e6 * t.time_s:>12.1f}"
                     f"{d['algbw_bytes_per_s'] / 1e9:>12.3f}{d['busbw_bytes_per_s'] / 1e9:>12.3f}")
    lines.append(f"{'fit':<16}{'ranks':>6}{'alpha us':>12}{'busbw GB/s':>12}{'max err':>10}")
    for f in fits:
        row = f"{f.collective:<16}{f.num_ranks:>6}{1e6 * f.alpha_s:>12.1f}"
        if f.busbw_bytes_per_s is None:
            lines.append(row + "  unbounded (fit failed)")
        else:
            lines.append(row + f"{f.busbw_bytes_per_s / 1e9:>12.3f}{100 * f.max_relative_error:>9.1f}%")
    lines += fit_warnings(fits)
    lines += [f"not measured: {name}: {why}" for name, why in errors.items()]
    return "\n".join(lines)
