"""``flash_attn2`` (Triton) with a ``mask_mod``: packed bits and tile lists, forward and backward.

The mask_mod is evaluated in JAX (``flash.ops.mod_bits``: ``jaxattn.masks.mask_bits`` with the
call's own rules ANDed in: ``masks.call_bits``), each kernel classifies its own tiles from the
bits (``masks.tile_lists``), skips the empty ones, runs the full ones without mask arithmetic and
reads the bits in the partial ones. Checked here through the interpreter (``interpret=True``: the
JAX glue, the custom VJP and the very kernels, through a host callback) against the float64
oracle, under ``jax.jit``, with NaN at every key no query of its sequence and KV head sees
(never read). The JAX-only pieces (bits folding, lists at the kernels' tiles) are checked without
the interpreter.
Shapes are tiny and have tails (T and S not multiples of the tiles, S not of 32), GQA, and
kernels of different tiles (the forward's, dK/dV's and dQ's lists differ).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import masks
from jaxattn.testing import oracle
from jaxattn_triton.flash import launch as L
from jaxattn_triton.flash.launch import DQ_ATOMIC, KernelTiles, Tiles
from jaxattn_triton.flash.ops import flash_attention, make_spec, mod_bits, tile_lists

from ._env import BF16_DOT_OK, ON_CUDA, needs_interpreter

B, T, S, HQ, HKV, D = 2, 21, 45, 4, 2, 16
Dims = tuple[int, int, int, int, int, int]  # (B, T, S, Hq, Hkv, D)
#: Three kernels, three tilings: the forward's (16 x 16), dK/dV's (16 x 32) and dQ's (32 x 16).
TILES = Tiles(KernelTiles(16, 16, 4, 1), KernelTiles(16, 32, 4, 1), KernelTiles(32, 16, 4, 1))
ATOL = 2e-5

IDS = np.stack([np.repeat([0, 1, 2], [15, 17, 13]), np.repeat([0, 1], [9, 36])]).astype(np.int32)  # (B, S)

#: name -> (arrays -> mask_mod): every constructor, compositions and a user function of b and h.
RECIPES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "causal": lambda a: masks.causal(),
    "sliding_window": lambda a: masks.sliding_window(5, 2),
    "chunked_causal": lambda a: masks.chunked_causal(8),
    "prefix_lm": lambda a: masks.prefix_lm(a["prefix"]),
    "document": lambda a: masks.and_(masks.causal(), masks.document(a["ids_q"], a["ids"])),
    "and_or": lambda a: masks.or_(masks.and_(masks.sliding_window(3, 0), masks.document(a["ids_q"], a["ids"])),
                                  lambda b, h, q, kv: kv < 2),
    # Per sequence and KV head every fourth key is hidden from every query (poisoned below).
    "lambda_bh": lambda a: lambda b, h, q, kv: ((kv + b + h // 2) % 4 != 3) & (q + h >= kv - 20 * b),
}


def _arrays(seed: int = 0, dims: Dims = (B, T, S, HQ, HKV, D), dtype: Any = np.float32) -> dict[str, Any]:
    b, t, s, hq, hkv, d = dims
    rng = np.random.default_rng(seed)
    ids = IDS if dims[:3] == (B, T, S) else np.sort(rng.integers(0, 6, (b, s)), axis=1).astype(np.int32)

    def normal(*shape: int) -> np.ndarray:  # rounded to the dtype: the oracle sees what the kernel does
        return rng.standard_normal(shape).astype(dtype).astype(np.float32)

    return {
        "q": normal(b, t, hq, d), "k": normal(b, s, hkv, d), "v": normal(b, s, hkv, d), "dout": normal(b, t, hq, d),
        "prefix": np.asarray([4, s - 15] + [1] * (b - 2), np.int32), "ids": ids, "ids_q": ids[:, s - t:],
    }  # fmt: skip


def _poison(a: dict[str, Any], visible: np.ndarray, hkv: int) -> dict[str, Any]:
    """k and v with NaN at every key no query of its sequence and KV head sees."""
    b, hq, t, s = visible.shape
    unseen = ~visible.reshape(b, hkv, hq // hkv, t, s).any(axis=(2, 3))  # (B, Hkv, S)
    out = dict(a)
    for name in ("k", "v"):
        out[name] = np.where(np.transpose(unseen, (0, 2, 1))[..., None], np.nan, a[name]).astype(np.float32)
    return out


def _check(recipe: Callable[[dict[str, Any]], Any], tiles: Tiles | None = TILES, seed: int = 0, *,
           block_mask: bool = False, dims: Dims = (B, T, S, HQ, HKV, D), dtype: str = "float32",
           **features: Any) -> None:
    """Forward, lse and (dq, dk, dv) under jit, unseen keys poisoned, against the oracle; the
    mask_mod's captured arrays traced (built inside the program, as in a model). On a GPU
    (``ON_CUDA``) the kernels run natively, at ``tiles=None`` the tuned tiles."""
    from jaxattn.testing.cases import DEFAULT_TOLERANCES
    from jaxattn.testing.compare import assert_close

    tol = DEFAULT_TOLERANCES[dtype]
    a = _arrays(seed, dims, jnp.dtype(dtype))
    np_mod = recipe(a)
    ref = oracle.attention(a["q"], a["k"], a["v"], mask_mod=np_mod, **features)
    back = oracle.attention_backward(a["q"], a["k"], a["v"], a["dout"], mask_mod=np_mod, **features)
    p = _poison(a, ref.visible, dims[4])
    traced = {n: jnp.asarray(p[n]) for n in ("prefix", "ids", "ids_q")}

    @jax.jit
    def run(q: jax.Array, k: jax.Array, v: jax.Array, caps: dict[str, jax.Array]) -> Any:
        mod = recipe(caps)
        bm = masks.block_mask(mod, dims[0], dims[3], dims[1], dims[2], block_q=8, block_kv=8, bits=True) \
            if block_mask else None

        def f(q: jax.Array, k: jax.Array, v: jax.Array) -> Any:
            return flash_attention(q, k, v, mask_mod=mod, block_mask=bm, tiles=tiles, interpret=not ON_CUDA,
                                   **features)

        (out, lse), vjp = jax.vjp(f, q, k, v)
        return out, lse, vjp((jnp.asarray(a["dout"], dtype), jnp.zeros_like(lse)))

    out, lse, grads = run(*(jnp.asarray(p[n], dtype) for n in "qkv"), traced)
    assert_close("out", out, ref.output, tol.forward)
    seen = np.isfinite(ref.lse)
    assert_close("lse", np.asarray(lse)[seen], ref.lse[seen], tol.forward)
    assert np.all(np.asarray(lse)[~seen] == -np.inf), "a row that sees nothing has lse -inf"
    for name, got, want in zip(("dq", "dk", "dv"), grads, (back.dq, back.dk, back.dv), strict=True):
        assert np.isfinite(np.asarray(got, np.float32)).all(), f"{name}: NaN from an unseen key"
        assert_close(name, got, want, tol.grad)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
@pytest.mark.parametrize("name", list(RECIPES))
def test_each_mask_mod_forward_and_backward_match_the_oracle(name: str) -> None:
    _check(RECIPES[name])


@needs_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_rows_that_see_nothing_give_zeros_and_no_nan() -> None:
    # Every fifth query sees no key; in sequence 1 so does every query of head 3.
    _check(lambda a: lambda b, h, q, kv: (q % 5 != 0) & (kv <= q + 3) & ((b == 0) | (h != 3)), seed=1)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_combined_by_and_with_the_kernels_own_rules() -> None:
    # Bottom-right causal (T < S) and a window, segment ids and a boolean mask are ANDed into the
    # bits; a soft cap, a bias and sinks stay the kernels'; dQ by atomic adds, dK/dV split.
    rng = np.random.default_rng(5)
    kt = KernelTiles(16, 16, 4, 1)
    tiles = Tiles(KernelTiles(16, 32, 4, 1), kt, kt, dq_mode=DQ_ATOMIC, dkdv_split=True)
    features = {
        "causal": True, "sliding_window": (30, 0), "logits_soft_cap": 4.0,
        "q_segment_ids": IDS[:, S - T:], "kv_segment_ids": IDS,
        "mask": rng.random((1, HQ, T, S)) > 0.15,
        "bias": rng.standard_normal((HQ, 1, S)).astype(np.float32),
        "softmax_aux": rng.standard_normal(HQ).astype(np.float32),
    }  # fmt: skip
    _check(RECIPES["lambda_bh"], tiles, seed=2, **features)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_a_block_masks_bits_are_read_whatever_its_blocks() -> None:
    # Built with bits=True at 8 x 8 (no kernel's tiles): its bits are used, the kernels classify
    # their own tiles from them.
    _check(RECIPES["document"], seed=3, block_mask=True)
    # They are what the kernels read: a block mask of another rule wins over the mask_mod.
    a = _arrays(3)
    bm = masks.block_mask(masks.causal(), 1, 1, T, S, bits=True)
    out, _ = flash_attention(*(jnp.asarray(a[n]) for n in "qkv"), mask_mod=lambda b, h, q, kv: q >= 0,
                             block_mask=bm, tiles=TILES, interpret=True)
    ref = oracle.attention(a["q"], a["k"], a["v"], mask_mod=masks.causal())
    np.testing.assert_allclose(np.asarray(out), ref.output, atol=ATOL, rtol=ATOL)


def _check_alibi(recipe: Callable[[dict[str, Any]], Any] | None, tiles: Tiles | None = TILES, seed: int = 4, *,
                 dims: Dims = (B, T, S, HQ, HKV, D), dtype: str = "float32", **features: Any) -> None:
    """masks.alibi's score_mod (with a mask_mod or none) under jit, its slopes traced, against the
    oracle: out, lse, dq, dk, dv and the slopes' gradient, unseen keys poisoned."""
    from jaxattn.testing.cases import DEFAULT_TOLERANCES
    from jaxattn.testing.compare import assert_close

    tol = DEFAULT_TOLERANCES[dtype]
    a = _arrays(seed, dims, jnp.dtype(dtype))
    slopes = np.exp2(-np.arange(1, dims[3] + 1) / 2).astype(np.float32)  # ALiBi: positive, 2^(-h / 2)
    mods = {} if recipe is None else {"mask_mod": recipe(a)}
    ref = oracle.attention(a["q"], a["k"], a["v"], score_mod=masks.alibi, score_params=slopes, **mods, **features)
    back = oracle.attention_backward(a["q"], a["k"], a["v"], a["dout"], score_mod=masks.alibi, score_params=slopes,
                                     **mods, **features)  # fmt: skip
    p = _poison(a, ref.visible, dims[4]) if recipe is not None else a

    @jax.jit
    def run(q: jax.Array, k: jax.Array, v: jax.Array, sl: jax.Array, caps: dict[str, jax.Array]) -> Any:
        mod = {} if recipe is None else {"mask_mod": recipe(caps)}

        def f(q: jax.Array, k: jax.Array, v: jax.Array, sl: jax.Array) -> Any:
            return flash_attention(q, k, v, alibi_slopes=sl, tiles=tiles, interpret=not ON_CUDA, **mod, **features)

        (out, lse), vjp = jax.vjp(f, q, k, v, sl)
        return out, lse, vjp((jnp.asarray(a["dout"], dtype), jnp.zeros_like(lse)))

    caps = {n: jnp.asarray(p[n]) for n in ("prefix", "ids", "ids_q")}
    out, lse, grads = run(*(jnp.asarray(p[n], dtype) for n in "qkv"), jnp.asarray(slopes), caps)
    assert_close("out", out, ref.output, tol.forward)
    seen = np.isfinite(ref.lse)
    assert_close("lse", np.asarray(lse)[seen], ref.lse[seen], tol.forward)
    for name, got, want in zip(("dq", "dk", "dv", "dslopes"), grads, (back.dq, back.dk, back.dv, back.dscore_params),
                               strict=True):  # fmt: skip
        assert np.isfinite(np.asarray(got, np.float32)).all(), f"{name}: NaN from an unseen key"
        assert_close(name, got, want, tol.grad)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_alibi_in_the_kernels_matches_the_oracle_with_its_slopes_gradient() -> None:
    # Raw positions with T < S (the scores' (kv_idx - q_idx) is not the causal diagonal's), after
    # a soft cap and a bias; without a mask_mod (the kernels' own tile ranges: causal, bottom-right),
    # dQ by atomic adds and dK/dV split; then with a mask_mod's lists (tiles differ per kernel).
    kt = KernelTiles(16, 16, 4, 1)
    split = Tiles(KernelTiles(16, 32, 4, 1), kt, kt, dq_mode=DQ_ATOMIC, dkdv_split=True)
    rng = np.random.default_rng(6)
    _check_alibi(None, split, causal=True, logits_soft_cap=4.0,
                 bias=rng.standard_normal((HQ, 1, S)).astype(np.float32))
    _check_alibi(RECIPES["document"])


