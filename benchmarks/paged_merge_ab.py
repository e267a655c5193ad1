"""bf16 paged decode with key splits: the splits merged in the attention launch (``FUSE``, the
default) against the two launches (``JAXATTN_TRITON_FUSE=0``), in one process, beside cuDNN's
dense decode. GQA 32/8, D = 128, a random page order; three interleaved timings of each.

    python3 benchmarks/paged_merge_ab.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
import triton_paged_check as C

from jaxattn_triton import launch_paged as LP

SHAPES = ((1, 65536, 16), (2, 131072, 16), (4, 32768, 16), (4, 8192, 64), (8, 8192, 16), (8, 32768, 64))


def main() -> None:
    for batch, ctx, ps in SHAPES:
        dt = jnp.bfloat16
        q = jnp.asarray(np.random.default_rng(0).standard_normal((batch, 1, C.HQ, C.D)), dt)
        lens = jnp.full((batch,), ctx, jnp.int32)
        k, v, table = C.paged_cache(batch, ctx, ps, dt, 21)
        kd, vd = C.filled((batch, ctx, C.HKV, C.D), dt, 6), C.filled((batch, ctx, C.HKV, C.D), dt, 7)
        cudnn = C.time_fn(jax.jit(C.cudnn_decode), q, kd, vd, lens) * 1e6
        C.free(kd, vd)
        times: dict[str, list[float]] = {"1": [], "0": []}
        for fuse in ("1", "0") * 3:
            # The switch is read when the launch is built: a fresh jit traces it again.
            os.environ["JAXATTN_TRITON_FUSE"] = fuse
            fn = jax.jit(lambda q, k, v, t, n: C.paged_decode(q, k, v, t, n))
            times[fuse].append(C.time_fn(fn, q, k, v, table, lens) * 1e6)
        os.environ.pop("JAXATTN_TRITON_FUSE")
        splits = LP.default_tiles(C.decode_spec(batch, ctx, "bfloat16", k.shape[:3]), C._num_sms()).num_splits
        merged, two = min(times["1"]), min(times["0"])
        print(f"bf16 B={batch} ctx={ctx} ps={ps} splits={splits}: merged in the launch "
              f"{', '.join(f'{t:.1f}' for t in sorted(times['1']))} us, two launches "
              f"{', '.join(f'{t:.1f}' for t in sorted(times['0']))} us; two / merged {two / merged:.3f} (minima); "
              f"cuDNN {cudnn:.1f} us", flush=True)  # fmt: skip
        C.free(k, v)


if __name__ == "__main__":
    main()
