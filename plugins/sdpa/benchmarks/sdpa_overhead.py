#!/usr/bin/env python3
"""Does jaxattn's dispatch cost anything? ``impl="cudnn"`` against jax.nn's cuDNN, side by side.

    python3 plugins/sdpa/benchmarks/sdpa_overhead.py                      # on an NVIDIA GPU: cudnn vs jax.nn cudnn
    python3 plugins/sdpa/benchmarks/sdpa_overhead.py --impl sdpa --quick  # anywhere: sdpa vs jax.nn (smoke test)
    python3 plugins/sdpa/benchmarks/sdpa_overhead.py --json out.json

For each shape, causal or not, forward and forward+backward: both programs are compiled,
then timed alternately in one process (so drift hits both alike), median of ``--runs``.
Also reports whether the two compiled programs are the same HLO (they should be: dispatch
happens at trace time). TFLOP/s count 4*B*H*T*S*D forward, halved for causal, and 3.5x
that for forward+backward (the convention of CONTRIBUTING.md, "Measuring").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

import jaxattn

# (B, S, H, D) with T == S: the shapes of the D=128 flash-attention targets (docs/bench.md).
SHAPES = [(4, 4096, 32, 128), (1, 16384, 32, 128), (16, 1024, 32, 64)]
QUICK_SHAPES = [(1, 256, 4, 64), (2, 128, 8, 32)]


@dataclasses.dataclass
class Row:
    shape: tuple[int, int, int, int]
    causal: bool
    mode: str  # "fwd" or "fwd+bwd"
    ours_ms: float
    theirs_ms: float
    same_hlo: bool
    flops: float

    @property
    def ratio(self) -> float:
        return self.ours_ms / self.theirs_ms

    def tflops(self, ms: float) -> float:
        return self.flops / (ms * 1e-3) / 1e12


def canonical_hlo(text: str) -> str:
    """Compiled HLO without what names the caller (module name, op metadata, stack frames)."""
    text = text.split("\n\nFileNames", 1)[0]
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)


def flop_count(b: int, s: int, h: int, d: int, causal: bool, mode: str) -> float:
    fwd = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


Implementation = Literal["xla", "cudnn"] | None


def build(attend: Callable[..., jax.Array], mode: str) -> Any:
    """The jitted forward, or the jitted gradient of sum(output) (a ``jax.stages.Wrapped``)."""
    if mode == "fwd":
        return jax.jit(attend)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(attend(q, k, v).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def time_pair(fa: Callable[..., Any], fb: Callable[..., Any], args: tuple[jax.Array, ...],
              runs: int, warmup: int) -> tuple[float, float]:
    """Median milliseconds of fa and fb, timed alternately."""
    for _ in range(warmup):
        jax.block_until_ready(fa(*args))
        jax.block_until_ready(fb(*args))
    ta: list[float] = []
    tb: list[float] = []
    for i in range(runs):
        # Alternate which goes first, so neither always runs on a warmer device.
        order = ((fa, ta), (fb, tb)) if i % 2 == 0 else ((fb, tb), (fa, ta))
        for fn, samples in order:
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(ta), statistics.median(tb)


def measure(shape: tuple[int, int, int, int], causal: bool, mode: str, impl: str, implementation: Implementation,
            dtype: Any, runs: int, warmup: int) -> Row:
    b, s, h, d = shape
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (b, s, h, d), dtype) for key in keys)
    ours = build(lambda q, k, v: jaxattn.attention(q, k, v, impl=impl, causal=causal), mode)
    theirs = build(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                implementation=implementation), mode)
    same = canonical_hlo(ours.lower(q, k, v).compile().as_text()) == canonical_hlo(
        theirs.lower(q, k, v).compile().as_text())
    ours_ms, theirs_ms = time_pair(ours, theirs, (q, k, v), runs, warmup)
    return Row(shape, causal, mode, ours_ms, theirs_ms, same, flop_count(b, s, h, d, causal, mode))


def print_table(rows: list[Row], impl: str, implementation: Implementation) -> None:
    them = f"jax.nn({implementation or 'default'})"
    head = (f"{'B, S, H, D':<20} {'causal':<6} {'pass':<8} {'jaxattn ms':>11} {them + ' ms':>17} "
            f"{'ratio':>6} {'jaxattn TF/s':>13} {them + ' TF/s':>19} {'same HLO':>9}")
    print(f"jaxattn impl={impl!r} vs {them}; {jax.devices()[0].device_kind}; jax {jax.__version__}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{', '.join(map(str, r.shape)):<20} {'yes' if r.causal else 'no':<6} {r.mode:<8} "
              f"{r.ours_ms:>11.3f} {r.theirs_ms:>17.3f} {r.ratio:>6.3f} "
              f"{r.tflops(r.ours_ms):>13.1f} {r.tflops(r.theirs_ms):>19.1f} {'yes' if r.same_hlo else 'NO':>9}")
    ratios = [r.ratio for r in rows]
    print(f"ratio jaxattn / jax.nn: median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="cudnn", help="jaxattn impl to time (default: cudnn)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test on any host)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    on_cuda = jax.devices()[0].platform == "gpu"
    if args.impl == "cudnn" and not on_cuda:
        print("impl 'cudnn' needs an NVIDIA GPU; try --impl sdpa --quick here", file=sys.stderr)
        return 2
    # What jaxattn's impl runs: cudnn is cuDNN; sdpa is cuDNN on an NVIDIA GPU for 16-bit inputs.
    implementation: Implementation = "cudnn" if on_cuda and args.dtype in ("bfloat16", "float16") else None
    dtype = jnp.dtype(args.dtype)
    rows = [
        measure(shape, causal, mode, args.impl, implementation, dtype, args.runs, args.warmup)
        for shape in (QUICK_SHAPES if args.quick else SHAPES)
        for causal in (False, True)
        for mode in ("fwd", "fwd+bwd")
    ]
    print_table(rows, args.impl, implementation)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**dataclasses.asdict(r), "ratio": r.ratio, "tflops_jaxattn": r.tflops(r.ours_ms),
                        "tflops_jax_nn": r.tflops(r.theirs_ms)} for r in rows], f, indent=2)
    return 0 if all(r.same_hlo for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