@needs_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_alibi_gradients_through_the_lse_and_sinks_match_vanilla() -> None:
    # The slopes' gradient reads the lse cotangent's term (preprocess's lse_term) and the sinks'
    # share of each row: against jax.grad of the vanilla reference, in float32.
    a = _arrays(9)
    rng = np.random.default_rng(9)
    sinks = jnp.asarray(rng.standard_normal(HQ), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal((B, HQ, T)), jnp.float32)
    slopes = jnp.asarray(np.exp2(-np.arange(1, HQ + 1) / 2), jnp.float32)

    def loss(run: Callable[..., Any]) -> Callable[..., Any]:
        def f(q: jax.Array, k: jax.Array, v: jax.Array, sl: jax.Array) -> jax.Array:
            out, lse = run(q, k, v, sl)
            return jnp.sum(out * jnp.asarray(a["dout"])) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))

    def triton(q: jax.Array, k: jax.Array, v: jax.Array, sl: jax.Array) -> Any:
        return flash_attention(q, k, v, alibi_slopes=sl, causal=True, softmax_aux=sinks, tiles=TILES, interpret=True)

    def vanilla(q: jax.Array, k: jax.Array, v: jax.Array, sl: jax.Array) -> Any:
        res = jaxattn.get_impl("vanilla")(q, k, v, causal=True, softmax_aux=sinks, score_mod=masks.alibi(sl),
                                          return_lse=True)  # fmt: skip
        return res.attention_outputs, res.softmax_lse

    args = (*(jnp.asarray(a[n]) for n in "qkv"), slopes)
    for name, got, want in zip(("dq", "dk", "dv", "dslopes"), loss(triton)(*args), loss(vanilla)(*args), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=2e-4, err_msg=name)


