"""blockwise: the conformance suite across several blocks, its O(T) memory, block skipping,
gradients (lse and dropout included) at lengths that are not multiples of the blocks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backend.validation import resolve_call
from jaxattn.testing import oracle
from jaxattn.testing.cases import Case, Level
from jaxattn.testing.conformance import ConformanceSuite
from jaxattn.testing.quick_jit import compiler_options_for_tests, quick_jit
from jaxattn_vanilla.blockwise.impl import BlockwiseAttention
from jaxattn_vanilla.blockwise.kernel import (
    block_tiling,
    blockwise_attention,
    default_block,
    key_block_ranges,
    query_block_range,
)
from jaxattn_vanilla.plugin import BLOCKWISE
from jaxattn_vanilla.vanilla.reference import vanilla_attention

# Blocks of 4 queries x 8 keys: the suite's cases (T, S up to 13) span 2-4 blocks per axis,
# with padding, and the backward sweep's 333 spans hundreds.
BLOCKS_4x8 = jaxattn.AttentionMetadata(block_q=4, block_k=8)


class TestBlockwiseConformance(ConformanceSuite):
    impl_name = "blockwise"
    metadata = BLOCKS_4x8
    # The defaults minus (1001, 1001): 31k tiles of 4x8 cost seconds and test nothing that
    # (333, 333) does not; test_long_causal_matches_vanilla covers long rows.
    backward_lengths: ClassVar[tuple[tuple[int, int], ...]] = ((1, 1), (3, 3), (1, 333), (333, 333))


def test_backward_lengths_with_default_blocks() -> None:
    """The suite's whole sweep, (1001, 1001) included, with the blocks a user gets (1001 rows
    split into two 501-row blocks with padding): gradients match the oracle."""

    class DefaultBlocks(ConformanceSuite):
        impl_name = "blockwise"

    for lengths in ConformanceSuite.backward_lengths:
        DefaultBlocks().test_backward_lengths(lengths)


class TestBlockwiseConformanceBfloat16(ConformanceSuite):
    """bfloat16 on the cases whose 16-bit roundings differ (grouped heads, sinks, soft cap,
    empty rows, decode, everything combined); the full matrix runs in float32 above. Each
    case is one compile of about a second, and this file must stay within two minutes."""

    impl_name = "blockwise"
    metadata = BLOCKS_4x8
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16",)
    # Eagerly in float32 above (the same code); here under jax.jit, both programs.
    eager_dtypes: ClassVar[tuple[str, ...]] = ()
    backward_lengths: ClassVar[tuple[tuple[int, int], ...]] = ((3, 3),)
    subset: ClassVar[frozenset[str]] = frozenset({
        "combined", "mqa_causal", "value_dim", "sinks", "soft_cap", "empty_rows", "decode", "causal_t_gt_s", "bias",
    })

    @classmethod
    def cases(cls, level: Level) -> Sequence[Case]:
        picked = [c for c in super().cases(level) if c.name in cls.subset]
        assert {c.name for c in picked} == cls.subset, "a case of the subset left the matrix"
        return picked


def _qkv(b: int = 2, t: int = 5, s: int = 7, hq: int = 4, hkv: int = 2, d: int = 8, dv: int | None = None,
         seed: int = 0, dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(b, t, hq, d)).astype(dtype),
        rng.normal(size=(b, s, hkv, d)).astype(dtype),
        rng.normal(size=(b, s, hkv, dv or d)).astype(dtype),
    )


def _assert_close(got: Any, want: Any, tol: float, what: str = "") -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got) | np.isneginf(want)), f"{what}: non-finite values"
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want[np.isfinite(want)]).max(
        initial=0.0))), err_msg=what)


# -- registration ---------------------------------------------------------------------------
def test_registered_beside_vanilla_and_declarations_match() -> None:
    info = {i.name: i for i in jaxattn.list_impls()}["blockwise"]
    assert info.distribution == "jaxattn-vanilla" and info.status == "ok"
    impl = jaxattn.get_impl("blockwise")
    assert isinstance(impl, BlockwiseAttention)
    assert set(BLOCKWISE.platforms) == set(BlockwiseAttention.platforms) == {"cpu", "gpu", "tpu"}
    assert BLOCKWISE.priority == BlockwiseAttention.priority == 10
    assert BLOCKWISE.names == BlockwiseAttention.names()
    assert BLOCKWISE.description == BlockwiseAttention.description
    assert jaxattn.Feature.WEIGHTS not in impl.features and jaxattn.Feature.LSE in impl.features


def test_plugin_module_imports_neither_jax_nor_the_kernel() -> None:
    code = (
        "import sys, jaxattn_vanilla.plugin as p; p.jaxattn_register_impls(); "
        "print(sorted(m for m in ('jax', 'jaxlib', 'jaxattn_vanilla.blockwise.kernel',"
        " 'jaxattn_vanilla.blockwise.impl')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_auto_ranks_it_above_vanilla_where_it_is_accepted() -> None:
    """Where no kernel takes the call (a soft cap on a CPU), auto prefers blockwise to vanilla."""
    q, k, v = _qkv()
    exp = jaxattn.explain(q, k, v, causal=True, logits_soft_cap=5.0)
    accepted = [c.name for c in exp.candidates if c.accepted]
    assert accepted.index("blockwise") < accepted.index("vanilla")
    blockwise = next(c for c in exp.candidates if c.name == "blockwise")
    assert any("tiles computed" in n for n in blockwise.notes)


# -- the tiling ------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "cap", "block"), [(1, 512, 1), (512, 512, 512), (1000, 512, 500), (1025, 512, 342),
                                                 (4096, 1024, 1024)])
def test_default_block_pads_less_than_one_row_per_block(n: int, cap: int, block: int) -> None:
    assert default_block(n, cap) == block
    blocks = -(-n // block)
    assert blocks * block - n < blocks and block <= cap


def _visible_tiles(t: int, s: int, bq: int, bk: int, causal: bool,
                   window: tuple[int, int] | None) -> set[tuple[int, int]]:
    vis = oracle.visibility(1, 1, t, s, causal=causal, sliding_window=window)[0, 0]
    rows, cols = np.nonzero(vis)
    return set(zip((rows // bq).tolist(), (cols // bk).tolist(), strict=True))


def test_plan_visits_exactly_the_tiles_with_a_visible_key() -> None:
    """The static skip is tight (no tile without a visible key is computed) and safe (every
    tile with one is); brute force over shapes, blocks, causal and windows."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        t, s = (int(x) for x in rng.integers(1, 40, 2))
        bq, bk = (int(x) for x in rng.integers(1, 12, 2))
        causal = bool(rng.integers(2))
        window = None if rng.integers(3) == 0 else (int(rng.integers(0, 10)), int(rng.integers(0, 10)))
        tiling = block_tiling(t, s, bq, bk, causal=causal, window=window)
        forward = {(i, tiling.k_first[i] + n) for i in range(tiling.num_q) for n in range(tiling.k_count[i])}
        backward = {(tiling.q_first[j] + n, j) for j in range(tiling.num_k) for n in range(tiling.q_count[j])}
        want = _visible_tiles(t, s, tiling.block_q, tiling.block_k, causal, window)
        label = f"t={t} s={s} blocks={bq}x{bk} causal={causal} window={window}"
        assert forward == want, label
        assert backward == want, label


