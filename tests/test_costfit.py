"""The cost fit (run/costfit.py): least squares with visible arithmetic, outliers left out."""

import numpy as np
import pytest

from kvmap.run.costfit import fit_line


def test_an_exact_line_is_recovered():
    x = np.array([1, 2, 3, 4], dtype=np.int32)
    y = 5.0 + 2.0 * x  # 7, 9, 11, 13
    f = fit_line(x, y)
    assert f["fixed"] == pytest.approx(5.0) and f["slope"] == pytest.approx(2.0)
    assert f["r2"] == pytest.approx(1.0) and f["steps"] == 4 and f["left_out"] == 0


def test_a_step_over_ten_medians_is_left_out():
    x = np.array([1, 2, 3, 4, 5], dtype=np.int32)
    y = np.array([7.0, 9.0, 11.0, 13.0, 10 * 11.0 + 1])  # median 11: the last is over 10 x 11
    f = fit_line(x, y)
    assert f["left_out"] == 1 and f["steps"] == 4
    assert f["fixed"] == pytest.approx(5.0) and f["slope"] == pytest.approx(2.0)


def test_the_fit_equals_numpys_least_squares():
    rng = np.random.default_rng(7)
    x = rng.integers(1, 500, 2000)
    y = 30.0 + 0.05 * x + rng.normal(0, 3, 2000)
    f = fit_line(x, y)
    a = np.column_stack([np.ones(len(x)), x.astype(np.float64)])
    (fixed, slope), *_ = np.linalg.lstsq(a, y, rcond=None)
    r2 = 1 - ((y - fixed - slope * x) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    assert f["fixed"] == pytest.approx(fixed, rel=1e-9) and f["slope"] == pytest.approx(slope, rel=1e-9)
    assert f["r2"] == pytest.approx(r2, rel=1e-9)


def test_no_spread_in_x_gives_the_mean_and_no_r2():
    f = fit_line(np.array([4, 4, 4]), np.array([1.0, 2.0, 3.0]))
    assert f == {"fixed": 2.0, "slope": 0.0, "r2": None, "steps": 3, "left_out": 0}


def test_nanoseconds_scaled_to_microseconds_over_several_chunks():
    from kvmap.run import costfit

    x = np.arange(1, 3 * costfit.CHUNK + 7, dtype=np.int32)  # more than three passes' worth of steps
    ns = (12_000 + 300 * x).astype(np.int64)  # 12 us + 0.3 us a token, in ns
    f = fit_line(x, ns, 1e3)
    assert f["fixed"] == pytest.approx(12.0) and f["slope"] == pytest.approx(0.3) and f["steps"] == len(x)
