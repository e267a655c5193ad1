"""Registration module: the target of this distribution's ``jaxattn.plugins`` entry point.

The seed's way: the hook returns the impl class itself, so discovery imports ``impl.py`` (and
jax with it). An ``ImplRef`` would let ``jaxattn list`` show the impl without that import.
"""

from __future__ import annotations

from typing import Any

from jaxattn.backend import hookimpl

__all__ = ["jaxattn_register_impls"]


@hookimpl
def jaxattn_register_impls() -> list[Any]:
    from .impl import SeedAttention

    return [SeedAttention]