def test_causal_and_window_skip_most_tiles() -> None:
    causal = block_tiling(4096, 4096, 512, 512, causal=True)
    assert (causal.tiles_visited, causal.num_q * causal.num_k) == (36, 64)
    window = block_tiling(4096, 4096, 512, 512, causal=True, window=(512, 0))
    assert window.tiles_visited == 15  # the diagonal and the one before it


# -- memory ----------------------------------------------------------------------------------
def _fwd_bwd_bytes(name: str, t: int, md: jaxattn.AttentionMetadata, wrt: tuple[int, ...] = (0, 1, 2),
                   bias_shape: tuple[int, ...] | None = None, with_outputs: bool = False, **features: Any) -> int:
    """XLA's temporaries of the compiled gradient (plus its outputs when ``with_outputs``)."""
    impl = jaxattn.get_impl(name, md)
    spec = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    args: list[Any] = [spec, spec, spec]
    if bias_shape is not None:
        args.append(jax.ShapeDtypeStruct(bias_shape, jnp.float32))

    def loss(*a: Any) -> Any:
        bias = a[3] if len(a) > 3 else None
        return impl(a[0], a[1], a[2], bias=bias, **features).attention_outputs.sum()

    grad = jax.jit(jax.grad(loss, argnums=wrt), compiler_options=compiler_options_for_tests())
    compiled = grad.lower(*args).compile()
    stats = compiled.memory_analysis()
    assert stats is not None
    return int(stats.temp_size_in_bytes) + (int(stats.output_size_in_bytes) if with_outputs else 0)


