"""The comparison metrics and msprobe's ratio rule, on numbers worked by hand."""

import math

import numpy as np
import pytest

from h2jax.align._compare import compare, op_status, ratio_status, tolerance


def test_metrics_of_a_known_error():
    ref = np.array([1.0, -2.0, 4.0, 0.0])
    chip = np.array([1.001, -2.0, 4.0, 0.0])
    m = compare(chip, ref)
    assert m.max_abs == pytest.approx(1e-3)
    assert m.max_rel == pytest.approx(1e-3)
    assert m.rel_l2 == pytest.approx(1e-3 / math.sqrt(21))
    assert m.beyond == (0.0, 0.0, 0.25)  # one element of four beyond 1e-4 (exactly 1e-3 is not beyond 1e-3)
    assert m.cosine == pytest.approx(1.0, abs=1e-7) and m.cosine < 1.0
    assert m.nonfinite_mismatch == 0


def test_inf_and_nan_mismatches_are_counted_and_fail():
    ref = np.array([np.inf, np.nan, 1.0, -np.inf])
    chip = np.array([np.inf, np.nan, np.nan, 5.0])
    m = compare(chip, ref)
    assert m.nonfinite_mismatch == 2
    assert op_status(m, None, 1e-6)[0] == "fail"


def test_zero_reference():
    assert compare(np.zeros(3), np.zeros(3)).rel_l2 == 0.0
    m = compare(np.array([0.0, 1e-9]), np.zeros(2))
    assert math.isinf(m.rel_l2) and math.isinf(m.max_rel) and m.beyond == (0.5, 0.5, 0.5)


def test_ratio_rule():
    assert [ratio_status(r) for r in (0.5, 1.0, 1.5, 2.0, 2.01)] == ["pass", "pass", "warn", "warn", "fail"]
    base = compare(np.array([1.0 + 1e-5]), np.array([1.0]))
    worse = compare(np.array([1.0 + 3e-5]), np.array([1.0]))
    assert op_status(worse, base, 1.3e-6)[0] == "fail"  # 3x the baseline, beyond the fp32 tolerance
    assert op_status(worse, base, 1e-4)[0] == "pass"  # within a looser (per-primitive) tolerance
    assert op_status(base, worse, 1.3e-6)[0] == "pass"  # better than the baseline


def test_tolerances_by_dtype_and_primitive():
    assert tolerance("float32", "exp") == 1.3e-6
    assert tolerance("bfloat16", "exp") == 1.6e-2
    assert tolerance("float16", "exp") == 1e-3
    assert tolerance("float32", "exp", {"exp": 1e-5}) == 1e-5