@needs_interpreter
@pytest.mark.skipif(not BF16_DOT_OK, reason="this triton's interpreter multiplies bf16 bits as ints")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_alibi_slopes_gradient_is_exact_in_bfloat16() -> None:
    # Rows see keys up to 40 positions ahead (T < S, raw positions), where ALiBi weighs them most:
    # a slope's gradient from rowsum(dO * O) of the bf16 output would be ~15% off here.
    _check_alibi(None, dims=(1, 100, 140, 4, 2, 32), dtype="bfloat16", causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU (the Triton kernels run natively)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["document", "lambda_bh", "prefix_lm", "combined"])
def test_on_a_gpu_at_the_tuned_tiles(name: str, dtype: str) -> None:
    # The tuned tiles (256 x 64 forward at D 128, ...) with tails everywhere: T and S not multiples
    # of them, nor S of 32; GQA; a head dim of 128.
    dims: Dims = (2, 1000, 1100, 8, 2, 128)
    features: dict[str, Any] = {}
    if name == "combined":
        a = _arrays(7, dims)
        rng = np.random.default_rng(7)
        features = {"causal": True, "logits_soft_cap": 20.0, "q_segment_ids": a["ids_q"], "kv_segment_ids": a["ids"],
                    "bias": rng.standard_normal((8, 1, 1100)).astype(np.float32),
                    "softmax_aux": rng.standard_normal(8).astype(np.float32)}
    _check(RECIPES["lambda_bh" if name == "combined" else name], None, 7, dims=dims, dtype=dtype, **features)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU (the Triton kernels run natively)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["causal", "document"])