BLOCKS_128 = jaxattn.AttentionMetadata(block_q=128, block_k=128)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_memory_grow_linearly(causal: bool) -> None:
    """XLA's own accounting of the compiled forward + backward: doubling T = S doubles
    blockwise's temporaries (at most; a constant block working set makes it less) and
    quadruples vanilla's."""
    block = [_fwd_bwd_bytes("blockwise", t, BLOCKS_128, causal=causal) for t in (1024, 2048)]
    dense = [_fwd_bwd_bytes("vanilla", t, BLOCKS_128, causal=causal) for t in (1024, 2048)]
    assert block[1] / block[0] < 2.05, block
    assert dense[1] / dense[0] > 3.5, dense
    # Below one (T, S) float32 array, where vanilla keeps several.
    assert block[1] < 2048 * 2048 * 4 < dense[1] / 4, (block, dense)


def test_broadcast_mask_and_bias_are_never_materialised() -> None:
    """A key-padding bias (1, 1, 1, S) stays that size: memory still grows linearly."""
    sizes = [
        _fwd_bwd_bytes("blockwise", t, BLOCKS_128, wrt=(0, 1, 2, 3), bias_shape=(1, 1, 1, t), causal=True)
        for t in (1024, 2048)
    ]
    assert sizes[1] / sizes[0] < 2.05, sizes


def test_a_constant_bias_gets_no_gradient_buffer() -> None:
    """A (T, S) bias that is not differentiated costs no (T, S) dbias, neither as a temporary
    nor as an output (the accumulator of a trained one becomes its output). The custom VJP
    sees that the bias is not perturbed (symbolic zeros) and traces no accumulator at all,
    rather than leaving its removal to XLA."""
    t = 1024
    full = (1, 1, t, t)
    constant = _fwd_bwd_bytes("blockwise", t, BLOCKS_128, wrt=(0, 1, 2), bias_shape=full, with_outputs=True)
    trained = _fwd_bwd_bytes("blockwise", t, BLOCKS_128, wrt=(0, 1, 2, 3), bias_shape=full, with_outputs=True)
    assert constant < t * t * 4 <= trained, (constant, trained)

    q, k, v = _qkv(t=12, s=16)  # multiples of the blocks: the accumulator has the bias's shape
    bias = np.zeros((1, 1, 12, 16), np.float32)

    def loss(q: Any, k: Any, v: Any, bias: Any) -> Any:
        return blockwise_attention(q, k, v, bias=bias, block_q=4, block_k=8).output.sum()

    def accumulators(wrt: tuple[int, ...]) -> int:
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=wrt))(q, k, v, bias).jaxpr
        return sum(1 for prim, shape in _results(jaxpr) if prim == "dynamic_update_slice" and shape[-2:] == (12, 16))

    assert (accumulators((0, 1, 2)), accumulators((0, 1, 2, 3))) == (0, 1)


# -- numerics beyond the matrix --------------------------------------------------------------
def _every_feature(b: int, t: int, s: int, hq: int, seed: int = 1) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    mask = rng.random((b, 1, t, s)) > 0.2
    mask[0, 0, min(3, t - 1)] = False  # an empty row
    return {
        "mask": mask,
        "bias": rng.normal(size=(1, hq, t, s)).astype(np.float32),
        "softmax_aux": rng.normal(size=(hq,)).astype(np.float32),
        "q_segment_ids": np.sort(rng.integers(0, 3, (b, t)), axis=1).astype(np.int32),
        "kv_segment_ids": np.sort(rng.integers(0, 3, (b, s)), axis=1).astype(np.int32),
    }


