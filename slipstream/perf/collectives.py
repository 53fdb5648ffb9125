"""Latency-bandwidth (alpha-beta) costs of collectives, and nccl-tests' algbw/busbw conventions.

Sizes follow nccl-tests (`doc/PERFORMANCE.md`, https://github.com/NVIDIA/nccl-tests/blob/master/
doc/PERFORMANCE.md): `size_bytes` is the size of the *full* array: the buffer being all-reduced
or broadcast, the gathered output of an all-gather, the input of a reduce-scatter, one rank's
whole send buffer of an all-to-all. Then `algbw = size / time` and `busbw = algbw * factor`, with
factor 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for
broadcast, reduce and send/recv. busbw is what a link must carry per direction, so it is the
number to compare with a link's per-direction bandwidth.

Costs (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
MPICH", IJHPCA 2005; p ranks, alpha the per-step latency, B the per-direction link bandwidth):

- ring all-gather / reduce-scatter: `(p-1) alpha + (p-1)/p * S / B`
- ring all-reduce (reduce-scatter then all-gather): `2 (p-1) alpha + 2 (p-1)/p * S / B`
- tree all-reduce: `2 ceil(log2 p) alpha` latency with the ring's bandwidth term; NCCL's double
  binary tree moves the same bytes per link (nccl-tests: the all-reduce bus factor does not
  depend on the algorithm), so only the latency term differs (our approximation).
- all-to-all (pairwise exchange): `(p-1) alpha + (p-1)/p * S / B`
- broadcast: pipelined ring `(p-1) alpha + S / B`, or binomial tree `ceil(log2 p) (alpha + S / B)`.

Hierarchical variants (g devices per node, N nodes; composition, our derivation): all-reduce =
reduce-scatter inside the node + all-reduce of S/g across nodes + all-gather inside the node;
all-gather / reduce-scatter = the inter-node step on S/g plus the intra-node step on S;
all-to-all = the intra-node share of the bytes over the node link plus the rest over the network.
Reduction arithmetic (the gamma term) is ignored: on GPUs it hides under the transfer.

Measured per-call costs (`MeasuredCost`): gloo among processes of one host pays its latency per
call more than per ring step. Each call is queued to the process group's worker thread and crosses
loopback TCP (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp); a reduce-scatter is a clone of the
input, an all-reduce of all of it and a copy of the rank's chunk (`reduce_scatter_tensor_coalesced`).
On 2 ranks of a 2-core VM a small all-gather measured 1.0-1.6 of an all-reduce's ring steps and a
reduce-scatter 1.0-3.7, where the ring model charges each one (docs/perf.md). So a link calibrated
collective by collective (`hardware.calibrate_link`) prices each with its own fit, `alpha_c +
beta_c * bus bytes`, kept in units of the link (`latency_steps` link latencies, `bandwidth_share`
of its bandwidth) so that efficiency knobs and what-if scales still apply.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
ALGORITHMS = ("ring", "tree")


def busbw_factor(collective: str, num_ranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor (doc/PERFORMANCE.md)."""
    _check(collective, num_ranks)
    n = num_ranks
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send/recv


def algbw(size_bytes: float, time_s: float) -> float:
    """Algorithm bandwidth: full array size over time (nccl-tests)."""
    if not time_s > 0:
        raise ValueError(f"time_s must be > 0, got {time_s}")
    return size_bytes / time_s


def busbw(collective: str, size_bytes: float, time_s: float, num_ranks: int) -> float:
    """Bus bandwidth: `algbw * busbw_factor` (nccl-tests)."""
    return algbw(size_bytes, time_s) * busbw_factor(collective, num_ranks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """One link tier: per-step latency alpha and per-direction bandwidth (1 / beta)."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"need latency_s >= 0 and bandwidth > 0, got {self}")


@dataclasses.dataclass(frozen=True)
class MeasuredCost:
    """One collective's measured cost per call, in units of the link it was measured on: it pays
    `latency_steps` of the link's latencies (in place of the algorithm's count) and moves its bus
    bytes at `bandwidth_share` of the link's bandwidth (see the module docstring)."""

    latency_steps: float
    bandwidth_share: float

    def __post_init__(self) -> None:
        if not (self.latency_steps >= 0 and math.isfinite(self.latency_steps)) or not (
                self.bandwidth_share > 0 and math.isfinite(self.bandwidth_share)):
            raise ValueError(f"need latency_steps >= 0 and bandwidth_share > 0 (finite), got {self}")


