"""Registration module that fails on import, like a plugin whose compiled kernel is missing.

The wheel deliberately ships no ``_kernels`` module, so importing this raises
``ImportError: cannot import name '_kernels' from 'jaxattn_broken'``.
"""

from __future__ import annotations

from jaxattn_broken import _kernels  # type: ignore[attr-defined]

__all__ = ["_kernels"]