@pytest.mark.parametrize(("t", "s", "blocks"), [(37, 53, (16, 16)), (53, 37, (7, 24))])
def test_gradients_at_lengths_that_are_not_block_multiples(t: int, s: int, blocks: tuple[int, int]) -> None:
    b, hq = 2, 4
    q, k, v = _qkv(b=b, t=t, s=s, hq=hq, hkv=2, d=8, dv=6)
    arrays = _every_feature(b, t, s, hq)
    static: dict[str, Any] = {"causal": True, "sliding_window": (11, 3), "logits_soft_cap": 3.0}
    d_out = np.random.default_rng(2).normal(size=(b, t, hq, 6)).astype(np.float32)
    impl = BlockwiseAttention(jaxattn.AttentionMetadata(block_q=blocks[0], block_k=blocks[1]))

    def loss(q: Any, k: Any, v: Any, bias: Any, aux: Any) -> tuple[Any, Any]:
        out = impl(q, k, v, mask=arrays["mask"], bias=bias, softmax_aux=aux, q_segment_ids=arrays["q_segment_ids"],
                   kv_segment_ids=arrays["kv_segment_ids"], **static)
        return jnp.sum(out.attention_outputs * d_out), out

    grads, out = quick_jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        q, k, v, arrays["bias"], arrays["softmax_aux"])
    ref = oracle.attention(q, k, v, **arrays, **static)
    _assert_close(out.attention_outputs, ref.output, 1e-5, "output")
    _assert_close(out.softmax_lse, ref.lse, 1e-5, "lse")
    assert np.array_equal(np.isneginf(out.softmax_lse), np.isneginf(ref.lse))
    back = oracle.attention_backward(q, k, v, d_out, **arrays, **static)
    for name, got, want in zip(("dq", "dk", "dv", "dbias", "daux"), grads,
                               (back.dq, back.dk, back.dv, back.dbias, back.dsoftmax_aux), strict=True):
        assert want is not None
        _assert_close(got, want, 1e-4, name)


def test_backward_blocks_may_differ_from_the_forward() -> None:
    q, k, v = _qkv(t=19, s=23)
    d_out = np.random.default_rng(3).normal(size=q.shape).astype(np.float32)
    grads = []
    for md in (jaxattn.AttentionMetadata(block_q=5, block_k=7),
               jaxattn.AttentionMetadata(block_q=5, block_k=7, block_q_bwd=8, block_k_bwd=3)):
        impl = BlockwiseAttention(md)
        fn = quick_jit(jax.grad(lambda q, k, v, impl=impl: jnp.sum(impl(q, k, v, causal=True).attention_outputs
                                                                     * d_out), argnums=(0, 1, 2)))
        grads.append(fn(q, k, v))
    ref = oracle.attention_backward(q, k, v, d_out, causal=True)
    for a, b_, want in zip(*grads, (ref.dq, ref.dk, ref.dv), strict=True):
        _assert_close(a, want, 1e-4)
        _assert_close(b_, want, 1e-4)


def test_lse_cotangent_matches_autodiff_of_vanilla() -> None:
    """Ring attention merges blocks through lse, so its gradient must flow (sinks and empty
    rows included)."""
    q, k, v = _qkv(t=11, s=17)
    rng = np.random.default_rng(4)
    mask = rng.random((2, 1, 11, 17)) > 0.3
    mask[1, 0, 5] = False
    aux = rng.normal(size=(4,)).astype(np.float32)
    w_out = rng.normal(size=(2, 11, 4, 8)).astype(np.float32)
    w_lse = rng.normal(size=(2, 4, 11)).astype(np.float32)

    def make_loss(fn: Any) -> Any:
        def loss(q: Any, k: Any, v: Any, aux: Any) -> Any:
            out, lse = fn(q, k, v, aux)
            lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
            return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)
        return loss

    def blockwise(q: Any, k: Any, v: Any, aux: Any) -> tuple[Any, Any]:
        res = blockwise_attention(q, k, v, mask=mask, softmax_aux=aux, causal=True, block_q=4, block_k=5)
        return res.output, res.lse

    def vanilla(q: Any, k: Any, v: Any, aux: Any) -> tuple[Any, Any]:
        res = vanilla_attention(q, k, v, mask=mask, softmax_aux=aux, causal=True)
        return res.output, res.lse

    got = quick_jit(jax.grad(make_loss(blockwise), argnums=(0, 1, 2, 3)))(q, k, v, aux)
    want = quick_jit(jax.grad(make_loss(vanilla), argnums=(0, 1, 2, 3)))(q, k, v, aux)
    for name, a, b in zip(("dq", "dk", "dv", "daux"), got, want, strict=True):
        _assert_close(a, b, 1e-4, name)
    # the lse alone: the output's cotangent is a symbolic zero, only lse's reaches the backward
    def lse_sum(fn: Any) -> Any:
        def loss(q: Any) -> Any:
            lse = fn(q, k, v, aux)[1]
            return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return loss

    only_lse = quick_jit(jax.grad(lse_sum(blockwise)))(q)
    _assert_close(only_lse, quick_jit(jax.grad(lse_sum(vanilla)))(q), 1e-4, "dq from lse")


