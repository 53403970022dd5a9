"""Comparing a chip type's tensors with the reference's: metrics, tolerances, the ratio rule.

Every comparison is of one tensor against the float64 reference (numpy, on the host):

- ``cosine``: cosine similarity of the flattened tensors (1 when both are zero);
- ``max_abs``, ``max_rel``: largest absolute and element-wise relative error
  (relative to ``|ref|``, elements where ``ref == 0`` count as relative error 0 if the chip
  is 0 too, else infinite);
- ``rel_l2``: ``||chip - ref|| / ||ref||`` -- the scale-free error the gates use;
- ``beyond``: share of elements whose relative error exceeds 1e-2, 1e-3 and 1e-4;
- ``nonfinite_mismatch``: elements that are inf/nan in one and not the other (or a
  different inf/nan).

Gates (``status``): an op is ``pass`` when its rel L2 error is within the tolerance of its
dtype (torch.testing's rtol: fp32 1.3e-6, bf16 1.6e-2, fp16 1e-3; per-primitive
overrides), whatever else happens. Beyond that, msprobe's rule against a baseline that saw
the same inputs and the same reference -- the host computing in the program's own dtype,
or chip A when chip B is compared with it: error ratio <= 1 pass, <= 2 warn, > 2 fail.
An op whose finite/non-finite pattern differs from the reference fails outright.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

DTYPE_RTOL = {"float32": 1.3e-6, "bfloat16": 1.6e-2, "float16": 1e-3, "float64": 1e-7}
"""Default tolerance on an op's relative L2 error, by the dtype of its output (torch.testing's rtol)."""
THRESHOLDS = (1e-2, 1e-3, 1e-4)
RATIO_PASS, RATIO_WARN = 1.0, 2.0
_TINY = 1e-300


@dataclass(frozen=True)
class Metrics:
    """One tensor of a chip type against the same tensor of the reference."""

    cosine: float
    max_abs: float
    max_rel: float
    rel_l2: float
    beyond: tuple[float, float, float]  # share of elements with rel error > 1e-2, 1e-3, 1e-4
    nonfinite_mismatch: int
    size: int

    def to_dict(self) -> dict:
        return asdict(self)


def _sumsq(x: np.ndarray) -> float:
    # np.sum, not np.linalg.norm: BLAS threads stall when the host's cores are shared
    return float(np.sum(np.square(x)))


def compare(chip: np.ndarray, ref: np.ndarray) -> Metrics:
    """Metrics of ``chip`` against ``ref`` (same shape; compared in float64)."""
    c = np.asarray(chip, dtype=np.float64).ravel()
    r = np.asarray(ref, dtype=np.float64).ravel()
    if c.shape != r.shape:
        raise ValueError(f"shape mismatch: chip {np.shape(chip)} vs reference {np.shape(ref)}")
    size = int(c.size)
    mismatch = 0
    if not (np.isfinite(np.sum(c)) and np.isfinite(np.sum(r))):  # cheap test first: all finite is the rule
        fin_c, fin_r = np.isfinite(c), np.isfinite(r)
        both = fin_c & fin_r
        # the same non-finite value (inf and inf, nan and nan) is a match
        same_nonfinite = ~fin_c & ~fin_r & ((c == r) | (np.isnan(c) & np.isnan(r)))
        mismatch = int(np.count_nonzero(~both & ~same_nonfinite))
        c, r = c[both], r[both]
    if c.size == 0:
        return Metrics(1.0, 0.0, 0.0, 0.0, (0.0, 0.0, 0.0), mismatch, size)
    d = c - r
    absd, absr = np.abs(d), np.abs(r)
    # rel > t  <=>  |d| > t |r|  (and where r == 0: any d != 0 is infinitely wrong)
    beyond = tuple(float(np.count_nonzero(absd > t * absr)) / c.size for t in THRESHOLDS)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = absd / absr
    rel[absd == 0] = 0.0
    ss_r, ss_c, ss_d = _sumsq(r), _sumsq(c), _sumsq(d)
    if ss_r == 0:
        rel_l2 = 0.0 if ss_d == 0 else math.inf
    else:
        rel_l2 = math.sqrt(ss_d / ss_r)
    if ss_r == 0 and ss_c == 0:
        cosine = 1.0
    elif ss_r == 0 or ss_c == 0:
        cosine = 0.0
    else:
        cosine = float(np.sum(c * r)) / math.sqrt(ss_c * ss_r)
    return Metrics(
        cosine=cosine,
        max_abs=float(absd.max()),
        max_rel=float(rel.max()),
        rel_l2=rel_l2,
        beyond=beyond,  # type: ignore[arg-type]
        nonfinite_mismatch=mismatch,
        size=size,
    )


def compare_exact(chip: np.ndarray, ref: np.ndarray) -> Metrics:
    """Integer and boolean tensors: every element must be equal (rel_l2 is the share that differ)."""
    c, r = np.asarray(chip).ravel(), np.asarray(ref).ravel()
    wrong = float(np.mean(c != r)) if c.size else 0.0
    return Metrics(1.0 if wrong == 0 else 0.0, float(wrong > 0), float(wrong > 0), wrong, (wrong,) * 3, 0, c.size)


def tolerance(dtype: str, primitive: str, overrides: Mapping[str, float] | None = None) -> float:
    """The rel L2 tolerance of an op: a per-primitive override, else its output dtype's default."""
    if overrides and primitive in overrides:
        return float(overrides[primitive])
    return DTYPE_RTOL.get(dtype, DTYPE_RTOL["float32"])


def ratio(err: float, baseline: float, *, floor: float) -> float:
    """``err / baseline`` with both floored at ``floor`` (errors below it are noise, not signal)."""
    return max(err, floor) / max(baseline, floor)


def ratio_status(r: float) -> str:
    """msprobe's rule: <= 1 pass, <= 2 warn, > 2 fail."""
    if r <= RATIO_PASS:
        return "pass"
    return "warn" if r <= RATIO_WARN else "fail"


def op_status(m: Metrics, baseline: Metrics | None, tol: float) -> tuple[str, float]:
    """(status, error ratio against the baseline) of one op's comparison."""
    if m.nonfinite_mismatch:
        return "fail", math.inf
    base = baseline.rel_l2 if baseline is not None else 0.0
    # below a hundredth of the tolerance both errors are rounding noise of the dtype: ratio 1
    r = ratio(m.rel_l2, base, floor=tol / 100)
    if m.rel_l2 <= tol:
        return "pass", r
    return ratio_status(r), r


STATUS_ORDER = {"pass": 0, "warn": 1, "fail": 2}


def worst(statuses: list[str]) -> str:
    return max(statuses, key=STATUS_ORDER.__getitem__, default="pass")
