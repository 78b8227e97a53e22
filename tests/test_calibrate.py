"""The calibration's fit (runtime.calibrate.fit): what `stratum profile --detect` writes for a kernel family is
the latency and efficiency its nodes' times say. The measuring itself needs a GPU (BENCHMARKS.md)."""

import numpy as np
import pytest

from runtime.calibrate import fit


def test_fit_recovers_latency_and_efficiency(rng):
    efficiency, latency_s = rng.uniform(0.1, 0.95), rng.uniform(1e-6, 2e-5)
    rooflines = rng.uniform(1e-7, 3e-4, size=12)
    found = fit(rooflines, latency_s + rooflines / efficiency)
    assert found.efficiency == pytest.approx(efficiency, rel=1e-6)
    assert found.latency_s == pytest.approx(latency_s, rel=1e-6)


def test_fit_never_beats_the_roofline_or_goes_below_zero_latency(rng):
    rooflines = rng.uniform(1e-6, 1e-4, size=8)
    faster = fit(rooflines, 0.5 * rooflines + 3e-6)           # kernels "faster" than the roofline
    assert faster.efficiency == 1.0 and faster.latency_s >= 0
    scaled = fit(rooflines, rooflines / 0.25 - 1e-7)           # would need a negative latency
    assert scaled.latency_s == 0.0 and scaled.efficiency == pytest.approx(0.25, rel=0.05)
    assert np.isfinite(scaled.efficiency)
