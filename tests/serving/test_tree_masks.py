"""Tree masks for speculative decoding: ``ragged_paged_attention(..., mask_mod=)`` on the
vanilla paged reference. Each draft token sees the cache and its ancestors in the draft tree
(positions within the sequence); checked against the float64 oracle per sequence, with NaN in
cache positions no query may see; a chain tree equals plain causal; other paged backends
decline with the reason."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.testing import oracle

PAGE, PAGES_PER_SEQ, HQ, HKV, D = 4, 6, 4, 2, 16
# Two sequences: 9 and 14 cached tokens, the last 6 and 4 of them this step's draft tokens.
LENGTHS = np.array([9, 14], np.int32)
Q_LENS = np.array([6, 4], np.int32)
# Draft trees by parent (-1: the root, a child of the last accepted token).
PARENTS = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 0]]


def ancestors(parents: list[int], size: int) -> np.ndarray:
    """``(size, size)`` bool: ``[i, j]`` when draft token j is token i or one of its ancestors."""
    out = np.zeros((size, size), bool)
    for i in range(len(parents)):
        node = i
        while node >= 0:
            out[i, node] = True
            node = parents[node]
    return out


def tree_mask_mod(lengths: np.ndarray, q_lens: np.ndarray, parents: list[list[int]]) -> tuple[object, np.ndarray]:
    size = max(len(p) for p in parents)
    anc = jnp.asarray(np.stack([ancestors(p, size) for p in parents]))
    start = jnp.asarray(lengths - q_lens)  # the first draft token's position, per sequence

    def mask_mod(seq: jax.Array, h: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        first = start[seq]
        drafted = jnp.clip(kv_pos - first, 0, size - 1)
        return (kv_pos < first) | anc[seq, jnp.clip(q_pos - first, 0, size - 1), drafted]

    return mask_mod, np.asarray(anc)


def _cache(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    num_pages = 2 * PAGES_PER_SEQ + 1
    table = rng.permutation(num_pages)[: 2 * PAGES_PER_SEQ].reshape(2, PAGES_PER_SEQ).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
    return {"q": rng.normal(size=(int(cu[-1]), HQ, D)).astype(np.float32),
            "k_pages": rng.normal(size=(num_pages, PAGE, HKV, D)).astype(np.float32),
            "v_pages": rng.normal(size=(num_pages, PAGE, HKV, D)).astype(np.float32),
            "page_table": table, "cu_q_lens": cu}


def _expected(c: dict[str, np.ndarray], anc: np.ndarray, hidden: int | None = None) -> np.ndarray:
    out = np.zeros(c["q"].shape)
    for s in range(2):
        n, t = int(LENGTHS[s]), int(Q_LENS[s])
        pages = c["page_table"][s, : -(-n // PAGE)]
        k = c["k_pages"][pages].reshape(-1, HKV, D)[:n]
        v = c["v_pages"][pages].reshape(-1, HKV, D)[:n]
        mask = np.ones((t, n), bool)
        mask[:, n - t:] = anc[s, :t, :t]
        if hidden is not None:
            mask[:, hidden] = False
        rows = slice(int(c["cu_q_lens"][s]), int(c["cu_q_lens"][s + 1]))
        out[rows] = oracle.attention(c["q"][None, rows], k[None], v[None], causal=True, mask=mask).output[0]
    return out


def _poison(c: dict[str, np.ndarray], position: int | None) -> dict[str, np.ndarray]:
    """NaN past each sequence's length (its last page's tail), and at ``position`` of sequence 0."""
    out = {n: a.copy() for n, a in c.items()}
    for s in range(2):
        for p in range(int(LENGTHS[s]), PAGES_PER_SEQ * PAGE):
            page = c["page_table"][s, p // PAGE]
            out["k_pages"][page, p % PAGE] = np.nan
            out["v_pages"][page, p % PAGE] = np.nan
    if position is not None:
        page = c["page_table"][0, position // PAGE]
        out["k_pages"][page, position % PAGE] = np.nan
        out["v_pages"][page, position % PAGE] = np.nan
    return out


def _run(c: dict[str, np.ndarray], mask_mod: object, jit: bool) -> np.ndarray:
    def call(q: jax.Array, kp: jax.Array, vp: jax.Array) -> jax.Array:
        return jaxattn.ragged_paged_attention(q, kp, vp, c["page_table"], LENGTHS, c["cu_q_lens"], 2,
                                              impl="vanilla_paged", mask_mod=mask_mod)

    run = jax.jit(call) if jit else call
    return np.asarray(run(jnp.asarray(c["q"]), jnp.asarray(c["k_pages"]), jnp.asarray(c["v_pages"])))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_tree_mask_matches_the_oracle(jit: bool) -> None:
    c = _cache()
    mod, anc = tree_mask_mod(LENGTHS, Q_LENS, PARENTS)
    got = _run(_poison(c, None), mod, jit)
    np.testing.assert_allclose(got, _expected(c, anc), atol=1e-5)
    # Sequence 0's cache position 2, hidden from every query: never read (NaN there).
    hide = 2

    def hiding(seq: jax.Array, h: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        return mod(seq, h, q_pos, kv_pos) & ((seq != 0) | (kv_pos != hide))  # type: ignore[operator]

    got = _run(_poison(c, hide), hiding, jit)
    assert np.isfinite(got).all()
    seq0 = int(Q_LENS[0])
    np.testing.assert_allclose(got[:seq0], _expected(c, anc, hidden=hide)[:seq0], atol=1e-5)
    np.testing.assert_allclose(got[seq0:], _expected(c, anc)[seq0:], atol=1e-5)


def test_a_chain_is_plain_causal() -> None:
    c = _cache(1)
    chains = [list(range(-1, int(n) - 1)) for n in Q_LENS]
    mod, _ = tree_mask_mod(LENGTHS, Q_LENS, chains)
    plain = jaxattn.ragged_paged_attention(c["q"], c["k_pages"], c["v_pages"], c["page_table"], LENGTHS,
                                           c["cu_q_lens"], 2, impl="vanilla_paged")
    np.testing.assert_allclose(_run(c, mod, False), np.asarray(plain), atol=1e-6)


def test_checks_and_declines() -> None:
    c = _cache()
    with pytest.raises(jaxattn.InvalidInputError, match="mask_mod"):
        jaxattn.ragged_paged_attention(c["q"], c["k_pages"], c["v_pages"], c["page_table"], LENGTHS,
                                       c["cu_q_lens"], 2, impl="vanilla_paged", mask_mod=lambda s, h, q: q > 0)
    md = jaxattn.AttentionMetadata(platform="tpu", interpret=True)
    impl = jaxattn.get_impl("ragged_page_attention_v3", md, kind="paged")
    mod, _ = tree_mask_mod(LENGTHS, Q_LENS, PARENTS)
    reasons = impl.supports(c["q"], c["k_pages"], c["v_pages"], c["page_table"], LENGTHS, cu_q_lens=c["cu_q_lens"],
                            num_seqs=np.asarray([2], np.int32), mask_mod=mod)
    if impl.name() != "vanilla_paged":  # the Pallas ragged kernel, where installed
        assert any("mask_mod" in r for r in reasons)