def test_fully_masked_rows_give_zeros_and_zero_grads() -> None:
    """Every row empty (mask), rows before the keys (causal T > S) with sinks, and -inf bias rows."""
    q, k, v = _qkv(t=9, s=6)
    cases: list[dict[str, Any]] = [
        {"mask": np.zeros((1, 1, 9, 6), dtype=bool)},
        {"causal": True, "softmax_aux": np.full((4,), 3.0, np.float32)},
        {"bias": np.where(np.arange(9)[:, None] % 2 == 0, -np.inf, 0.0).repeat(6, 1).astype(np.float32)},
    ]
    for kw in cases:
        def loss(q: Any, k: Any, v: Any, kw: dict[str, Any] = kw) -> tuple[Any, Any]:
            res = blockwise_attention(q, k, v, block_q=2, block_k=4, **kw)
            return jnp.sum(res.output), res

        grads, res = quick_jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        ref = oracle.attention(q, k, v, **kw)
        empty = np.isneginf(ref.lse)  # (B, H, T)
        assert empty.any()
        assert np.array_equal(np.isneginf(res.lse), empty)
        out = np.asarray(res.output).transpose(0, 2, 1, 3)  # (B, H, T, Dv)
        np.testing.assert_array_equal(out[empty], 0.0)
        for g in grads:
            assert np.all(np.isfinite(g))
        dq = np.asarray(grads[0]).transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(dq[empty], 0.0)
        _assert_close(res.output, ref.output, 1e-5, str(list(kw)))


@pytest.mark.parametrize(("t", "hq", "hkv"), [(700, 4, 1)])
def test_long_causal_matches_vanilla(t: int, hq: int, hkv: int) -> None:
    """Default query blocks (2 of 350) and 256-key blocks (3, the last one padded); MQA."""
    q, k, v = _qkv(b=1, t=t, s=t, hq=hq, hkv=hkv, d=32, seed=5)
    d_out = np.random.default_rng(6).normal(size=q.shape).astype(np.float32)

    def make_loss(fn: Any) -> Any:
        return lambda q, k, v: jnp.sum(fn(q, k, v).output * d_out)

    blockwise = jax.value_and_grad(make_loss(lambda q, k, v: blockwise_attention(q, k, v, causal=True, block_k=256)),
                                   argnums=(0, 1, 2))
    vanilla = jax.value_and_grad(make_loss(lambda q, k, v: vanilla_attention(q, k, v, causal=True)), argnums=(0, 1, 2))
    (lb, gb), (lv, gv) = quick_jit(blockwise)(q, k, v), quick_jit(vanilla)(q, k, v)
    _assert_close(lb, lv, 1e-4, "loss")
    for name, a, b in zip(("dq", "dk", "dv"), gb, gv, strict=True):
        _assert_close(a, b, 2e-4, name)


def _results(jaxpr: Any) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(primitive, shape) of every result in a jaxpr, loop and custom-VJP bodies included."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield eqn.primitive.name, tuple(getattr(var.aval, "shape", ()))
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _results(inner)


