"""What a logits soft cap costs each GPU backend that takes one, beside cuDNN without it (H100/H200).

    PYTHONUNBUFFERED=1 python3 benchmarks/soft_cap_bench.py [--cap 30] [--iters 20] [--reps 5]

Through the public API (``jaxattn.attention`` with ``impl=``), bf16, D = 128, B x S x 32 heads
(GQA 1): ``mosaic_flash`` with and without the cap, ``flash_attn2`` (Triton) with it, and cuDNN
without it (cuDNN takes no cap: the reference of the same process). Forward and forward +
backward (a loss through the output), each jitted, warmed up, run ``iters`` times back to back
and blocked on the last; the best of ``reps`` (ms per call). Prints a markdown table and each
time's ratio to cuDNN's (above 1: faster than cuDNN's uncapped call).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxattn

SHAPES = [(4, 4096, False), (4, 4096, True), (1, 16384, False), (1, 16384, True)]  # (B, S, causal)
RUNS = [("cudnn", None), ("mosaic_flash", None), ("mosaic_flash", "cap"), ("flash_attn2", "cap")]


def _best_ms(fn: Callable[..., Any], args: tuple[Any, ...], iters: int, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters - 1):
            fn(*args)
        jax.block_until_ready(fn(*args))
        best = min(best, (time.perf_counter() - start) / iters * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap", type=float, default=30.0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, soft cap {args.cap}")
    print("| B, S, causal | " + " | ".join(f"{n}{' capped' if c else ''} fwd / fwd+bwd" for n, c in RUNS) + " |")
    print("|---" * (len(RUNS) + 1) + "|")
    for b, s, causal in SHAPES:
        key = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(kk, (b, s, 32, 128), jnp.bfloat16) for kk in key)
        cells, base = [], (0.0, 0.0)
        for name, cap in RUNS:
            kw: dict[str, Any] = {"causal": causal, "impl": name}
            if cap:
                kw["logits_soft_cap"] = args.cap

            def fwd(q: Any, k: Any, v: Any, kw: dict[str, Any] = kw) -> Any:
                return jaxattn.attention(q, k, v, **kw)

            def loss(q: Any, k: Any, v: Any, kw: dict[str, Any] = kw) -> Any:
                return jaxattn.attention(q, k, v, **kw).astype(jnp.float32).sum()

            try:
                times = (_best_ms(jax.jit(fwd), (q, k, v), args.iters, args.reps),
                         _best_ms(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v), args.iters, args.reps))
            except jaxattn.UnsupportedError as err:
                cells.append(f"declined: {err.reasons[0][:40]}")
                continue
            if name == "cudnn":
                base = times
            cells.append(" / ".join(f"{t:.3f} ({base[i] / t:.2f}x)" for i, t in enumerate(times)))
        print(f"| {b}, {s}, {'causal' if causal else 'full'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