def test_alibi_on_a_gpu_at_the_tuned_tiles(name: str, dtype: str) -> None:
    dims: Dims = (2, 1000, 1100, 8, 2, 128)
    if name == "causal":
        _check_alibi(None, None, 8, dims=dims, dtype=dtype, causal=True, logits_soft_cap=20.0)
    else:
        _check_alibi(RECIPES["document"], None, 8, dims=dims, dtype=dtype)


# -- the JAX side alone (no interpreter) --------------------------------------------------------


def _unpack(bits: Any, s: int) -> np.ndarray:
    words = np.asarray(bits).view(np.uint32)
    return (((words[..., None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(*words.shape[:-1], -1) != 0)[..., :s]


def test_mod_bits_fold_the_calls_rules_into_the_mask_mods() -> None:
    rng = np.random.default_rng(0)
    q, k = jnp.zeros((B, T, HQ, D)), jnp.zeros((B, S, HKV, D))
    mod = RECIPES["lambda_bh"](_arrays())
    mask = rng.random((B, 1, 1, S)) > 0.3
    features = {"causal": True, "sliding_window": (9, 3), "mask": jnp.asarray(mask),
                "q_segment_ids": jnp.asarray(IDS[:, :T]), "kv_segment_ids": jnp.asarray(IDS)}
    bits = mod_bits(q, k, mod, **features)
    assert bits.dtype == jnp.int32 and bits.shape == (B, HQ, T, 2)
    want = oracle.attention(np.zeros((B, T, HQ, D)), np.zeros((B, S, HKV, D)), np.zeros((B, S, HKV, D)),
                            mask_mod=mod, **{n: np.asarray(x) for n, x in features.items()}).visible
    np.testing.assert_array_equal(np.broadcast_to(_unpack(bits, S), want.shape), want)
    # A rule of neither b nor h keeps the bits (1, 1, T, words); a block mask lends its bits.
    assert mod_bits(q, k, masks.causal()).shape == (1, 1, T, 2)
    lent = masks.block_mask(masks.causal(), 1, 1, T, S, bits=True)
    np.testing.assert_array_equal(mod_bits(q, k, masks.sliding_window(1), lent), lent.bits)


def test_tile_lists_are_the_cores_at_each_kernels_tiles_in_launchs_shape() -> None:
    # What the lists hold is tested with jaxattn.masks.tile_lists; here, the kernels' own sizes.
    mod = RECIPES["document"](_arrays())
    q, k = jnp.zeros((B, T, HQ, D)), jnp.zeros((B, S, HKV, D))
    bits = mod_bits(q, k, mod)
    spec = make_spec(q, k, k, mod_shape=(int(bits.shape[0]), int(bits.shape[1])))
    for kt, by_keys in ((TILES.fwd, False), (TILES.dkdv, True), (TILES.dq, False)):
        lists = np.asarray(tile_lists(spec, kt, bits, by_keys))
        assert lists.shape == L.mod_lists_shape(spec, kt, by_keys)
        want = masks.tile_lists(bits, S, block_q=kt.block_m, block_kv=kt.block_n, by_keys=by_keys)
        np.testing.assert_array_equal(lists, want)
    assert tile_lists(make_spec(q, k, k), TILES.fwd, bits).shape == (1,)  # no mask_mod: a dummy


# -- the impl: declared, declines, explain ------------------------------------------------------


@pytest.mark.usefixtures("kernels_installed")
def test_the_impl_takes_mask_mods_declines_score_mods_and_explains_its_tiles() -> None:
    from jaxattn.backend import AttentionProblem, DeviceInfo, Feature
    from jaxattn_triton.flash.impl import TritonFlashAttention

    h200 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H200", compute_capability="9.0")
    impl = TritonFlashAttention(jaxattn.AttentionMetadata(), h200)
    assert Feature.MASK_MOD in impl.features and Feature.SCORE_MOD in impl.features  # masks.alibi only
    sizes = {"batch": 1, "seq_q": 256, "seq_k": 256, "heads_q": 8, "heads_kv": 2, "head_dim": 64,
             "head_dim_v": 64, "dtype": "bfloat16"}
    problem = AttentionProblem(**sizes, mask_mod=True, causal=True, segment_ids=True, needs_grad=True)  # type: ignore[arg-type]
    assert impl.not_supported_reasons(problem) == []
    assert any("packed bits" in n and "empty tiles skipped" in n for n in impl.notes(problem))
    reasons = impl.not_supported_reasons(AttentionProblem(**sizes, score_mod=True))  # type: ignore[arg-type]
    assert any("cannot execute a traced JAX function" in r and "masks.alibi" in r for r in reasons), reasons
    alibi = AttentionProblem(**sizes, score_mod=True, score_mod_alibi=True, causal=True, needs_grad=True)  # type: ignore[arg-type]
    assert impl.not_supported_reasons(alibi) == []
    assert any("masks.alibi" in n and "in registers" in n for n in impl.notes(alibi))
    for mods in ({"mask_mod": True}, {"score_mod": True, "score_mod_alibi": True}):
        reasons = impl.not_supported_reasons(AttentionProblem(**{**sizes, "seq_q": 1}, **mods, kv_lengths=True))  # type: ignore[arg-type]
        assert any("kv_lengths with a mask_mod or score_mod" in r for r in reasons), reasons
    # explain's call line shows the mask_mod's block sparsity.
    q = jax.ShapeDtypeStruct((1, 256, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    mod = masks.and_(masks.causal(), masks.document(jnp.repeat(jnp.arange(4), 64)[None]))
    text = str(jaxattn.explain(q, k, k, impl="flash_attn2", mask_mod=mod,
                               metadata=jaxattn.AttentionMetadata(platform="cuda")))
    assert "mask_mod tiles 128x128: 2 empty, 2 partial, 0 full" in text, text
