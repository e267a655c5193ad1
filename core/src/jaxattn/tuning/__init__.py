"""Measured ranking for "auto": what the selection layer reads of the tuning cache.

``jaxattn.dispatch`` ranks with :func:`refine` and forgets its choices when the cache changes
(:func:`on_reload`). The reading side lives here (``cache``: the file, ``keys``: what a
measurement is valid for, ``refiner``: the ranking); measuring and writing is the
``jaxattn-bench`` distribution's (``jaxattn tune``, ``jaxattn_bench.store``), so selection
imports no tooling. Importing this package loads no jax.
"""

from __future__ import annotations

from .cache import on_reload
from .refiner import refine

__all__ = ["on_reload", "refine"]
