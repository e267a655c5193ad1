"""``ragged_paged_attention(..., mask_mod=)`` on the Triton ragged kernel (``ragged_page_attention_v3``):
the mask_mod evaluated in JAX into packed visibility bits and key bounds (``paged.visibility``),
read by the kernel. Checked against the float64 oracle, per sequence, with the mask_mod evaluated
as the contract calls it (one query row at a time): the docs' tree example, a ragged batch mixing
a prefill chunk, a decode step and a tree step (``cu_q_lens`` zero-padded past ``num_seqs``,
padding rows), a mask_mod that uses ``h`` with a window, a soft cap and sinks, a quantized
cache, explicit tiles (decode programs, key splits, several KV heads a program). NaN sits in
every page and position no query may read. Eager and under ``jax.jit`` (the mask_mod's captured
arrays traced there). In the Triton interpreter on CPU; on an NVIDIA GPU (marked ``gpu``) the
registered kernel in bf16."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.testing import oracle

from ._env import ON_CUDA, needs_interpreter
from ._serving import LOG2_WARNING

pytestmark = pytest.mark.filterwarnings(LOG2_WARNING)

MaskMod = Callable[[Any, Any, Any, Any], Any]


def ancestors(parents: list[int], size: int) -> np.ndarray:
    """``(size, size)`` bool: ``[i, j]`` when draft token j is token i or one of its ancestors."""
    out = np.zeros((size, size), bool)
    for i in range(len(parents)):
        node = i
        while node >= 0:
            out[i, node] = True
            node = parents[node]
    return out


def tree_mod(anc: Any, start: Any, tree_seqs: Any) -> MaskMod:
    """Each draft token of a sequence in ``tree_seqs`` sees the cache before ``start[seq]`` and its
    ancestors (``anc (num_seqs, size, size)``); other sequences' rows see every key."""
    anc, start, tree_seqs = jnp.asarray(anc), jnp.asarray(start), jnp.asarray(tree_seqs)
    size = anc.shape[-1]

    def mask_mod(seq: Any, h: Any, q_pos: Any, kv_pos: Any) -> Any:
        first = start[seq]
        i, j = jnp.clip(q_pos - first, 0, size - 1), jnp.clip(kv_pos - first, 0, size - 1)
        return ~tree_seqs[seq] | (kv_pos < first) | anc[seq, i, j]

    return mask_mod


