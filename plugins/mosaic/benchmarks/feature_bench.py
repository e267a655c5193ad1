"""What a logits soft cap or a sliding window costs each GPU backend that takes one, beside cuDNN
(H100/H200).

    PYTHONUNBUFFERED=1 python3 plugins/mosaic/benchmarks/feature_bench.py --feature soft_cap [--cap 30]
    PYTHONUNBUFFERED=1 python3 plugins/mosaic/benchmarks/feature_bench.py --feature window [--window 1024]
    (both: [--iters 20] [--reps 5])

Through the public API (``jaxattn.attention`` with ``impl=``), bf16, D = 128, B x S x 32 heads
(GQA 1). ``soft_cap``: ``mosaic_flash`` with and without the cap, ``flash_attn2`` (Triton) with
it, and cuDNN without it (cuDNN takes no cap: the reference of the same process). ``window``:
cuDNN (the reference), ``mosaic_flash`` and ``flash_attn2`` with a sliding window of ``W`` keys
(``(W, 0)`` causal, ``(W, W)`` full), and ``mosaic_flash`` without it (what the window saves).
Forward and forward + backward (a loss through the output), each jitted, warmed up, run
``iters`` times back to back and blocked on the last; the best of ``reps`` (ms per call).
Prints a markdown table and each time's ratio to the reference's (above 1: faster).
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
#: Per feature: the runs (backend, with the feature), the first the reference.
RUNS = {
    "soft_cap": [("cudnn", False), ("mosaic_flash", False), ("mosaic_flash", True), ("flash_attn2", True)],
    "window": [("cudnn", True), ("mosaic_flash", False), ("mosaic_flash", True), ("flash_attn2", True)],
}


def best_ms(fn: Callable[..., Any], args: tuple[Any, ...], iters: int, reps: int) -> float:
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
    parser.add_argument("--feature", choices=sorted(RUNS), default="soft_cap")
    parser.add_argument("--cap", type=float, default=30.0)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    runs = RUNS[args.feature]
    said = f"soft cap {args.cap}" if args.feature == "soft_cap" else f"sliding window {args.window}"
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {said}")
    print("| B, S, mask | " + " | ".join(f"{n}{' with' if on else ''} fwd / fwd+bwd" for n, on in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for b, s, causal in SHAPES:
        key = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(kk, (b, s, 32, 128), jnp.bfloat16) for kk in key)
        cells, base = [], (0.0, 0.0)
        for name, on in runs:
            kw: dict[str, Any] = {"causal": causal, "impl": name}
            if on and args.feature == "soft_cap":
                kw["logits_soft_cap"] = args.cap
            if on and args.feature == "window":
                kw["sliding_window"] = (args.window, 0 if causal else args.window)

            def fwd(q: Any, k: Any, v: Any, kw: dict[str, Any] = kw) -> Any:
                return jaxattn.attention(q, k, v, **kw)

            def loss(q: Any, k: Any, v: Any, kw: dict[str, Any] = kw) -> Any:
                return jaxattn.attention(q, k, v, **kw).astype(jnp.float32).sum()

            try:
                times = (best_ms(jax.jit(fwd), (q, k, v), args.iters, args.reps),
                         best_ms(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v), args.iters, args.reps))
            except jaxattn.UnsupportedError as err:
                cells.append(f"declined: {err.reasons[0][:40]}")
                continue
            if (name, on) == runs[0]:
                base = times
            cells.append(" / ".join(f"{t:.3f} ({base[i] / t:.2f}x)" if base[i] else f"{t:.3f}"
                                    for i, t in enumerate(times)))
        print(f"| {b}, {s}, {'causal' if causal else 'full'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
