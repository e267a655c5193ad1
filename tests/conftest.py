"""Session-wide test settings.

Numerics tests compare against a float64 oracle with float32 tolerances; on GPUs and TPUs
XLA's default float32 matrix product is TF32 / bf16-pass, about 1e-3 off. Tests check the
math, so they run float32 products at full precision everywhere (users keep jax's default).
"""

from __future__ import annotations

import jax

jax.config.update("jax_default_matmul_precision", "highest")
