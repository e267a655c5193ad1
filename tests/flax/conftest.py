from __future__ import annotations

from collections.abc import Iterator

import jax
import pytest


@pytest.fixture(autouse=True)
def _full_precision_matmuls() -> Iterator[None]:
    # The tests compare float32 results with a float64 oracle at 2e-5; GPUs would otherwise
    # run float32 matrix products in TF32.
    with jax.default_matmul_precision("highest"):
        yield