def latency_steps(collective: str, num_ranks: int, algorithm: str = "ring") -> float:
    """How many alpha terms one collective pays (see the module docstring)."""
    _check(collective, num_ranks, algorithm)
    p = num_ranks
    if p == 1:
        return 0.0
    log_p = math.ceil(math.log2(p))
    if collective == "all_reduce":
        return 2 * log_p if algorithm == "tree" else 2 * (p - 1)
    if collective == "broadcast":
        return log_p if algorithm == "tree" else p - 1
    if collective == "send_recv":
        return 1.0
    return p - 1.0


def bandwidth_bytes(collective: str, size_bytes: float, num_ranks: int, algorithm: str = "ring") -> float:
    """Bytes each rank must push through its link per direction (the beta term's numerator)."""
    _check(collective, num_ranks, algorithm)
    if num_ranks == 1:
        return 0.0
    if collective == "broadcast" and algorithm == "tree":
        return math.ceil(math.log2(num_ranks)) * size_bytes
    return size_bytes * busbw_factor(collective, num_ranks)


def collective_time_s(
    collective: str, size_bytes: float, num_ranks: int, link: Link, algorithm: str = "ring",
    measured: MeasuredCost | None = None,
) -> float:
    """Alpha-beta time of one flat collective over `num_ranks` ranks joined by `link`; with
    `measured`, at that measured cost per call (`alpha_c + beta_c * bus bytes` on the link it was
    measured on) rather than the algorithm's latency steps and the link's full bandwidth."""
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
    steps = latency_steps(collective, num_ranks, algorithm)
    bandwidth = link.bandwidth_bytes_per_s
    if measured is not None and num_ranks > 1:
        steps, bandwidth = measured.latency_steps, bandwidth * measured.bandwidth_share
    return steps * link.latency_s + bandwidth_bytes(collective, size_bytes, num_ranks, algorithm) / bandwidth


def hierarchical_time_s(
    collective: str, size_bytes: float, num_ranks: int, ranks_per_node: int,
    intra: Link, inter: Link, algorithm: str = "ring",
) -> float:
    """Two-level time: `ranks_per_node` ranks share the fast `intra` link, nodes use `inter`.

    Falls back to a flat collective when the group fits in one node (or spans one rank per node),
    and to a flat one over the slower `inter` link when the ranks fill their nodes unevenly (12
    ranks on nodes of 8): a ring through all of them waits on its slowest link at every step.
    """
    g = min(ranks_per_node, num_ranks)
    if num_ranks % g:
        return collective_time_s(collective, size_bytes, num_ranks, inter, algorithm)
    nodes = num_ranks // g
    if nodes == 1:
        return collective_time_s(collective, size_bytes, g, intra, algorithm)
    if g == 1:
        return collective_time_s(collective, size_bytes, nodes, inter, algorithm)
    if collective == "all_reduce":
        return (collective_time_s("reduce_scatter", size_bytes, g, intra)
                + collective_time_s("all_reduce", size_bytes / g, nodes, inter, algorithm)
                + collective_time_s("all_gather", size_bytes, g, intra))
    if collective in ("all_gather", "reduce_scatter"):
        return (collective_time_s(collective, size_bytes / g, nodes, inter)
                + collective_time_s(collective, size_bytes, g, intra))
    if collective == "all_to_all":
        local = size_bytes * (g - 1) / num_ranks  # the share bound for the same node
        remote = size_bytes * (num_ranks - g) / num_ranks
        return ((g - 1) * intra.latency_s + local / intra.bandwidth_bytes_per_s
                + (nodes - 1) * inter.latency_s + remote / inter.bandwidth_bytes_per_s)
    if collective == "broadcast":
        return (collective_time_s("broadcast", size_bytes, nodes, inter, algorithm)
                + collective_time_s("broadcast", size_bytes, g, intra, algorithm))
    return collective_time_s(collective, size_bytes, 2, inter)  # send_recv crosses the network


