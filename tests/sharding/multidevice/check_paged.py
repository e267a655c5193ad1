"""Head-sharded paged decode and ragged serving on the 8-device host mesh, against the float64 oracle.

Each device holds its KV heads' pages (the pages sharded on their head axis, the query heads
with them, the page table and lengths replicated). Pages no sequence reads hold NaN and +Inf,
and so do the positions past each sequence's length in the pages it does read.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.errors import UnsupportedError
from jaxattn.testing import oracle

from ._util import mesh, requires_8_devices

pytestmark = requires_8_devices

NUM_PAGES, PAGE = 16, 4
LENGTHS = np.array([7, 13, 1], np.int32)


def heads(n: int, **fields: Any) -> jaxattn.AttentionMetadata:
    return jaxattn.AttentionMetadata(mesh=mesh((n,), ("model",)), head_axis="model", **fields)


def cache(hq: int, hkv: int, q_lens: list[int], seed: int, dtype: Any = np.float64) -> dict[str, np.ndarray]:
    """A ragged call whose unread pages and unread positions are poisoned (NaN, +Inf)."""
    rng = np.random.default_rng(seed)
    d = 8
    table = rng.permutation(NUM_PAGES)[:12].reshape(3, 4).astype(np.int32)
    k, v = (rng.normal(size=(NUM_PAGES, PAGE, hkv, d)) for _ in range(2))
    read = np.zeros((NUM_PAGES, PAGE), bool)
    for seq, length in enumerate(LENGTHS):
        for pos in range(int(length)):
            read[table[seq, pos // PAGE], pos % PAGE] = True
    k[~read], v[~read] = np.nan, np.inf
    return {
        "q": rng.normal(size=(sum(q_lens), hq, d)).astype(dtype),
        "k_pages": k.astype(dtype), "v_pages": v.astype(dtype),
        "page_table": table, "kv_lengths": LENGTHS,
        "cu_q_lens": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        "num_seqs": np.array([3], np.int32),
    }


def expected(a: dict[str, np.ndarray], **kw: Any) -> np.ndarray:
    clean = {key: np.nan_to_num(a[key], nan=0.0, posinf=0.0) for key in ("k_pages", "v_pages")}
    return oracle.paged_attention(a["q"], clean["k_pages"], clean["v_pages"], a["page_table"], a["kv_lengths"],
                                  a["cu_q_lens"], a["num_seqs"], **kw)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(("n", "ragged"), [(2, True), (4, False)], ids=["ragged-2", "decode-4"])
def test_head_sharded_matches_float64_oracle(n: int, jit: bool, ragged: bool) -> None:
    a = cache(hq=8, hkv=4, q_lens=[3, 5, 1] if ragged else [1, 1, 1], seed=n)
    aux = np.random.default_rng(1).normal(size=(8,))
    want = expected(a, softmax_aux=aux, sliding_window=6, logits_soft_cap=3.0)
    with jax.enable_x64(True):
        args = {key: jnp.asarray(x) for key, x in a.items()}

        def run(args: dict[str, Any], aux: Any) -> Any:
            kw = {"softmax_aux": aux, "sliding_window": 6, "logits_soft_cap": 3.0, "metadata": heads(n)}
            q, k, v, table, lengths = (args[key] for key in ("q", "k_pages", "v_pages", "page_table", "kv_lengths"))
            if ragged:
                cu, num = args["cu_q_lens"], args["num_seqs"]
                return jaxattn.ragged_paged_attention(q, k, v, table, lengths, cu, num, **kw)
            return jaxattn.paged_attention(q, k, v, table, lengths, **kw)  # q (B, Hq, D): one decode step per sequence

        out = (jax.jit(run) if jit else run)(args, jnp.asarray(aux))
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-12, atol=1e-12)


def test_combined_layout_splits_whole_heads() -> None:
    a = cache(hq=4, hkv=2, q_lens=[2, 2, 1], seed=5)
    kv = np.stack([a["k_pages"], a["v_pages"]], axis=3).reshape(NUM_PAGES, PAGE, 4, -1)  # K h at 2h, V at 2h+1
    want = expected(a)
    with jax.enable_x64(True):
        out = jax.jit(functools.partial(jaxattn.ragged_paged_attention, metadata=heads(2)))(
            jnp.asarray(a["q"]), None, None, a["page_table"], a["kv_lengths"], a["cu_q_lens"], a["num_seqs"],
            kv_pages=jnp.asarray(kv))
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("granularity", ["tensor", "head", "token"])
def test_quantized_cache_with_scales(granularity: str) -> None:
    a = cache(hq=8, hkv=4, q_lens=[3, 5, 1], seed=7, dtype=np.float32)
    clean = {key: np.nan_to_num(a[key], nan=0.0, posinf=0.0) for key in ("k_pages", "v_pages")}
    (k8, ks), (v8, vs) = (jaxattn.quantize_kv(jnp.asarray(clean[key]), "int8", granularity=granularity)
                          for key in ("k_pages", "v_pages"))
    deq = {key: np.asarray(jaxattn.dequantize_kv(x, s), np.float64) for key, x, s in
           (("k_pages", k8, ks), ("v_pages", v8, vs))}
    want = oracle.paged_attention(a["q"], deq["k_pages"], deq["v_pages"], a["page_table"], a["kv_lengths"],
                                  a["cu_q_lens"], a["num_seqs"])
    run = jax.jit(functools.partial(jaxattn.ragged_paged_attention, metadata=heads(4)))
    out = run(jnp.asarray(a["q"]), k8, v8, a["page_table"], a["kv_lengths"], a["cu_q_lens"], a["num_seqs"],
              k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)


def test_output_stays_sharded_on_heads() -> None:
    a = cache(hq=8, hkv=4, q_lens=[1, 1, 1], seed=9, dtype=np.float32)
    md = heads(4)
    out = jax.jit(functools.partial(jaxattn.ragged_paged_attention, metadata=md))(
        *(jnp.asarray(x) for x in a.values()))
    assert out.sharding.spec[1] == "model", out.sharding


def test_heads_that_do_not_split_are_declined_with_the_reason() -> None:
    a = cache(hq=6, hkv=2, q_lens=[1, 1, 1], seed=11, dtype=np.float32)  # Hkv=2 over 4 devices
    with pytest.raises(UnsupportedError, match=r"Hkv=2 KV heads do not split over mesh axis 'model' of size 4"):
        jaxattn.ragged_paged_attention(*a.values(), impl="vanilla_paged", metadata=heads(4))


def test_batch_and_sequence_axes_are_declined() -> None:
    a = cache(hq=8, hkv=4, q_lens=[1, 1, 1], seed=12, dtype=np.float32)
    md = jaxattn.AttentionMetadata(mesh=mesh((2, 4), ("data", "model")), batch_axis="data", head_axis="model")
    with pytest.raises(UnsupportedError, match="shards only the KV heads"):
        jaxattn.ragged_paged_attention(*a.values(), impl="vanilla_paged", metadata=md)


def test_pallas_tpu_page_attention_in_interpret_mode() -> None:
    # JAX's TPU paged_attention kernel (Pallas interpret mode on the CPU) on its heads' pages, 2 devices.
    # (The ragged TPU kernel does not run in interpret mode; it declines there, as on one device.)
    a = cache(hq=8, hkv=4, q_lens=[1, 1, 1], seed=13, dtype=np.float32)
    clean = {key: np.nan_to_num(a[key], nan=0.0, posinf=0.0) for key in ("k_pages", "v_pages")}
    a.update(clean)  # the poison is for the float64 tests above; these kernels' page reads differ
    md = heads(2, platform="tpu", interpret=True)
    cached = (a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"])
    out = jaxattn.paged_attention(*cached, impl="page_attention", metadata=md)
    np.testing.assert_allclose(np.asarray(out), expected(a), rtol=2e-5, atol=2e-5)
