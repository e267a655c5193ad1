"""The error a quantized KV cache costs: each format x granularity against the unquantized cache.

A property of the format, not of a backend: K and V are quantized with ``jaxattn.quantize_kv``,
dequantized in float64, and a decode step's attention over them is compared, in float64 (the
oracle of ``jaxattn.testing``), with attention over the float cache. The cache: normal values
whose KV heads differ in magnitude (gains log-uniform in [1/4, 4], as trained models' heads do),
plus, per token, a few outlier channels at 8x; queries normal. docs/serving.md shows the table
(tests/serving/test_docs.py checks it is this script's output)::

    python benchmarks/quantized_kv_error.py
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn.backend.quantize import GRANULARITIES
from jaxattn.testing import oracle

FORMATS = ("int8", "float8_e4m3fn", "float8_e5m2")


def cache(rng: np.random.Generator, b: int, s: int, hkv: int, d: int) -> np.ndarray:
    gains = np.exp(rng.uniform(np.log(0.25), np.log(4.0), size=(1, 1, hkv, 1)))
    x = rng.normal(size=(b, s, hkv, d)) * gains
    outliers = rng.random(size=(b, s, hkv, d)) < 2 / d  # about two channels per token at 8x
    return np.where(outliers, 8 * x, x).astype(np.float32)


def rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def measure(b: int = 2, s: int = 1024, hq: int = 32, hkv: int = 8, d: int = 128, seed: int = 0) -> list[dict[str, str]]:
    """One row per format x granularity: the cache's and the attention output's relative RMS error
    and the output's largest relative error (to the output's RMS)."""
    rng = np.random.default_rng(seed)
    k, v = cache(rng, b, s, hkv, d), cache(rng, b, s, hkv, d)
    q = rng.normal(size=(b, 1, hq, d)).astype(np.float32)
    exact = oracle.attention(q, k, v).output
    rows = []
    for fmt in FORMATS:
        for gran in GRANULARITIES:
            deq = []
            for x in (k, v):
                values, scale = jaxattn.quantize_kv(jnp.asarray(x), fmt, gran)
                deq.append(np.asarray(values).astype(np.float64) * np.asarray(scale, np.float64)[..., None])
            out = oracle.attention(q, deq[0], deq[1]).output
            worst = float(np.abs(out - exact).max() / np.sqrt(np.mean(exact**2)))
            rows.append({"format": fmt, "scale": gran, "K, V rel. RMS": f"{rel_rms(deq[0], k):.1e}, "
                         f"{rel_rms(deq[1], v):.1e}", "output rel. RMS": f"{rel_rms(out, exact):.1e}",
                         "output max / RMS": f"{worst:.1e}"})
    return rows


def markdown(rows: list[dict[str, str]]) -> str:
    heads = list(rows[0])
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(r[h] for h in heads) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1024, help="cached tokens per sequence (default 1024)")
    args = parser.parse_args()
    print(markdown(measure(s=args.seq)))


if __name__ == "__main__":
    main()
