"""Alpha-beta collective costs against nccl-tests' conventions and Thakur et al.'s closed forms."""

from __future__ import annotations

import math

import pytest

from slipstream.perf.collectives import (
    Link,
    MeasuredCost,
    algbw,
    busbw,
    busbw_factor,
    collective_time_s,
    fit_alpha_beta,
    hierarchical_time_s,
)

GB = 1e9


def test_busbw_factors_are_nccl_tests():
    """Guards the exact nccl-tests factors (doc/PERFORMANCE.md): 2(n-1)/n, (n-1)/n, 1."""
    n = 8
    assert busbw_factor("all_reduce", n) == 2 * 7 / 8
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert busbw_factor(op, n) == 7 / 8
    assert busbw_factor("broadcast", n) == busbw_factor("send_recv", 2) == 1.0
    assert busbw_factor("all_reduce", 1) == 0.0


def test_algbw_and_busbw_definitions():
    """Guards algbw = S / t and busbw = algbw * factor on an nccl-tests-like line."""
    size, time_s = 1 << 30, 9.3067e-3  # 1 GiB all-reduce on 2 ranks (factor 1)
    assert algbw(size, time_s) == pytest.approx(115.37e9, rel=1e-3)
    assert busbw("all_reduce", size, time_s, 2) == pytest.approx(algbw(size, time_s))
    assert busbw("all_reduce", size, time_s, 8) == pytest.approx(1.75 * algbw(size, time_s))


def test_ring_costs_are_thakur_closed_forms():
    """Guards ring all-reduce 2(p-1)a + 2(p-1)/p S/B and all-gather (p-1)a + (p-1)/p S/B."""
    link = Link(latency_s=5e-6, bandwidth_bytes_per_s=100 * GB)
    p, size = 8, 256e6
    assert collective_time_s("all_reduce", size, p, link) == pytest.approx(
        2 * (p - 1) * 5e-6 + 2 * (p - 1) / p * size / (100 * GB))
    assert collective_time_s("all_gather", size, p, link) == pytest.approx(
        (p - 1) * 5e-6 + (p - 1) / p * size / (100 * GB))
    assert collective_time_s("all_reduce", size, p, link) == pytest.approx(
        collective_time_s("reduce_scatter", size, p, link) + collective_time_s("all_gather", size, p, link))


def test_tree_and_broadcast_latency_terms():
    """Guards the log2 latency of tree all-reduce and binomial broadcast."""
    link = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e12)
    assert collective_time_s("all_reduce", 0, 64, link, "tree") == pytest.approx(2 * 6 * 1e-6)
    assert collective_time_s("all_reduce", 0, 64, link, "ring") == pytest.approx(2 * 63 * 1e-6)
    assert collective_time_s("broadcast", 1e9, 8, link, "tree") == pytest.approx(3 * (1e-6 + 1e-3))
    assert collective_time_s("broadcast", 1e9, 8, link, "ring") == pytest.approx(7e-6 + 1e-3)


def test_hierarchical_composition():
    """Guards the two-level all-reduce: RS in the node + AR of S/g across nodes + AG in the node,
    and that a group inside one node is the flat collective."""
    intra, inter = Link(latency_s=1e-6, bandwidth_bytes_per_s=450 * GB), Link(latency_s=5e-6,
                                                                               bandwidth_bytes_per_s=50 * GB)
    size, g, nodes = 1e9, 8, 4
    expected = (collective_time_s("reduce_scatter", size, g, intra)
                + collective_time_s("all_reduce", size / g, nodes, inter)
                + collective_time_s("all_gather", size, g, intra))
    assert hierarchical_time_s("all_reduce", size, g * nodes, g, intra, inter) == pytest.approx(expected)
    assert hierarchical_time_s("all_gather", size, 8, 8, intra, inter) == collective_time_s(
        "all_gather", size, 8, intra)
    flat_slow = collective_time_s("all_reduce", size, 32, inter)
    assert hierarchical_time_s("all_reduce", size, 32, 8, intra, inter) < flat_slow
    # 12 ranks on nodes of 8 (one full, one half): a ring over all 12 at the slower link's pace
    # (it was an error, and `perf train --devices 12` failed with it).
    assert hierarchical_time_s("all_reduce", size, 12, 8, intra, inter) == collective_time_s(
        "all_reduce", size, 12, inter)


