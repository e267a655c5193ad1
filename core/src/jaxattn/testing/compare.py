"""Comparison of a backend's arrays with the float64 oracle, with messages that locate the error."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .cases import Tolerance

__all__ = ["assert_close", "to_float64"]


def to_float64(x: Any) -> npt.NDArray[np.float64]:
    """A jax/NumPy array (bfloat16 included) as float64 NumPy."""
    return np.asarray(np.asarray(x).astype(np.float64), dtype=np.float64)


def assert_close(label: str, actual: Any, expected: npt.NDArray[np.float64], tol: Tolerance) -> None:
    """Fail unless ``actual`` matches ``expected`` elementwise within ``tol`` (see ``Tolerance``).

    Infinities in ``expected`` (``-inf`` log-sum-exp of empty rows) must be matched exactly;
    a NaN or infinity in ``actual`` where ``expected`` is finite always fails.
    """
    got = to_float64(actual)
    if got.shape != expected.shape:
        raise AssertionError(f"{label}: shape {got.shape}, expected {expected.shape}")
    finite = np.isfinite(expected)
    if not np.array_equal(got[~finite], expected[~finite]):
        idx = tuple(int(i) for i in np.argwhere((got != expected) & ~finite)[0])
        raise AssertionError(f"{label}: expected {expected[idx]} at {idx}, got {got[idx]}")
    bad_values = finite & ~np.isfinite(got)
    if bad_values.any():
        idx = tuple(int(i) for i in np.argwhere(bad_values)[0])
        raise AssertionError(
            f"{label}: {int(bad_values.sum())} non-finite values where the oracle is finite, "
            f"first at {idx}: {got[idx]} (expected {expected[idx]})"
        )
    exp = np.where(finite, expected, 0.0)
    err = np.abs(np.where(finite, got, 0.0) - exp)
    scale = max(1.0, float(np.abs(exp).max(initial=0.0)))
    bound = tol.atol * scale + tol.rtol * np.abs(exp)
    over = err > bound
    if over.any():
        worst = np.unravel_index(int(np.argmax(err - bound)), err.shape)
        idx = tuple(int(i) for i in worst)
        raise AssertionError(
            f"{label}: {int(over.sum())} of {err.size} values off by more than "
            f"atol={tol.atol}*{scale:.3g} + rtol={tol.rtol}*|expected|; worst at {idx}: "
            f"got {got[idx]:.6g}, expected {expected[idx]:.6g} (max abs error {err.max():.3g})"
        )
