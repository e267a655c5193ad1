"""The strict modes every conformance suite runs its backend under: JAX's own test harness runs
with rank promotion "raise", and users debug with NaN/Inf checks and jax's internal checks on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = ["STRICT_MODES"]

#: The modes, each a context manager of jax's config.
STRICT_MODES: dict[str, Callable[[], Any]] = {
    "rank_promotion_raise": lambda: jax.numpy_rank_promotion("raise"),
    "debug_infs": lambda: jax.debug_infs(True),
    "debug_nans": lambda: jax.debug_nans(True),
    "enable_checks": lambda: jax.enable_checks(True),
}