def test_fit_recovers_alpha_and_beta():
    """Guards the least-squares fit: exact on noiseless alpha-beta data, busbw in GB/s."""
    alpha, bandwidth = 30e-6, 20 * GB
    sizes = [2**k for k in range(10, 28, 2)]
    times = [alpha + busbw_factor("all_reduce", 4) * s / bandwidth for s in sizes]
    fit = fit_alpha_beta("all_reduce", 4, sizes, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit.busbw_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    assert fit.max_relative_error < 1e-9
    assert fit.link().latency_s == pytest.approx(alpha / 6)  # 2 (p - 1) ring steps


def test_bad_arguments_are_value_errors():
    """Guards user errors: unknown collective or algorithm, non-positive ranks."""
    link = Link(latency_s=0, bandwidth_bytes_per_s=1)
    for args in (("gather", 1, 2, link), ("all_reduce", 1, 0, link)):
        with pytest.raises(ValueError):
            collective_time_s(*args)
    with pytest.raises(ValueError, match="unknown algorithm"):
        collective_time_s("all_reduce", 1, 2, link, "mesh")
    assert math.isclose(collective_time_s("all_reduce", 1e6, 1, link), 0.0)


@pytest.mark.slow
def test_gloo_measurement_fits(tmp_path):
    """Guards the torch.distributed benchmark end to end on 2 gloo processes (multi-process: slow)."""
    from slipstream.perf.collectives_bench import fit, measure

    timings, errors = measure(2, "gloo", sizes=[2**12, 2**18, 2**20], iterations=3)
    print(timings, errors)
    assert {t.collective for t in timings} >= {"all_reduce", "broadcast"}
    assert all(f.alpha_s >= 0 and f.beta_s_per_byte >= 0 for f in fit(timings))


def test_a_fit_without_bandwidth_says_so():
    """A noisy gloo pair (the 16x larger message measured faster) clamps beta to 0: the fit's busbw
    is None, not infinite, and it gives no link; one distinct size fixes no slope."""
    fit = fit_alpha_beta("all_reduce", 2, [65536, 1048576], [3.7e-3, 1.15e-3])
    assert fit.beta_s_per_byte == 0 and fit.busbw_bytes_per_s is None
    with pytest.raises(ValueError, match="found no bandwidth term"):
        fit.link()
    with pytest.raises(ValueError, match="at least two distinct sizes"):
        fit_alpha_beta("all_reduce", 2, [1024, 1024], [1e-4, 2e-4])
    good = fit_alpha_beta("all_reduce", 2, [1024, 2048], [1e-4, 2e-4])
    assert good.busbw_bytes_per_s == pytest.approx(1 / good.beta_s_per_byte)


def test_a_measured_cost_prices_its_fit_over_the_link():
    """Guards `MeasuredCost` against hand formulas: an all-gather fitted at 290 us + bus bytes / 0.8
    GB/s among 4 ranks, over a link of 50 us a step and 1 GB/s, is 5.8 steps and 0.8 of the link's
    bandwidth, and priced 290 us + 3/4 S / 0.8 GB/s (the ring: 3 x 50 us + 3/4 S / 1 GB/s); twice
    the link's bandwidth halves the bandwidth term; one rank costs nothing; a link without latency
    keeps the ring's steps; a fit without bandwidth or a negative or infinite cost is a ValueError."""
    link = Link(latency_s=50e-6, bandwidth_bytes_per_s=1 * GB)
    sizes = [4096, 2**20, 2**24]
    fit = fit_alpha_beta("all_gather", 4, sizes, [290e-6 + 0.75 * s / (0.8 * GB) for s in sizes])
    cost = fit.cost(link)
    assert (cost.latency_steps, cost.bandwidth_share) == (pytest.approx(5.8), pytest.approx(0.8))
    size = 3e6
    assert collective_time_s("all_gather", size, 4, link, measured=cost) == pytest.approx(
        290e-6 + 0.75 * size / (0.8 * GB))
    assert collective_time_s("all_gather", size, 4, link) == pytest.approx(3 * 50e-6 + 0.75 * size / GB)
    fast = Link(latency_s=50e-6, bandwidth_bytes_per_s=2 * GB)
    assert collective_time_s("all_gather", size, 4, fast, measured=cost) == pytest.approx(
        290e-6 + 0.75 * size / (1.6 * GB))
    assert collective_time_s("all_gather", size, 1, link, measured=cost) == 0.0
    assert fit.cost(Link(latency_s=0, bandwidth_bytes_per_s=GB)).latency_steps == 3
    with pytest.raises(ValueError, match="found no bandwidth term"):
        fit_alpha_beta("all_gather", 2, [65536, 1048576], [3.7e-3, 1.15e-3]).cost(link)
    for steps, share in ((-1.0, 1.0), (1.0, 0.0), (math.inf, 1.0), (1.0, math.nan)):
        with pytest.raises(ValueError, match="need latency_steps >= 0 and bandwidth_share > 0"):
            MeasuredCost(steps, share)
