"""What the public API adds around the Triton paged kernel: the compiled entry computation of
an int8 decode (16 sequences x 8k tokens, GQA 32/8, D 128, pages of 16, per-head scales)
called as ``paged_ops.paged_decode`` and as ``jaxattn.paged_attention``, each op of it, and
the µs per call of each (200 back-to-back calls, three times). Needs a CUDA GPU.

    python3 benchmarks/paged_api_hlo.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from paged_probe import HKV, HQ, D, api  # the public API's call, as paged_probe --gap makes it

import jaxattn
from jaxattn_triton.paged_ops import paged_decode

B, S, PS = 16, 8192, 16


def kernel(q: jax.Array, k: jax.Array, v: jax.Array, tb: jax.Array, n: jax.Array, ks: jax.Array,
           vs: jax.Array) -> jax.Array:  # fmt: skip
    out = paged_decode(q[:, None], k, v, tb, n, k_scale=ks, v_scale=vs)
    assert not isinstance(out, tuple)
    return out[:, 0]


def main() -> None:
    pages = B * S // PS
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, HQ, D)), jnp.bfloat16)
    k, ks = jaxattn.quantize_kv(jnp.asarray(rng.standard_normal((pages, PS, HKV, D)), jnp.bfloat16), "int8", "head")
    table = jnp.asarray(rng.permutation(pages).reshape(B, S // PS), jnp.int32)
    args = (q, k, k, table, jnp.full((B,), S, jnp.int32), ks, ks)
    for name, fn in (("paged_decode", kernel), ("paged_attention", api)):
        text = jax.jit(fn).lower(*args).compile().as_text()
        print(f"== {name}: the compiled entry's ops")
        for line in text[text.index("ENTRY"):].splitlines():
            if " = " in line and "parameter(" not in line:
                print("  " + line.strip()[:160])
        f = jax.jit(fn)
        f(*args).block_until_ready()
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(200):
                out = f(*args)
            out.block_until_ready()
            print(f"  {(time.perf_counter() - start) / 200 * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
