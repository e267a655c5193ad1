"""Tree-verification step vs a chain of the same length, on the Triton ragged paged kernel.

A speculative step verifies ``--drafts`` draft tokens (default 16) per sequence over a paged
cache of ``--context`` tokens (default 32k, the drafts included; GQA 32/8, D 128, bf16, pages of
16 in a random order): as a **tree** (each draft sees the cache and its ancestors in a binary
draft tree, ``ragged_paged_attention(..., mask_mod=)``) and as a **chain** (the same tokens,
causal, no mask_mod). Both through ``jaxattn.ragged_paged_attention`` under ``jax.jit``, the
mask_mod's arrays traced (so its packed bits are built in every call, as a model's layer
would). Also timed: the chain given as a mask_mod (the bits path alone), and building the bits
alone. Prints us per call and the ratio tree / chain (issue 50's target: at most 1.1x).

``--layers N`` times a step of N layers in one ``jax.jit`` program, each layer's queries the
previous layer's output, over the same cache: a model's step, whose layers share one tree mask
(the bits are built from the same arrays in every layer, and XLA computes them once). It prints
a layer's share of the step. ``--scan`` runs the layers as one ``jax.lax.scan`` instead of
unrolled (as models that scan over their layers do). ``--splits N`` also times the chain and the
tree (bits built once) at N key splits through ``paged.ops`` (the kernel's default: its own count).

On the GPU machine, from the repository root:

    python3 plugins/triton/benchmarks/tree_mask_bench.py [--seqs 1] [--context 32768] [--json OUT]

``--impl vanilla_paged --context 512`` runs the same script on a CPU (plumbing only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "core" / "src"))
sys.path.insert(0, str(ROOT / "plugins" / "bench" / "src"))
sys.path.insert(0, str(ROOT / "plugins" / "triton" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxattn  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16


def ancestors(parents: list[int]) -> np.ndarray:
    size = len(parents)
    out = np.zeros((size, size), bool)
    for i in range(size):
        node = i
        while node >= 0:
            out[i, node] = True
            node = parents[node]
    return out


def tree_mod(anc: Any, start: Any) -> Any:
    """Draft token i sees the cache before ``start[seq]`` and its ancestors ``anc[seq, i]``."""
    size = anc.shape[-1]

    def mask_mod(seq: Any, h: Any, q_pos: Any, kv_pos: Any) -> Any:
        first = start[seq]
        i, j = jnp.clip(q_pos - first, 0, size - 1), jnp.clip(kv_pos - first, 0, size - 1)
        return (kv_pos < first) | anc[seq, i, j]

    return mask_mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--context", type=int, default=32768, help="tokens per sequence, the drafts included")
    ap.add_argument("--drafts", type=int, default=16)
    ap.add_argument("--impl", default="ragged_page_attention_v3")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=1, help="layers of one step in one jax.jit program")
    ap.add_argument("--scan", action="store_true", help="the layers as a jax.lax.scan, not unrolled")
    ap.add_argument("--splits", type=int, default=0, help="also time chain and tree at this many key splits")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.layers < 1:
        ap.error(f"--layers: must be at least 1, got {a.layers}")
    if a.splits < 0 or (a.splits and a.impl == "vanilla_paged"):
        ap.error(f"--splits: a count >= 1 for the Triton kernel, got {a.splits} with --impl {a.impl}")
    from triton_measure import time_jax

    b, t, ctx = a.seqs, a.drafts, a.context
    pages_per_seq = -(-ctx // PAGE)
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.permutation(b * pages_per_seq).reshape(b, pages_per_seq), jnp.int32)
    key = jax.random.split(jax.random.key(0), 3)
    dt = jnp.bfloat16
    q = jax.random.normal(key[0], (b * t, HQ, D), dt)
    k_pages = jax.random.normal(key[1], (b * pages_per_seq, PAGE, HKV, D), dt)
    v_pages = jax.random.normal(key[2], (b * pages_per_seq, PAGE, HKV, D), dt)
    lengths = jnp.full((b,), ctx, jnp.int32)
    cu = jnp.arange(b + 1, dtype=jnp.int32) * t
    parents = [-1] + [(i - 1) // 2 for i in range(1, t)]  # a binary draft tree
    tree = jnp.asarray(np.broadcast_to(ancestors(parents), (b, t, t)))
    chain = jnp.asarray(np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t)))
    start = lengths - t

    def step(layer: Any, q: Any) -> Any:
        """``a.layers`` applications of ``layer(q) -> q``: unrolled, or one scan (--scan)."""
        if a.scan:
            return jax.lax.scan(lambda x, _: (layer(x).astype(x.dtype), None), q, None, length=a.layers)[0]
        for _ in range(a.layers):
            q = layer(q).astype(q.dtype)
        return q

    @jax.jit
    def with_mask(q: Any, kp: Any, vp: Any, anc: Any, first: Any) -> Any:
        return step(lambda x: jaxattn.ragged_paged_attention(x, kp, vp, table, lengths, cu, b, impl=a.impl,
                                                             mask_mod=tree_mod(anc, first)), q)  # fmt: skip

    @jax.jit
    def plain(q: Any, kp: Any, vp: Any) -> Any:
        return step(lambda x: jaxattn.ragged_paged_attention(x, kp, vp, table, lengths, cu, b, impl=a.impl), q)

    # The chain as a mask_mod is plain causal: the two paths agree.
    got, want = with_mask(q, k_pages, v_pages, chain, start), plain(q, k_pages, v_pages)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    assert err < 2e-2, f"the chain as a mask_mod differs from plain causal by {err}"
    layers = a.layers
    rows: dict[str, float] = {
        "chain (causal, no mask_mod)": time_jax(plain, q, k_pages, v_pages, reps=a.reps) / layers,
        "tree (mask_mod)": time_jax(with_mask, q, k_pages, v_pages, tree, start, reps=a.reps) / layers,
        "chain as a mask_mod": time_jax(with_mask, q, k_pages, v_pages, chain, start, reps=a.reps) / layers,
    }
    if a.impl != "vanilla_paged":
        from jaxattn_triton.paged.ops import ragged_paged
        from jaxattn_triton.paged.visibility import visibility_words

        ns = jnp.asarray([b], jnp.int32)
        capacity = pages_per_seq * PAGE

        def prebuilt_at(splits: int | None) -> Any:
            """The step with the bits built once for its layers, each layer's kernel reading them
            (``splits``: the kernel's key splits, None its own count)."""

            @jax.jit
            def run(q: Any, kp: Any, vp: Any, anc: Any, first: Any) -> Any:
                mod = tree_mod(anc, first)
                vis = visibility_words(mod, b * t, HQ, lengths, cu, ns, capacity)
                return step(lambda x: ragged_paged(x, kp, vp, table, lengths, cu, ns, mask_mod=mod, visibility=vis,
                                                   num_splits=splits), q)  # fmt: skip

            return run

        prebuilt = prebuilt_at(None)
        err = float(jnp.max(jnp.abs(prebuilt(q, k_pages, v_pages, tree, start).astype(jnp.float32)
                                    - with_mask(q, k_pages, v_pages, tree, start).astype(jnp.float32))))
        assert err < 2e-2, f"the tree with its bits built once differs by {err}"
        rows["tree, bits built once a step"] = time_jax(prebuilt, q, k_pages, v_pages, tree, start,
                                                        reps=a.reps) / layers
        bits = jax.jit(lambda anc, first: visibility_words(tree_mod(anc, first), b * t, HQ, lengths, cu, ns, capacity))
        rows["building the bits alone"] = time_jax(bits, tree, start, reps=a.reps)
        if a.splits:
            split = f"at {a.splits} splits"

            @jax.jit
            def chain_at(q: Any, kp: Any, vp: Any) -> Any:
                return step(lambda x: ragged_paged(x, kp, vp, table, lengths, cu, ns, num_splits=a.splits), q)

            rows[f"chain {split}"] = time_jax(chain_at, q, k_pages, v_pages, reps=a.reps) / layers
            rows[f"tree {split}, bits built once"] = time_jax(prebuilt_at(a.splits), q, k_pages, v_pages, tree,
                                                              start, reps=a.reps) / layers
    device = jax.devices()[0].device_kind
    print(f"{device}: {b} sequence(s) x {t} draft tokens over {ctx} tokens, GQA {HQ}/{HKV}, D {D}, bf16, "
          f"pages of {PAGE}, impl {a.impl}, {layers} layer(s) a program{' (scanned)' if a.scan else ''} "
          "(us: a layer's share)")
    for name, sec in rows.items():
        print(f"  {name:32s} {sec * 1e6:9.1f} us")
    ratio = rows["tree (mask_mod)"] / rows["chain (causal, no mask_mod)"]
    print(f"  tree / chain: {ratio:.3f}x (target <= 1.1x)")
    if a.splits:
        at = rows[f"tree at {a.splits} splits, bits built once"] / rows[f"chain at {a.splits} splits"]
        print(f"  at {a.splits} splits, tree / chain: {at:.3f}x")
    if a.json:
        a.json.write_text(json.dumps({"device": device, "seqs": b, "drafts": t, "context": ctx, "impl": a.impl,
                                      "layers": layers, "scan": a.scan, "us": {n: s * 1e6 for n, s in rows.items()},
                                      "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