def test_gqa_never_materialises_repeated_kv_or_the_full_logits() -> None:
    """No intermediate of forward + backward (loop bodies included) has shape (B, S, Hq, D)
    or a (T, S) pair of trailing dims."""
    b, t, s, hq, hkv, d = 1, 40, 48, 8, 2, 16
    q = jnp.zeros((b, t, hq, d))
    k = v = jnp.zeros((b, s, hkv, d))

    def loss(q: Any, k: Any, v: Any) -> Any:
        return blockwise_attention(q, k, v, causal=True, block_q=8, block_k=16).output.sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    seen = {shape for _, shape in _results(jaxpr.jaxpr)}
    assert (b, s, hq, d) not in seen and (b, hq, s, d) not in seen
    assert not [sh for sh in seen if len(sh) >= 2 and sh[-2:] == (t, s)], "a (T, S) intermediate"
    assert (b, hkv, hq // hkv, 8, 16) in seen  # the tiles: grouped per kv head


def test_float64_matches_oracle_tightly() -> None:
    q, k, v = (x.astype(np.float64) for x in _qkv(t=13, s=10))
    kw: dict[str, Any] = {"causal": True, "logits_soft_cap": 3.0, "sliding_window": (4, 2)}
    d_out = np.random.default_rng(7).normal(size=q.shape)
    with jax.enable_x64(True):
        impl = BlockwiseAttention(jaxattn.AttentionMetadata(block_q=4, block_k=3))
        grads = quick_jit(jax.grad(lambda q, k, v: jnp.sum(impl(q, k, v, **kw).attention_outputs * d_out),
                                   argnums=(0, 1, 2)))(q, k, v)
        out = quick_jit(lambda q, k, v: impl(q, k, v, **kw))(q, k, v)
        assert out.attention_outputs.dtype == jnp.float64 and out.softmax_lse.dtype == jnp.float64
    ref = oracle.attention(q, k, v, **kw)
    np.testing.assert_allclose(out.attention_outputs, ref.output, rtol=1e-12, atol=1e-12)
    back = oracle.attention_backward(q, k, v, d_out, **kw)
    for g, want in zip(grads, (back.dq, back.dk, back.dv), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-10)


def test_vmap_and_init_bias() -> None:
    impl = BlockwiseAttention(jaxattn.AttentionMetadata(block_q=2, block_k=3))
    q, k, v = (np.stack([x, 2 * x]) for x in _qkv())
    bias = np.random.default_rng(8).normal(size=(2, 1, 4, 5, 7)).astype(np.float32)
    batched = quick_jit(jax.vmap(lambda q, k, v, b: impl(q, k, v, bias=b, causal=True).attention_outputs))(
        q, k, v, bias)
    for i in range(2):
        _assert_close(batched[i], oracle.attention(q[i], k[i], v[i], bias=bias[i], causal=True).output, 1e-5)
    # A call object built from init_bias (validation calls it) runs the forward directly.
    call = resolve_call(q[0], k[0], v[0], init_bias=lambda: bias[0], causal=True, metadata=impl.metadata, prepare=True)
    direct = impl.forward_native(call)
    _assert_close(direct.attention_outputs, batched[0], 1e-6)


# -- kv_lengths: a dense KV cache of capacity S ----------------------------------------------
def _tiles_of(visible: np.ndarray, bq: int, bk: int) -> set[tuple[int, int]]:
    rows, cols = np.nonzero(visible)
    return set(zip((rows // bq).tolist(), (cols // bk).tolist(), strict=True))


def _random_tiling(rng: np.random.Generator) -> tuple[int, int, int, int, bool, tuple[int, int] | None]:
    t, s = int(rng.integers(1, 30)), int(rng.integers(1, 40))
    bq, bk = (int(x) for x in rng.integers(1, 10, 2))
    causal = bool(rng.integers(2))
    window = None if rng.integers(3) == 0 else (int(rng.integers(0, 12)), int(rng.integers(0, 12)))
    return t, s, bq, bk, causal, window


def test_plan_with_kv_lengths_covers_every_length() -> None:
    """The static tiling keeps a tile whenever some length 0..S can see a key in it (causal and the
    window's right edge still skip; its left edge does not)."""
    rng = np.random.default_rng(12)
    for _ in range(200):
        t, s, bq, bk, causal, window = _random_tiling(rng)
        tiling = block_tiling(t, s, bq, bk, causal=causal, window=window, kv_lengths=True)
        tiled = {(i, tiling.k_first[i] + n) for i in range(tiling.num_q) for n in range(tiling.k_count[i])}
        lengths = np.arange(s + 1)
        vis = oracle.visibility(s + 1, 1, t, s, causal=causal, sliding_window=window, kv_lengths=lengths)
        assert _tiles_of(vis.any(axis=(0, 1)), tiling.block_q, tiling.block_k) <= tiled, (t, s, bq, bk, causal, window)
    # Causal still skips the tiles above the S-aligned diagonal.
    tiling = block_tiling(64, 64, 16, 16, causal=True, kv_lengths=True)
    assert tiling.tiles_visited == 10


def test_run_time_ranges_are_safe_and_tight_for_one_sequence() -> None:
    """The tiles the loops visit for given lengths: every tile with a visible key (any batch),
    and only those for a batch of one (forward's key ranges and backward's query ranges)."""
    def visited(tiling: Any, causal: bool, window: tuple[int, int] | None, lengths: Any, xp: Any) -> list[Any]:
        first, last = key_block_ranges(tiling, lengths, causal=causal, window=window, xp=xp)
        return [np.asarray(x) for x in (first, last, *query_block_range(first, last, xp.arange(tiling.num_k), xp=xp))]

    rng = np.random.default_rng(13)
    for n in range(300):
        t, s, bq, bk, causal, window = _random_tiling(rng)
        tiling = block_tiling(t, s, bq, bk, causal=causal, window=window, kv_lengths=True)
        for lengths in (rng.integers(0, s + 1, 1), rng.integers(0, s + 1, 3)):
            # The rule on the host (NumPy); jnp (what the loops run) on a few, eagerly: it compiles
            # every primitive per shape.
            first, last, starts, counts = visited(tiling, causal, window, lengths.astype(np.int32), np)
            if n < 4:
                for mine, theirs in zip(visited(tiling, causal, window, jnp.asarray(lengths, jnp.int32), jnp),
                                        (first, last, starts, counts), strict=True):
                    np.testing.assert_array_equal(mine, theirs)
            backward = {(i, j) for j in range(tiling.num_k) for i in range(starts[j], starts[j] + counts[j])}
            forward = {(i, j) for i in range(tiling.num_q) for j in range(first[i], last[i] + 1)}
            vis = oracle.visibility(len(lengths), 1, t, s, causal=causal, sliding_window=window, kv_lengths=lengths)
            want = _tiles_of(vis.any(axis=(0, 1)), tiling.block_q, tiling.block_k)
            label = f"t={t} s={s} blocks={bq}x{bk} causal={causal} window={window} lengths={lengths.tolist()}"
            assert want <= forward and want <= backward, label
            if len(lengths) == 1:
                assert forward == want and backward == want, label


@pytest.mark.parametrize(("t", "s", "blocks", "lengths"), [
    (1, 29, (1, 4), (0, 29, 13)),  # decode: an empty sequence, a full one, one ending mid-block
    (3, 23, (2, 5), (2, 23, 9)),  # speculative decoding: length 2 < T leaves query 0 without keys
    (13, 31, (4, 8), (31, 5, 17)),  # a chunked prefill that ends inside the second query block
])
def test_kv_lengths_every_feature_against_the_oracle(t: int, s: int, blocks: tuple[int, int],
                                                      lengths: tuple[int, ...]) -> None:
    """Outputs, lse and every gradient with lengths that are not block multiples, combined with
    mask, bias, sinks, segment ids, soft cap, causal and a window (whose left edge moves)."""
    b, hq = len(lengths), 4
    q, k, v = _qkv(b=b, t=t, s=s, hq=hq, hkv=2, d=8, dv=6, seed=t)
    arrays = _every_feature(b, t, s, hq, seed=s)
    arrays["kv_lengths"] = np.asarray(lengths, np.int32)
    d_out = np.random.default_rng(14).normal(size=(b, t, hq, 6)).astype(np.float32)
    impl = BlockwiseAttention(jaxattn.AttentionMetadata(block_q=blocks[0], block_k=blocks[1]))
    for static in ({"causal": True}, {"causal": True, "sliding_window": (6, 1), "logits_soft_cap": 3.0},
                   {"sliding_window": (3, 4)}):
        def loss(q: Any, k: Any, v: Any, bias: Any, aux: Any, static: dict[str, Any] = static) -> tuple[Any, Any]:
            out = impl(q, k, v, mask=arrays["mask"], bias=bias, softmax_aux=aux, kv_lengths=arrays["kv_lengths"],
                       q_segment_ids=arrays["q_segment_ids"], kv_segment_ids=arrays["kv_segment_ids"], **static)
            return jnp.sum(out.attention_outputs * d_out), out

        grads, out = quick_jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
            q, k, v, arrays["bias"], arrays["softmax_aux"])
        ref = oracle.attention(q, k, v, **arrays, **static)
        label = f"{static} lengths={lengths}"
        _assert_close(out.attention_outputs, ref.output, 1e-5, f"output {label}")
        assert np.array_equal(np.isneginf(out.softmax_lse), np.isneginf(ref.lse)), label
        _assert_close(out.softmax_lse, ref.lse, 1e-5, f"lse {label}")
        back = oracle.attention_backward(q, k, v, d_out, **arrays, **static)
        for name, got, want in zip(("dq", "dk", "dv", "dbias", "daux"), grads,
                                   (back.dq, back.dk, back.dv, back.dbias, back.dsoftmax_aux), strict=True):
            assert want is not None
            _assert_close(got, want, 1e-4, f"{name} {label}")


def test_kv_lengths_traced_under_jit_clamped_and_vmapped() -> None:
    q, k, v = _qkv(b=2, t=3, s=20)
    impl = BlockwiseAttention(jaxattn.AttentionMetadata(block_q=2, block_k=6))
    run = quick_jit(lambda q, k, v, n: impl(q, k, v, causal=True, kv_lengths=n).attention_outputs)
    for given, meant in (([7, 20], [7, 20]), ([99, -3], [20, 0])):  # jit cannot check: clamped to 0..S
        want = oracle.attention(q, k, v, causal=True, kv_lengths=np.asarray(meant)).output
        _assert_close(run(q, k, v, jnp.asarray(given, jnp.int32)), want, 1e-5, str(given))
    # vmapped over an outer axis, lengths included (the run-time ranges become batched loops)
    lengths = np.array([[3, 11], [20, 0]], np.int32)
    qs, ks, vs = (np.stack([x, -x]) for x in (q, k, v))
    batched = quick_jit(jax.vmap(lambda q, k, v, n: impl(q, k, v, causal=True, kv_lengths=n).attention_outputs))(
        qs, ks, vs, lengths)
    for i in range(2):
        want = oracle.attention(qs[i], ks[i], vs[i], causal=True, kv_lengths=lengths[i]).output
        _assert_close(batched[i], want, 1e-5, f"vmap {i}")


def test_kv_lengths_memory_grows_linearly() -> None:
    """The per-tile masks come from the lengths: no (T, S) mask appears."""
    sizes = [_fwd_bwd_bytes("blockwise", t, BLOCKS_128, causal=True, kv_lengths=jnp.asarray([t - 5], jnp.int32))
             for t in (1024, 2048)]
    assert sizes[1] / sizes[0] < 2.05, sizes
    assert sizes[1] < 2048 * 2048 * 4, sizes


def test_kv_lengths_notes_say_tiles_are_skipped_at_run_time() -> None:
    q, k, v = _qkv(b=2, t=1, s=64)
    exp = jaxattn.explain(q, k, v, impl="blockwise", causal=True, kv_lengths=np.array([3, 40], np.int32))
    notes = " ".join(next(c for c in exp.candidates if c.name == "blockwise").notes)
    assert "at most" in notes and "skipped at run time" in notes


# -- dropout ---------------------------------------------------------------------------------
def test_dropout_gradients_use_the_forwards_keep_mask() -> None:
    """q = 0 and v = one-hot(key) make ``output * S * (1 - p)`` the keep-mask itself; with it
    the oracle's dropout gradients must match (the backward regenerates the same mask)."""
    b, t, s, h, p = 2, 12, 20, 2, 0.3
    rng = np.random.default_rng(9)
    q = np.zeros((b, t, h, 8), np.float32)
    k = rng.normal(size=(b, s, h, 8)).astype(np.float32)
    v = np.broadcast_to(np.eye(s, dtype=np.float32)[None, :, None, :], (b, s, h, s)).copy()
    d_out = rng.normal(size=(b, t, h, s)).astype(np.float32)
    key = jax.random.key(11)
    impl = BlockwiseAttention(jaxattn.AttentionMetadata(block_q=5, block_k=8))

    def loss(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        out = impl(q, k, v, dropout_prob=p, dropout_rng=key).attention_outputs
        return jnp.sum(out * d_out), out

    grads, out = quick_jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    keep = np.rint(np.asarray(out, np.float64) * s * (1 - p))
    assert set(np.unique(keep)) == {0.0, 1.0}
    keep_bhts = keep.astype(bool).transpose(0, 2, 1, 3)
    assert 0.55 < keep_bhts.mean() < 0.85
    back = oracle.attention_backward(q, k, v, d_out, dropout_prob=p, dropout_keep=keep_bhts)
    for name, g, want in zip(("dq", "dk", "dv"), grads, (back.dq, back.dk, back.dv), strict=True):
        _assert_close(g, want, 1e-4, name)
    # backward blocks other than the forward's would draw other masks: declined
    other = BlockwiseAttention(jaxattn.AttentionMetadata(block_q=5, block_k=8, block_q_bwd=4))
    reasons = other.supports(q, k, v, dropout_prob=p, dropout_rng=key)
    assert any("keep-mask is drawn per tile" in r for r in reasons), reasons


# -- the docs page ---------------------------------------------------------------------------
def test_docs_example_runs_and_prints_what_it_says() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "blockwise.md").read_text()
    code = "\n".join(body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", page, re.S | re.M) if lang == "python")
    promised = re.search(r"^print\(.*\)  # (.*)$", code, re.M)
    assert promised is not None
    # The example uses plain jax.jit: skip LLVM's expensive passes as quick_jit does.
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == promised.group(1)