def expected(c: dict[str, np.ndarray], mask_mod: MaskMod, num_seqs: int, *, window: int | None = None,
             cap: float | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """The float64 oracle per sequence, ``mask_mod`` evaluated row by row as the contract calls it."""
    q, kp, vp, table, lengths, cu = (c[n] for n in ("q", "k_pages", "v_pages", "page_table", "kv_lengths", "cu_q_lens"))
    page, hq = kp.shape[1], q.shape[1]
    out = np.zeros((q.shape[0], hq, vp.shape[-1]))
    heads = jnp.arange(hq, dtype=jnp.int32).reshape(1, hq, 1)
    for s in range(num_seqs):
        n, t = int(lengths[s]), int(cu[s + 1] - cu[s])
        if t == 0 or n == 0:
            continue
        pages = table[s, : -(-n // page)]
        k = kp[pages].reshape(-1, *kp.shape[2:])[:n]
        v = vp[pages].reshape(-1, *vp.shape[2:])[:n]
        kv = jnp.arange(n, dtype=jnp.int32).reshape(1, 1, n)
        seen = [np.broadcast_to(np.asarray(mask_mod(jnp.full((1, 1, 1), s, jnp.int32), heads,
                                                    jnp.full((1, 1, 1), n - t + r, jnp.int32), kv)), (1, hq, n))[0]
                for r in range(t)]  # fmt: skip
        mask = np.stack(seen, axis=1)[None]  # (1, Hq, t, n)
        rows = slice(int(cu[s]), int(cu[s + 1]))
        out[rows] = oracle.attention(q[None, rows], k[None], v[None], causal=True, mask=mask,
                                     sliding_window=None if window is None else (window, 0), logits_soft_cap=cap,
                                     softmax_aux=sinks).output[0]  # fmt: skip
    return out


def poisoned(c: dict[str, np.ndarray], num_seqs: int, hidden: list[tuple[int, int]] = ()) -> dict[str, np.ndarray]:
    """NaN in every page no sequence lists, past each length, and at the (sequence, position) pairs
    of ``hidden`` (which no query may see)."""
    out = {n: a.copy() for n, a in c.items()}
    page = c["k_pages"].shape[1]
    used = np.zeros(c["k_pages"].shape[:2], bool)
    for s in range(num_seqs):
        for p in range(int(c["kv_lengths"][s])):
            used[c["page_table"][s, p // page], p % page] = True
    for s, p in hidden:
        used[c["page_table"][s, p // page], p % page] = False
    for name in ("k_pages", "v_pages"):
        out[name][~used] = np.nan
    return out


def problem(q_lens: list[int], lengths: list[int], *, max_seqs: int, num_tokens: int, pages_per_seq: int,
            page: int = 4, hq: int = 4, hkv: int = 2, d: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """A ragged batch: ``cu_q_lens`` zero past the real sequences (as vLLM-TPU passes it), rows past
    the last one padding, pages in a random order."""
    rng = np.random.default_rng(seed)
    num_pages = max_seqs * pages_per_seq + 2
    table = rng.permutation(num_pages)[: max_seqs * pages_per_seq].reshape(max_seqs, pages_per_seq)
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    lens = np.zeros(max_seqs, np.int32)
    lens[: len(lengths)] = lengths
    return {"q": rng.normal(size=(num_tokens, hq, d)).astype(np.float32),
            "k_pages": rng.normal(size=(num_pages, page, hkv, d)).astype(np.float32),
            "v_pages": rng.normal(size=(num_pages, page, hkv, d)).astype(np.float32),
            "page_table": table.astype(np.int32), "kv_lengths": lens, "cu_q_lens": cu}  # fmt: skip


def interpreted_impl() -> Any:
    from .test_serving_conformance import InterpretedRaggedPaged

    return InterpretedRaggedPaged()


def run(impl: Any, c: dict[str, np.ndarray], num_seqs: int, make_mod: Callable[..., MaskMod], captured: tuple[Any, ...],
        jit: bool, dtype: Any = jnp.float32, **kw: Any) -> np.ndarray:
    """The call through ``jaxattn.ragged_paged_attention``; under jit the mask_mod's arrays
    (``captured``, given to ``make_mod``) are traced."""
    def call(q: Any, kp: Any, vp: Any, *arrays: Any) -> Any:
        return jaxattn.ragged_paged_attention(q, kp, vp, c["page_table"], c["kv_lengths"], c["cu_q_lens"],
                                              num_seqs, impl=impl, mask_mod=make_mod(*arrays), **kw)

    fn = jax.jit(call) if jit else call
    arrays = [jnp.asarray(c[n], dtype) for n in ("q", "k_pages", "v_pages")]
    return np.asarray(fn(*arrays, *(jnp.asarray(a) for a in captured)), np.float64)


# -- the docs' example --------------------------------------------------------------------------

DOCS_PARENTS = [-1, 0, 0, 1, 1, 2]


def docs_case() -> tuple[dict[str, np.ndarray], tuple[Any, ...]]:
    c = problem([6], [13], max_seqs=1, num_tokens=6, pages_per_seq=4)
    anc = ancestors(DOCS_PARENTS, 6)[None]
    return c, (anc, np.asarray([13 - 6], np.int32), np.asarray([True]))


@needs_interpreter
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_docs_tree_example(jit: bool) -> None:
    c, captured = docs_case()
    got = run(interpreted_impl(), poisoned(c, 1), 1, tree_mod, captured, jit)
    np.testing.assert_allclose(got, expected(c, tree_mod(*captured), 1), atol=1e-5)


# -- a mixed ragged batch ----------------------------------------------------------------------

# Sequence 0 a prefill chunk (5 queries at 35..39), 1 a decode step, 2 a tree step of 4 drafts at
# 40..43 (a capacity of 48: the first 32 keys a full word, run without mask arithmetic); 4 table
# rows, 3 real (cu_q_lens zero past them), and 2 padding rows.
MIXED_Q, MIXED_LEN, MIXED_PARENTS = [5, 1, 4], [40, 7, 44], [-1, 0, 0, 1]
HIDDEN = (0, 2)  # sequence 0's position 2: no query sees it (NaN there)


def mixed_case(seed: int = 0) -> tuple[dict[str, np.ndarray], tuple[Any, ...]]:
    c = problem(MIXED_Q, MIXED_LEN, max_seqs=4, num_tokens=12, pages_per_seq=12, seed=seed)
    anc = np.zeros((4, 4, 4), bool)
    anc[2] = ancestors(MIXED_PARENTS, 4)
    start = np.asarray([0, 0, 40, 0], np.int32)
    return c, (anc, start, np.asarray([False, False, True, False]))


def hiding(anc: Any, start: Any, tree_seqs: Any) -> MaskMod:
    tree = tree_mod(anc, start, tree_seqs)

    def mask_mod(seq: Any, h: Any, q_pos: Any, kv_pos: Any) -> Any:
        return tree(seq, h, q_pos, kv_pos) & ((seq != HIDDEN[0]) | (kv_pos != HIDDEN[1]))

    return mask_mod


@needs_interpreter
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_mixed_prefill_decode_and_tree(jit: bool) -> None:
    c, captured = mixed_case()
    got = run(interpreted_impl(), poisoned(c, 3, [HIDDEN]), 3, hiding, captured, jit)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected(c, hiding(*captured), 3), atol=1e-5)


def by_head(anc: Any, start: Any, tree_seqs: Any) -> MaskMod:
    """The tree, and odd heads see no cache position that is a multiple of 3 (but their own drafts)."""
    tree, start = tree_mod(anc, start, tree_seqs), jnp.asarray(start)

    def mask_mod(seq: Any, h: Any, q_pos: Any, kv_pos: Any) -> Any:
        return tree(seq, h, q_pos, kv_pos) & ((h % 2 == 0) | (kv_pos % 3 != 0) | (kv_pos >= start[seq]))

    return mask_mod


@needs_interpreter
def test_mask_mod_using_h_with_window_soft_cap_and_sinks() -> None:
    c, captured = mixed_case(1)
    sinks = np.asarray([0.5, -1.0, 2.0, 0.0], np.float32)
    got = run(interpreted_impl(), poisoned(c, 3), 3, by_head, captured, True, sliding_window=20,
              logits_soft_cap=3.0, softmax_aux=jnp.asarray(sinks))
    want = expected(c, by_head(*captured), 3, window=20, cap=3.0, sinks=sinks)
    np.testing.assert_allclose(got, want, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("tiles", ["decode_splits", "kv_heads"])
def test_explicit_tiles(tiles: str) -> None:
    """The ops entry point with tiles the defaults do not pick at these sizes: decode programs for
    short sequences and two key splits merged in the launch; two KV heads in one program."""
    from jaxattn_triton.paged import launch as LP
    from jaxattn_triton.paged.ops import ragged_paged

    c, captured = mixed_case(2)
    if tiles == "decode_splits":
        chosen = LP.PagedTiles(block_q=2, head_chunk=2, block_n=16, num_warps=4, num_stages=1, num_splits=2,
                               decode_q=4, decode_block_n=16)  # fmt: skip
    else:
        chosen = LP.PagedTiles(block_q=2, head_chunk=2, block_n=16, num_warps=4, num_stages=1, num_splits=1,
                               kv_heads=2)  # fmt: skip
    p = {n: jnp.asarray(a) for n, a in poisoned(c, 3, [HIDDEN]).items()}
    got = ragged_paged(p["q"], p["k_pages"], p["v_pages"], p["page_table"], p["kv_lengths"], p["cu_q_lens"], 3,
                       mask_mod=hiding(*captured), tiles=chosen, interpret=True)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), expected(c, hiding(*captured), 3), atol=1e-5)


@needs_interpreter
def test_quantized_cache() -> None:
    """An int8 cache with per-token scales, a float16 q: the tree over the dequantized cache."""
    c, captured = mixed_case(3)
    values, scales = {}, {}
    for name in ("k_pages", "v_pages"):
        values[name], scales[name] = (np.asarray(x) for x in jaxattn.quantize_kv(jnp.asarray(c[name]), "int8"))
    deq = {**c, **{n: values[n].astype(np.float32) * scales[n][..., None] for n in values}}
    q = jnp.asarray(c["q"], jnp.float16)
    scale_k, scale_v = (jnp.asarray(scales[n]) for n in ("k_pages", "v_pages"))
    got = jaxattn.ragged_paged_attention(q, jnp.asarray(values["k_pages"]), jnp.asarray(values["v_pages"]),
                                         c["page_table"], c["kv_lengths"], c["cu_q_lens"], 3, impl=interpreted_impl(),
                                         k_scale=scale_k, v_scale=scale_v, mask_mod=tree_mod(*captured))  # fmt: skip
    want = expected({**deq, "q": np.asarray(q, np.float32)}, tree_mod(*captured), 3)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2)


@needs_interpreter
def test_declared_and_explained() -> None:
    c, captured = docs_case()
    impl = interpreted_impl()
    reasons = impl.supports(c["q"], c["k_pages"], c["v_pages"], c["page_table"], c["kv_lengths"],
                            cu_q_lens=c["cu_q_lens"], num_seqs=np.asarray([1], np.int32), mask_mod=tree_mod(*captured))
    assert reasons == []
    call = impl.validate(c["q"], c["k_pages"], c["v_pages"], c["page_table"], c["kv_lengths"],
                         cu_q_lens=c["cu_q_lens"], num_seqs=np.asarray([1], np.int32), mask_mod=tree_mod(*captured))
    assert any("visibility bits" in n for n in impl.notes(call.problem))


def test_visibility_words_and_bounds() -> None:
    """The packed bits and bounds themselves (no kernel): bit j % 32 of word j // 32 per row and
    head, every head's run of full words, padding rows empty."""
    from jaxattn_triton.paged.visibility import visibility_words

    c, captured = mixed_case()
    words, bounds = jax.jit(lambda *a: visibility_words(by_head(*a), 12, 4, jnp.asarray(c["kv_lengths"]),
                                                         jnp.asarray(c["cu_q_lens"]), jnp.asarray([3], jnp.int32),
                                                         48))(*captured)  # fmt: skip
    words, bounds = np.asarray(words).transpose(1, 0, 2), np.asarray(bounds)  # (tokens, heads, words)
    assert words.shape == (12, 4, 2) and words.dtype == np.int32
    bits = (words.view(np.uint32)[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    bits = bits.reshape(12, 4, 64)[..., :48].astype(bool)
    mod = by_head(*captured)
    cu, lengths = c["cu_q_lens"], c["kv_lengths"]
    for s in range(3):
        for r in range(int(cu[s]), int(cu[s + 1])):
            pos = int(lengths[s]) - int(cu[s + 1] - cu[s]) + r - int(cu[s])
            kv = jnp.arange(48, dtype=jnp.int32).reshape(1, 1, 48)
            seen = np.broadcast_to(np.asarray(mod(jnp.full((1, 1, 1), s), jnp.arange(4).reshape(1, 4, 1),
                                                  jnp.full((1, 1, 1), pos), kv)), (1, 4, 48))[0]  # fmt: skip
            np.testing.assert_array_equal(bits[r], seen & (np.arange(48) <= pos))
    assert not bits[10:].any() and (bounds[10:] == 0).all()
    # Sequence 2's drafts (rows 6..9) see keys 0..31 in every head but the odd ones' multiples of 3.
    assert (bounds[6:10, :2] == [0, 64]).all() and (bounds[6:10, 2:] == 0).all()
    one_head = jax.jit(lambda *a: visibility_words(tree_mod(*a), 12, 4, jnp.asarray(c["kv_lengths"]),
                                                    jnp.asarray(c["cu_q_lens"]), jnp.asarray([3], jnp.int32),
                                                    48))(*captured)[1]  # fmt: skip
    assert (np.asarray(one_head)[6:10] == [0, 64, 0, 32]).all()


def test_bounds_of_words() -> None:
    """Per token: the words some head sees (``[lo, hi)``) and the first run every head sees in full."""
    from jaxattn_triton.paged.visibility import _bounds

    rows = [[0, 5, -1, -1, 3, -1], [0] * 6, [-1] * 6, [7, 0, 0, 0, 0, 0]]
    words = jnp.asarray(np.asarray(rows, np.int32)[None])  # (heads, tokens, words)
    want = [[1, 6, 2, 4], [0, 0, 0, 0], [0, 6, 0, 6], [0, 1, 0, 0]]
    np.testing.assert_array_equal(np.asarray(_bounds(words)), np.asarray(want) * 32)
    # Two heads: a word is full only when every head sees all of it.
    two = jnp.asarray(np.asarray([[[-1, -1, 0]], [[-1, 1, 0]]], np.int32))
    np.testing.assert_array_equal(np.asarray(_bounds(two)), [[0, 64, 0, 32]])


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU (the Triton kernels run natively)")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gpu_tree_and_mixed_batch(jit: bool) -> None:
    """The registered ``ragged_page_attention_v3`` in bf16 (what ``"auto"`` picks on CUDA)."""
    impl = jaxattn.get_impl("ragged_page_attention_v3", kind="paged")
    assert impl.name() == "ragged_page_attention_v3"
    for case, mod, hidden, seqs in ((docs_case, tree_mod, [], 1), (mixed_case, hiding, [HIDDEN], 3),
                                    (mixed_case, by_head, [], 3)):  # fmt: skip
        c, captured = case()
        bf = {n: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) if a.dtype == np.float32 else a
              for n, a in c.items()}  # fmt: skip
        got = run(impl, poisoned(bf, seqs, hidden), seqs, mod, captured, jit, dtype=jnp.bfloat16)
        np.testing.assert_allclose(got, expected(bf, mod(*captured), seqs), atol=3e-2)  # bf16 outputs


@needs_interpreter
@pytest.mark.filterwarnings(LOG2_WARNING)
def test_visibility_built_once_for_a_steps_layers_is_what_each_call_builds() -> None:
    # ops.ragged_paged(visibility=) reads words and bounds built once (visibility_words) for the
    # layers of a step; the same numbers as building them in the call; other shapes are refused.
    from jaxattn_triton.paged.ops import ragged_paged
    from jaxattn_triton.paged.visibility import visibility_words

    b, t, ctx, page, hq, hkv, d = 2, 4, 40, 8, 4, 2, 16
    pages = -(-ctx // page)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b * t, hq, d))
    kp, vp = (jax.random.normal(kk, (b * pages, page, hkv, d)) for kk in keys[1:])
    table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    lengths, cu, ns = jnp.full((b,), ctx, jnp.int32), jnp.arange(b + 1, dtype=jnp.int32) * t, jnp.asarray([b])

    def mod(s: Any, h: Any, qp: Any, kv: Any) -> Any:
        return (kv < ctx - t) | (kv == qp)

    vis = visibility_words(mod, b * t, hq, lengths, cu, ns, pages * page)
    each = ragged_paged(q, kp, vp, table, lengths, cu, ns, mask_mod=mod, interpret=True)
    once = ragged_paged(q, kp, vp, table, lengths, cu, ns, mask_mod=mod, visibility=vis, interpret=True)
    np.testing.assert_array_equal(np.asarray(once), np.asarray(each))
    with pytest.raises(ValueError, match=r"visibility must be words \(1 or 4, 8, 2\)"):
        ragged_paged(q, kp, vp, table, lengths, cu, ns, mask_mod=mod, visibility=(vis[0][:, :3], vis[1]),
                     interpret=True)
