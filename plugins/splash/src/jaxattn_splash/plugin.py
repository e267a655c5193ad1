"""Entry-point module of jaxattn-splash: registers ``splash`` / ``blocksparse`` for TPU lazily.

Imports neither jax nor any Pallas module: the class (and the kernel behind it) load only
when ``splash`` is asked for on a TPU (or in interpret mode).
"""

from __future__ import annotations

from jaxattn.hookspecs import hookimpl
from jaxattn.registry import ImplRef

__all__ = ["SPLASH", "jaxattn_register_impls"]

# Must match SplashAttention's declarations; the registry checks it when the class loads.
SPLASH = ImplRef(
    "jaxattn_splash.impl:SplashAttention",
    names=("splash", "blocksparse"),
    platforms=("tpu",),
    priority=110,
    description="Pallas TPU splash attention (block-sparse: causal, windows, soft cap, sinks)",
)


@hookimpl
def jaxattn_register_impls() -> list[ImplRef]:
    return [SPLASH]