@dataclasses.dataclass(frozen=True)
class AlphaBetaFit:
    """Least-squares fit of measured collective times: `time = alpha_s + beta_s_per_byte * bus_bytes`.

    `bus_bytes = size * busbw_factor`, so `1 / beta_s_per_byte` is the asymptotic busbw and
    `alpha_s` the whole collective's start-up latency (per step: `alpha_s / latency_steps`). A fit
    whose beta is 0 (the larger messages were measured no slower: noise, or sizes too close) has
    no bandwidth: `busbw_bytes_per_s` is None, not infinite.
    """

    collective: str
    num_ranks: int
    alpha_s: float
    beta_s_per_byte: float
    max_relative_error: float

    @property
    def busbw_bytes_per_s(self) -> float | None:
        return None if self.beta_s_per_byte <= 0 else 1.0 / self.beta_s_per_byte

    def link(self, algorithm: str = "ring") -> Link:
        """The fitted link as a `Link` (alpha spread over the algorithm's latency steps);
        ValueError for a fit without bandwidth."""
        if self.busbw_bytes_per_s is None:
            raise ValueError(f"the {self.collective} fit over {self.num_ranks} ranks found no bandwidth "
                             "term (beta 0): the larger messages were not slower")
        steps = max(latency_steps(self.collective, self.num_ranks, algorithm), 1.0)
        return Link(latency_s=self.alpha_s / steps, bandwidth_bytes_per_s=self.busbw_bytes_per_s)

    def cost(self, link: Link) -> MeasuredCost:
        """This fit in units of `link` (`MeasuredCost`): over it, `collective_time_s(...,
        measured=fit.cost(link))` gives the fitted line back. A link without latency (an all-reduce
        fit clamped to alpha 0) has no unit to count this fit's alpha in: it keeps the ring's steps,
        paying no latency as the link does. ValueError for a fit without bandwidth."""
        if self.busbw_bytes_per_s is None:
            raise ValueError(f"the {self.collective} fit over {self.num_ranks} ranks found no bandwidth "
                             "term (beta 0): the larger messages were not slower")
        steps = (self.alpha_s / link.latency_s if link.latency_s > 0
                 else latency_steps(self.collective, self.num_ranks))
        return MeasuredCost(steps, self.busbw_bytes_per_s / link.bandwidth_bytes_per_s)

    def predict_s(self, size_bytes: float) -> float:
        factor = busbw_factor(self.collective, self.num_ranks)
        return self.alpha_s + self.beta_s_per_byte * size_bytes * factor


def fit_alpha_beta(
    collective: str, num_ranks: int, sizes_bytes: Sequence[float], times_s: Sequence[float]
) -> AlphaBetaFit:
    """Fit alpha and beta to (size, time) measurements by least squares on relative error.

    Each point is weighted by 1 / time so small (latency-bound) messages count as much as large
    ones; both coefficients are kept non-negative. The sizes must hold two distinct values: one
    size alone fixes no slope.
    """
    if len(sizes_bytes) != len(times_s) or len(set(sizes_bytes)) < 2:
        raise ValueError(f"need (size, time) pairs of equal length with at least two distinct sizes, "
                         f"got sizes {list(sizes_bytes)} and {len(times_s)} times")
    factor = busbw_factor(collective, num_ranks)
    xs = [s * factor for s in sizes_bytes]
    alpha, beta = _weighted_line(xs, list(times_s))
    errors = [abs(alpha + beta * x - t) / t for x, t in zip(xs, times_s, strict=True)]
    return AlphaBetaFit(collective, num_ranks, alpha, beta, max(errors))


def _weighted_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Minimise sum(((a + b x - y) / y)^2) with a, b >= 0 (2x2 normal equations, then clamps)."""
    w = [1.0 / (y * y) for y in ys]
    s0, s1 = sum(w), sum(wi * x for wi, x in zip(w, xs, strict=True))
    s2 = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    t0 = sum(wi * y for wi, y in zip(w, ys, strict=True))
    t1 = sum(wi * x * y for wi, x, y in zip(w, xs, ys, strict=True))
    det = s0 * s2 - s1 * s1
    a, b = ((t0 * s2 - s1 * t1) / det, (s0 * t1 - s1 * t0) / det) if det else (t0 / s0, 0.0)
    if b < 0:
        return t0 / s0, 0.0
    if a < 0:
        return 0.0, t1 / s2
    return a, b


def _check(collective: str, num_ranks: int, algorithm: str = "ring") -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive integer, got {num_ranks!r}")
