"""Where a mask_mod's time goes in mosaic_flash's kernels, and what a persistent forward saves
(H100/H200).

    PYTHONUNBUFFERED=1 python3 plugins/mosaic/benchmarks/mod_tiles_bench.py [--tokens 16384] [--iters 20] [--reps 5]
    python3 plugins/mosaic/benchmarks/mod_tiles_bench.py --smoke   # CPU: the rows' arithmetic only, no kernel

The kernels themselves (``mosaic_attention_forward`` and ``mosaic_attention_backward``), bf16,
D = 128, one sequence of ``--tokens`` tokens, 32 heads, for each mask (8 documents causal in
each, a prefix of a quarter of the tokens, chunks of 1,024; the bits built once, outside the
timed call) and the plain causal kernel beside them, over the tokens and over 8 sequences of an
eighth of them (the documents' visible pairs as a batch): the forward with ``mod_config``'s tiles
one CTA per tile, the same tiles persistent (one CTA per SM looping over them; ``+q``: two Q
slots per consumer), the causal kernel's default schedule, and the backward kernels (dQ, then
dK/dV). A forward that differs from the row's first says by how much. Each jitted, warmed up, run
``iters`` times back to back and blocked on the last; the best of ``reps``. TFLOP/s count the
visible pairs (forward ``4 * H * D * pairs``, backward 2.5 times that).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import masks

sys.path.insert(0, str(Path(__file__).parent))
from feature_bench import best_ms

HEADS, DIM = 32, 128


def mask_mods(tokens: int) -> dict[str, Any]:
    ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), tokens // 8)[None]
    return {
        "8 documents": masks.and_(masks.causal(), masks.document(ids, ids)),
        "prefix-LM": masks.prefix_lm(jnp.asarray([tokens // 4], jnp.int32)),
        "chunks of 1,024": masks.chunked_causal(1024),
    }


def visible_pairs(bits: Any) -> int:
    words = np.asarray(bits).view(np.uint8)
    return int(np.unpackbits(words).sum())


def tflops(pairs: int, ms: float, per: float = 1.0) -> float:
    return per * 4 * HEADS * DIM * pairs / ms / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="count the masks' pairs on a CPU; no kernel runs")
    args = parser.parse_args()
    t = args.tokens
    if args.smoke:
        for name, mask_mod in mask_mods(t).items():
            bits = masks.call_bits(mask_mod, None, 1, HEADS, t, t)
            print(f"{name}: {visible_pairs(bits) / int(bits.shape[1]) / (t * (t + 1) / 2):.3f} of causal's pairs")
        return

    from jaxattn_mosaic import backward_kernel as KB
    from jaxattn_mosaic import kernel as K
    from jaxattn_mosaic import mods

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {HEADS} heads, D {DIM}, bf16")
    scale = DIM ** -0.5
    tiles = K.mod_config(DIM)
    forwards = {"one CTA a tile": dataclasses.replace(tiles, persistent=False),
                "persistent": dataclasses.replace(tiles, persistent=True),
                "persistent +q": dataclasses.replace(tiles, persistent=True, q_double=True), "default": None}

    def inputs(batch: int, tokens: int) -> list[Any]:
        key = jax.random.split(jax.random.key(0), 4)
        return [jax.random.normal(kk, (batch, tokens, HEADS, DIM), jnp.bfloat16) for kk in key]

    print("| B x T | mask | " + " | ".join(f"fwd {n} ms (TFLOP/s)" for n in forwards) + " | bwd ms (TFLOP/s) |")
    print("|---" * (len(forwards) + 3) + "|")
    # (batch, tokens, the mask's name, its bits or None for causal): the plain causal kernel over
    # the tokens, each mask, and the documents' visible pairs as a batch of causal sequences.
    rows: list[tuple[int, int, str, Any]] = [(1, t, "causal", None)]
    rows += [(1, t, name, mods.call_bits(mm, None, batch=1, heads=HEADS, t_len=t, s_len=t, causal=False,
                                         window=(None, None))) for name, mm in mask_mods(t).items()]
    rows.append((8, t // 8, "causal", None))
    for batch, tokens, name, bits in rows:
        q, k, v, do = inputs(batch, tokens)
        causal = bits is None
        # Per head and sequence: the bits' heads dim is 1 where the mask_mod ignores h.
        pairs = batch * tokens * (tokens + 1) // 2 if causal else visible_pairs(bits) // int(bits.shape[1])
        cells = []
        out = lse = None
        for label, cfg in forwards.items():
            if label == "default" and not causal:  # a mask_mod's default tiles are the persistent column's
                cells.append("")
                continue

            def fwd(q: Any, k: Any, v: Any, bits: Any, cfg: Any = cfg, causal: bool = causal) -> Any:
                return K.mosaic_attention_forward(q, k, v, causal=causal, softmax_scale=scale, config=cfg, bits=bits)

            fn = jax.jit(fwd)
            got = fn(q, k, v, bits)
            # The same tiles' arithmetic in another order of tiles: the same numbers.
            diff = 0.0 if out is None else max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                                               for a, b in zip(got, (out, lse), strict=True))
            out, lse = got
            ms = best_ms(fn, (q, k, v, bits), args.iters, args.reps)
            cells.append(f"{ms:.3f} ({tflops(pairs, ms):.0f})" + (f", differs by {diff:.2g}" if diff else ""))

        def bwd(q: Any, k: Any, v: Any, out: Any, lse: Any, do: Any, bits: Any, causal: bool = causal) -> Any:
            return KB.mosaic_attention_backward(q, k, v, out, lse, do, None, causal=causal, softmax_scale=scale,
                                                bits=bits)

        ms = best_ms(jax.jit(bwd), (q, k, v, out, lse, do, bits), args.iters, args.reps)
        cells.append(f"{ms:.3f} ({tflops(pairs, ms, 2.5):.0f})")
        print(f"| {batch} x {tokens} | {name} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
