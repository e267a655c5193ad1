"""Source locations: jaxattn's own frames are left out of those JAX records in programs.

JAX stamps every traced operation with the user frames that made it, and Pallas Mosaic GPU
writes them into the kernel it embeds in the program. Without this, the same kernel reached
by two routes through jaxattn (``impl="auto"`` or by name, differentiated through a split or
not) embeds different locations: a different program to XLA, a kernel compiled once per
route, and a benchmark that cannot tell it timed the same program twice. With jaxattn's
dispatch frames left out, locations name the caller's frames and the backend's own, which
are the same by every route. Tracebacks of exceptions are untouched.
"""

from __future__ import annotations

import functools
import os

__all__ = ["leave_dispatch_out_of_locations"]

#: This package's directory: the dispatch layer (plugins live in packages of their own).
DISPATCH_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@functools.cache
def leave_dispatch_out_of_locations() -> bool:
    """Register :data:`DISPATCH_DIR` with JAX as a library path (once); False where this jax
    has no ``jax.extend.source_info_util.register_exclusion``."""
    try:
        from jax.extend.source_info_util import register_exclusion
    except ImportError:
        return False
    register_exclusion(DISPATCH_DIR)
    return True
