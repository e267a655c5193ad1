"""Testing tools for jaxattn and for third-party backends.

* ``jaxattn.testing.oracle``: a float64 NumPy reference of the attention contract,
  forward and backward, that imports no jax (it must not share code with what it checks).
* ``jaxattn.testing.conformance``: a pytest suite any backend runs against itself
  (imported on demand: it needs pytest and jax).
"""

from __future__ import annotations

from jaxattn.testing import oracle

__all__ = ["oracle"]
