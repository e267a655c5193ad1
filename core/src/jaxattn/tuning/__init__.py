"""Measured ranking for "auto": the tuning cache, the rank refiner and the fwd/bwd split.

``jaxattn tune`` measures backends and stores the results (``jaxattn.tuning.cache``);
``jaxattn.dispatch`` loads :func:`jaxattn.tuning.refiner.refine` on its first "auto" choice.
Importing this package loads no jax: only the standard library and jaxattn's small modules.
"""

from __future__ import annotations

from .cache import (
    Measurement,
    TuningCache,
    TuningCacheError,
    TuningCacheWarning,
    active_cache,
    default_cache_path,
    reload,
)
from .keys import Environment, current_environment, problem_key, seq_bucket

__all__ = [
    "Environment",
    "Measurement",
    "TuningCache",
    "TuningCacheError",
    "TuningCacheWarning",
    "active_cache",
    "current_environment",
    "default_cache_path",
    "problem_key",
    "reload",
    "seq_bucket",
]
