"""Dtype names without importing jax: dtypes travel through jaxattn as canonical strings."""

from __future__ import annotations

from typing import Any

__all__ = ["dtype_name"]

_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def dtype_name(dtype: Any) -> str:
    """Return the canonical name ("bfloat16", "float32", ...) of a dtype, dtype name or scalar type."""
    if isinstance(dtype, str):
        return _ALIASES.get(dtype.lower(), dtype.lower())
    name = getattr(dtype, "name", None)  # numpy dtypes, including ml_dtypes' bfloat16 dtype
    if isinstance(name, str) and not isinstance(dtype, type):
        return name
    import numpy as np

    try:
        return str(np.dtype(dtype).name)
    except TypeError:
        import ml_dtypes  # noqa: F401  # registers bfloat16 & friends with numpy

        return str(np.dtype(dtype).name)
