"""The Mosaic GPU kernels lowered for an NVIDIA GPU, on any host (a CPU in CI).

Mosaic GPU kernels run only on a Hopper GPU, but jax lowers them for another platform than
the host's (``lower(lowering_platforms=("cuda",))``): the kernel body becomes Mosaic GPU IR,
through the layouts of every register tile and Mosaic GPU's shared-memory budget, everything
short of ptxas. So CI catches a kernel that would not build (a wrong layout, an op the
dialect lacks, tiles past the 227 KiB of shared memory) for every head dim, mask, length and
configuration, and the plugin's impl as a GPU user calls it, differentiated too, where the GPU
tests run only now and then. Numerics stay with tests/mosaic's GPU tests.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from jaxattn.backend.device import DeviceInfo
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn_mosaic import backward_kernel as KB
from jaxattn_mosaic import kernel as K
from jaxattn_mosaic.impl import MosaicFlashAttention

#: (T, S, Hq, Hkv): odd lengths with GQA, T > S (rows that see no key), one query over a key
#: shorter than a block.
SHAPES = [(333, 517, 4, 2), (640, 384, 4, 1), (1, 77, 2, 2)]


def _spec(t: int, h: int, d: int, dtype: Any = jnp.bfloat16) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((1, t, h, d), dtype)


def _lowered(fn: Any, *args: jax.ShapeDtypeStruct) -> str:
    text: str = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text


def _forward(causal: bool, config: K.Config | None = None, **kw: Any) -> Any:
    def run(q: Any, k: Any, v: Any) -> Any:
        return K.mosaic_attention_forward(q, k, v, causal=causal, softmax_scale=0.125, config=config, **kw)

    return run


def _backward(causal: bool, config: KB.BackwardConfig | None = None) -> Any:
    def run(q: Any, k: Any, v: Any, lse: Any) -> Any:
        return KB.mosaic_attention_backward(q, k, v, q, lse, q, lse, causal=causal, softmax_scale=0.125,
                                            config=config)

    return run


def _kernels(text: str) -> int:
    """Mosaic GPU kernels in a lowered program: custom calls carrying a Mosaic GPU module."""
    return text.count("custom_call @mosaic_gpu")


def _is_mosaic_gpu(text: str) -> bool:
    return _kernels(text) == 1


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", sorted(K.HEAD_DIMS))
@pytest.mark.parametrize(("t", "s", "hq", "hkv"), SHAPES)
def test_forward_lowers_at_its_default_tiles(t: int, s: int, hq: int, hkv: int, d: int, causal: bool) -> None:
    assert _is_mosaic_gpu(_lowered(_forward(causal), _spec(t, hq, d), _spec(s, hkv, d), _spec(s, hkv, d)))


def test_the_default_schedule_is_persistent_where_its_tiles_fit() -> None:
    # Two Q slots and an output tile per consumer beside the K/V ring: D <= 128 below 16k keys.
    for d, causal, kv_len in ((64, False, 4096), (128, False, 1024), (128, True, 8192), (64, True, 0)):
        cfg = K.default_config(d, causal=causal, kv_len=kv_len)
        assert cfg.persistent and cfg.q_double and cfg.scheduled, (d, causal, kv_len)
        assert cfg.q_group == 0  # all of a head's query tiles in turn
    for d, causal, kv_len in ((256, False, 4096), (256, True, 1024), (128, False, K.WIDE_KV_FROM),
                              (128, True, K.WIDE_KV_FROM), (64, True, K.WIDE_KV_FROM), (64, False, 32768)):
        cfg = K.default_config(d, causal=causal, kv_len=kv_len)
        assert not cfg.persistent and not cfg.scheduled, (d, causal, kv_len)
    # Tiles given (AttentionMetadata's block sizes) keep the schedule only where it still fits.
    assert not K.default_config(128, kv_len=4096, block_kv=192).persistent
    assert K.default_config(128, kv_len=4096, block_kv=64, stages=3).persistent


def test_a_short_last_round_is_split_by_keys_and_merged_for_full_attention_only() -> None:
    # 12 tiles on 132 SMs, 5 key blocks: each tile in 2 pieces, whose float32 outputs and LSEs
    # the kernel returns beside its own (4 results) and a scatter merges. Causal: never cut.
    t, s, hq, hkv = SHAPES[0]
    args = (_spec(t, hq, 128), _spec(s, hkv, 128), _spec(s, hkv, 128))
    assert K.default_config(128, kv_len=s).split_tail
    assert not K.default_config(128, kv_len=K.WIDE_KV_FROM).split_tail  # one CTA per tile: measured slower
    full, causal = _lowered(_forward(False), *args), _lowered(_forward(True), *args)
    assert "tensor<24x128x128xf32>" in full and "scatter" in full
    assert "x128x128xf32>" not in causal and "scatter" not in causal
    off = _lowered(_forward(False, K.Config(persistent=True, q_double=True)), *args)
    assert "scatter" not in off
    # One CTA per tile: a 1-D grid of 12 tiles in 2 pieces each (24 CTAs), merged the same way.
    flat = _lowered(_forward(False, K.Config(split_tail=True)), *args)
    assert "tensor<24x128x128xf32>" in flat and "scatter" in flat


def test_forward_lowers_in_float16_and_over_16k_keys() -> None:
    # float16, and the 64x192 tiles a full forward takes from 16k keys.
    q, kv = _spec(128, 2, 128, jnp.float16), _spec(K.WIDE_KV_FROM, 2, 128, jnp.float16)
    assert K.default_config(128, causal=False, kv_len=K.WIDE_KV_FROM).block_kv == 192
    assert _is_mosaic_gpu(_lowered(_forward(False), q, kv, kv))


#: The configurations the benchmark's ablations time (tests/mosaic/test_gpu.py runs them).
CONFIGS = [K.Config(pingpong=False), K.Config(overlap=True), K.Config(overlap=True, stages=3),
           K.Config(overlap=True, pingpong=False), K.Config(block_kv=192), K.Config(stages=3),
           K.Config(block_kv=64, stages=4), K.Config(exp2_fma_cols=64), K.Config(block_kv=192, exp2_fma_cols=128),
           K.Config(lean_barriers=True), K.Config(block_kv=192, lean_barriers=True), K.Config(pass_turns=True),
           K.Config(named_barriers=True), K.Config(pass_turns=True, named_barriers=True),
           K.Config(block_kv=192, pass_turns=True, named_barriers=True, lean_barriers=True),
           K.Config(overlap=True, named_barriers=True), K.Config(pingpong=False, named_barriers=True),
           K.Config(block_kv=64, stages=5, pass_turns=True, named_barriers=True), K.Config(store_read_wait=True),
           K.Config(persistent=True), K.Config(persistent=True, ctas=3, pass_turns=True, named_barriers=True),
           K.Config(block_kv=192, persistent=True), K.Config(persistent=True, q_group=1),
           K.Config(persistent=True, q_double=True), K.Config(persistent=True, ctas=3, q_double=True, pass_turns=True),
           K.Config(persistent=True, ctas=3, q_group=2, q_double=True),
           K.Config(persistent=True, q_double=True, split_tail=True),
           K.Config(persistent=True, ctas=5, split_tail=True), K.Config(split_tail=True),
           K.Config(block_kv=192, split_tail=True), K.Config(persistent=True, q_double=True, scheduled=True),
           K.Config(persistent=True, ctas=3, scheduled=True, pass_turns=True)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_forward_configurations_lower(config: K.Config, causal: bool) -> None:
    t, s, hq, hkv = SHAPES[0]
    assert _is_mosaic_gpu(_lowered(_forward(causal, config), _spec(t, hq, 128), _spec(s, hkv, 128),
                                   _spec(s, hkv, 128)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", sorted(KB.HEAD_DIMS))
@pytest.mark.parametrize(("t", "s", "hq", "hkv"), SHAPES)
def test_backward_lowers(t: int, s: int, hq: int, hkv: int, d: int, causal: bool) -> None:
    lse = jax.ShapeDtypeStruct((1, hq, t), jnp.float32)
    text = _lowered(_backward(causal), _spec(t, hq, d), _spec(s, hkv, d), _spec(s, hkv, d), lse)
    assert _kernels(text) == 2  # dQ, then dK/dV


def test_schedules_that_cannot_run_are_refused() -> None:
    for bad, why in (({"pass_turns": True, "overlap": True}, "pass_turns"),
                     ({"pass_turns": True, "pingpong": False}, "pass_turns"),
                     ({"named_barriers": True, "stages": 6}, "at most 5"),
                     ({"persistent": True, "overlap": True}, "persistent"), ({"ctas": -1}, "ctas"),
                     ({"q_double": True}, "q_double"), ({"q_group": -1}, "q_group"),
                     ({"scheduled": True}, "scheduled")):
        with pytest.raises(ValueError, match=why):
            K.Config(**bad)  # type: ignore[arg-type]


def test_named_barriers_are_the_ptx_of_a_named_barrier() -> None:
    # The consumed slots (384 threads: two consumers and the producer) and the turns (256: one
    # consumer passes, the other waits), as inline PTX with the barrier id in a register.
    t, s, hq, hkv = SHAPES[0]
    text = _lowered(_forward(True, K.Config(pass_turns=True, named_barriers=True)), _spec(t, hq, 128),
                    _spec(s, hkv, 128), _spec(s, hkv, 128))
    for ptx in ("bar.arrive $0, 384;", "bar.sync $0, 384;", "bar.arrive $0, 256;", "bar.sync $0, 256;"):
        assert ptx in text
    assert "bar.sync $0, 384;" not in _lowered(_forward(True), _spec(t, hq, 128), _spec(s, hkv, 128),
                                               _spec(s, hkv, 128))


def test_tiles_past_the_shared_memory_are_refused_when_lowering() -> None:
    # What the GPU refused before (docs/bench.md): 64x256 tiles with 3 stages at D = 128, and
    # the dQ kernel's 64x128 tiles with 3 stages. Lowering alone refuses them too.
    t, s, hq, hkv = SHAPES[0]
    q, kv = _spec(t, hq, 128), _spec(s, hkv, 128)
    with pytest.raises(ValueError, match="shared memory"):
        _lowered(_forward(True, K.Config(block_kv=256, stages=3)), q, kv, kv)
    lse = jax.ShapeDtypeStruct((1, hq, t), jnp.float32)
    big_dq = KB.BackwardConfig(KB.Tiles(64, 128, 3), KB.Tiles(64, 64, 3))
    with pytest.raises(ValueError, match="shared memory"):
        _lowered(_backward(True, big_dq), q, kv, kv, lse)


H100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")


@pytest.mark.parametrize("backward", ["auto", "own"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("t", "s", "hq", "hkv", "d"), [(333, 517, 4, 2, 128), (256, 256, 4, 4, 64)])
def test_the_impl_differentiated_lowers(t: int, s: int, hq: int, hkv: int, d: int, causal: bool, backward: str) -> None:
    # The plugin's own path, as a GPU user calls it: the impl for an H100 (its routing to the
    # forward, the custom gradient and the backward chosen per call), under jax.grad and jit,
    # a loss through the output and the lse. Its three kernels: forward, dQ, dK/dV.
    impl = MosaicFlashAttention(AttentionMetadata(extra={"mosaic_backward": backward}), H100)

    def loss(q: Any, k: Any, v: Any) -> Any:
        res = impl(q, k, v, causal=causal)
        return res.attention_outputs.astype(jnp.float32).sum() + res.softmax_lse.sum()

    text = _lowered(jax.grad(loss, argnums=(0, 1, 2)), _spec(t, hq, d), _spec(s, hkv, d), _spec(s, hkv, d))
    assert _kernels(text) == 3  # the forward once, dQ, dK/dV


def test_the_impl_lowers_with_tiles_from_metadata() -> None:
    impl = MosaicFlashAttention(AttentionMetadata(block_q=64, block_k=64, num_stages=3), H100)
    q, kv = _spec(333, 4, 128), _spec(517, 2, 128)
    assert _is_mosaic_gpu(_lowered(lambda q, k, v: impl(q, k, v, causal=True).attention_outputs, q, kv, kv))


@pytest.mark.parametrize("config", [None, K.Config(overlap=True), K.Config(block_kv=192), K.Config(persistent=True,
                                                                                                  q_double=True)],
                         ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_a_soft_cap_lowers_in_the_forward(config: K.Config | None, causal: bool) -> None:
    # The capped scores in the loop (tanh from exp2: no tanh.approx), in each schedule.
    t, s, hq, hkv = SHAPES[0]
    q, kv = _spec(t, hq, 128), _spec(s, hkv, 128)

    def capped(q: Any, k: Any, v: Any) -> Any:
        return K.mosaic_attention_forward(q, k, v, causal=causal, softmax_scale=0.125, soft_cap=30.0, config=config)

    text = _lowered(capped, q, kv, kv)
    assert _is_mosaic_gpu(text) and "tanh" not in text
    assert text != _lowered(_forward(causal, config), q, kv, kv)


@pytest.mark.parametrize("causal", [False, True])
def test_a_soft_cap_lowers_in_the_backward_which_the_impl_takes_at_any_length(causal: bool) -> None:
    # Both backward kernels with the cap; the impl differentiated with a cap takes them (cuDNN's
    # backward has no cap) even at 8192 keys, where an uncapped call takes cuDNN's.
    t, s, hq, hkv = SHAPES[0]
    q, kv = _spec(t, hq, 128), _spec(s, hkv, 128)

    def backward(q: Any, k: Any, v: Any, lse: Any) -> Any:
        return KB.mosaic_attention_backward(q, k, v, q, lse, q, lse, causal=causal, softmax_scale=0.125, soft_cap=30.0)

    lse = jax.ShapeDtypeStruct((1, hq, t), jnp.float32)
    assert _kernels(_lowered(backward, q, kv, kv, lse)) == 2
    impl = MosaicFlashAttention(AttentionMetadata(), H100)

    def loss(q: Any, k: Any, v: Any) -> Any:
        return impl(q, k, v, causal=causal, logits_soft_cap=30.0).attention_outputs.astype(jnp.float32).sum()

    long_kv = _spec(8192, hkv, 128)
    assert _kernels(_lowered(jax.grad(loss, argnums=(0, 1, 2)), _spec(256, hq, 128), long_kv, long_kv)) == 3


@pytest.mark.parametrize("config", [None, K.Config(), K.Config(block_kv=192), K.Config(
    persistent=True, ctas=3, q_double=True, scheduled=True, pass_turns=True, named_barriers=True)], ids=str)
@pytest.mark.parametrize(("causal", "window"), [(True, (100, 0)), (False, (64, 200)), (False, (0, None))])
def test_a_sliding_window_lowers_in_the_forward(config: K.Config | None, causal: bool,
                                                 window: tuple[int, int | None]) -> None:
    # A band of key blocks per tile (masked at both edges, consumer 1 releasing the blocks left of
    # its rows), in each schedule; windows that hide nothing are no window.
    t, s, hq, hkv = SHAPES[0]
    q, kv = _spec(t, hq, 128), _spec(s, hkv, 128)
    text = _lowered(_forward(causal, config, sliding_window=window), q, kv, kv)
    assert _is_mosaic_gpu(text)
    assert text != _lowered(_forward(causal, config), q, kv, kv)


def test_window_sides_that_hide_nothing_are_no_window() -> None:
    # At least max(T, S) keys on a side hides none: the kernels then run as without a window
    # (the same tiles and loops). Two lowerings are not compared as text: jax 0.11's Mosaic GPU
    # modules differ from one lowering of a function to the next.
    from jaxattn_mosaic.blocks import window_sides

    assert window_sides((517, 10**12), 333, 517) == (None, None)
    assert window_sides((516, 333), 333, 517) == (516, 333)
    assert window_sides(None, 1, 1) == (None, None)
    assert K.default_config(128, causal=True, kv_len=16384, window=(None, None)) == K.default_config(
        128, causal=True, kv_len=16384)
    # The keys a row sees choose the tiles and the schedule: a band of 2049 keys in 16k is persistent.
    windowed = K.default_config(128, kv_len=16384, window=(1024, 1024))
    assert windowed.persistent and windowed.block_kv == 128
    with pytest.raises(ValueError, match=">= 0"):
        window_sides((-1, 0), 4, 4)


def test_a_sliding_window_is_refused_by_the_overlapped_loop() -> None:
    t, s, hq, hkv = SHAPES[0]
    with pytest.raises(ValueError, match="takes no sliding window"):
        _lowered(_forward(True, K.Config(overlap=True), sliding_window=(64, 0)), _spec(t, hq, 128), _spec(s, hkv, 128),
                 _spec(s, hkv, 128))


@pytest.mark.parametrize(("causal", "window"), [(True, (100, 0)), (False, (64, 200)), (False, (None, 3))])
def test_a_sliding_window_lowers_in_the_backward_which_the_impl_takes_at_any_length(
        causal: bool, window: tuple[int | None, int | None]) -> None:
    t, s, hq, hkv = SHAPES[0]
    q, kv = _spec(t, hq, 128), _spec(s, hkv, 128)

    def backward(q: Any, k: Any, v: Any, lse: Any) -> Any:
        return KB.mosaic_attention_backward(q, k, v, q, lse, q, lse, causal=causal, softmax_scale=0.125,
                                            sliding_window=window)

    lse = jax.ShapeDtypeStruct((1, hq, t), jnp.float32)
    assert _kernels(_lowered(backward, q, kv, kv, lse)) == 2
    impl = MosaicFlashAttention(AttentionMetadata(), H100)

    def loss(q: Any, k: Any, v: Any) -> Any:
        out = impl(q, k, v, causal=causal, sliding_window=(window[0] or 10**12, window[1] or 10**12))
        return out.attention_outputs.astype(jnp.float32).sum()

    long_kv = _spec(8192, hkv, 128)
    assert _kernels(_lowered(jax.grad(loss, argnums=(0, 1, 2)), _spec(256, hq, 128), long_kv, long_kv)) == 3


@pytest.mark.parametrize(("s", "copied"), [(1000, False), (16384, False), (517, True), (77, True)])
def test_keys_are_copied_to_whole_blocks_only_off_the_tma_tiling(s: int, copied: bool) -> None:
    # A key length off TMA's 8-row tiling is padded to whole blocks (a copy of K and V); any
    # other length reads its last block's tail out of bounds (zeros, masked): no copy. The GPU
    # tests check the numbers of both (odd lengths; 1000 keys, full and causal).
    q, kv = _spec(1024, 2, 128), _spec(s, 2, 128)
    text = _lowered(_forward(False), q, kv, kv)
    assert _is_mosaic_gpu(text) and ("stablehlo.pad" in text) == copied


@pytest.mark.parametrize(("t", "s", "hq", "hkv", "d"), [(333, 517, 4, 2, 128), (256, 256, 4, 4, 64),
                                                       (640, 384, 4, 1, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_a_mask_mod_lowers_in_the_impl_differentiated(t: int, s: int, hq: int, hkv: int, d: int, causal: bool) -> None:
    # The mask_mod's bits and tile lists built in JAX (traced document ids), the forward, dQ and
    # dK/dV walking them: the own backward (cuDNN's takes no mask_mod), whatever the length.
    from jaxattn import masks

    impl = MosaicFlashAttention(AttentionMetadata(), H100)

    def loss(q: Any, k: Any, v: Any, ids: Any) -> Any:
        mask_mod = masks.and_(masks.document(ids[:, :t], ids[:, :s]),
                              lambda b, h, qi, kv: (h % 2 == 0) | (kv < qi + 40))
        res = impl(q, k, v, causal=causal, mask_mod=mask_mod)
        return res.attention_outputs.astype(jnp.float32).sum() + res.softmax_lse.sum()

    ids = jax.ShapeDtypeStruct((1, max(t, s)), jnp.int32)
    text = _lowered(jax.grad(loss, argnums=(0, 1, 2)), _spec(t, hq, d), _spec(s, hkv, d), _spec(s, hkv, d), ids)
    assert _kernels(text) == 3


def test_every_mask_mod_at_one_shape_lowers_to_the_same_kernels() -> None:
    # The kernels read a mask_mod only as bits and tile lists (arrays), so a new variant at the
    # same shapes (and the same bits' shape: one that varies with b or h has its own) compiles
    # no new kernel: Mosaic GPU compiles a kernel once a process, keyed by its module's hash.
    from jaxattn import masks

    impl = MosaicFlashAttention(AttentionMetadata(), H100)
    t, h, d = 512, 2, 64

    def step(make: Any, with_block_mask: bool) -> Any:
        def loss(q: Any, k: Any, v: Any, ids: Any) -> Any:
            mask_mod = make(ids)
            bm = masks.block_mask(mask_mod, 1, 1, t, t, bits=True) if with_block_mask else None
            return impl(q, k, v, mask_mod=mask_mod, block_mask=bm).attention_outputs.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))

    variants = [(lambda ids: masks.and_(masks.causal(), masks.document(ids)), True),
                (lambda ids: masks.and_(masks.causal(), masks.document(ids)), False),
                (lambda ids: masks.prefix_lm(ids[:, 0]), False), (lambda ids: masks.chunked_causal(128), True),
                (lambda ids: masks.or_(masks.sliding_window(64), lambda b, hh, qi, kv: kv < 8), False)]
    hashes = set()
    for make, with_block_mask in variants:
        text = _lowered(step(make, with_block_mask), _spec(t, h, d), _spec(t, h, d), _spec(t, h, d),
                        jax.ShapeDtypeStruct((1, t), jnp.int32))
        found = re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)
        assert len(found) == 3, found
        hashes.add(tuple(sorted(found)))
    assert len(hashes) == 1


def test_a_mask_mod_lowers_from_a_block_mask_and_at_head_dim_256_forward_only() -> None:
    from jaxattn import masks

    impl = MosaicFlashAttention(AttentionMetadata(), H100)
    mask_mod = masks.chunked_causal(100)

    def run(q: Any, k: Any, v: Any) -> Any:
        bm = masks.block_mask(mask_mod, 1, 1, 300, 300, bits=True)
        return impl(q, k, v, mask_mod=mask_mod, block_mask=bm).attention_outputs

    assert _is_mosaic_gpu(_lowered(run, _spec(300, 2, 256), _spec(300, 2, 256), _spec(300, 2, 256)))
    with pytest.raises(ValueError, match="AND the causal rule"):
        K.mosaic_attention_forward(jnp.zeros((1, 8, 1, 64), jnp.bfloat16), jnp.zeros((1, 8, 1, 64), jnp.bfloat16),
                                   jnp.zeros((1, 8, 1, 64), jnp.bfloat16), causal=True, softmax_scale=1.0,
                                   bits=jnp.zeros((1, 1, 8, 1), jnp.int32))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("q_double", [False, True])
def test_a_persistent_mask_mod_forward_lowers(d: int, q_double: bool) -> None:
    from jaxattn import masks
    from jaxattn_mosaic import mods

    t, s, hq, hkv = SHAPES[0]
    config = dataclasses.replace(K.mod_config(d), persistent=True, q_double=q_double)

    def run(q: Any, k: Any, v: Any) -> Any:
        bits = mods.call_bits(masks.chunked_causal(100), None, batch=1, heads=hq, t_len=t, s_len=s, causal=False,
                              window=(None, None))
        return K.mosaic_attention_forward(q, k, v, causal=False, softmax_scale=0.125, config=config, bits=bits)

    assert _is_mosaic_gpu(_lowered(run, _spec(t, hq, d), _spec(s, hkv, d), _spec(s, hkv, d)))


@pytest.mark.parametrize("refused", [{"overlap": True}, {"split_tail": True},
                                     {"persistent": True, "scheduled": True}], ids=str)
def test_a_mask_mods_forward_refuses_schedules_it_cannot_run(refused: dict[str, bool]) -> None:
    x = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="a mask_mod's tiles run whole"):
        K.mosaic_attention_forward(x, x, x, causal=False, softmax_scale=1.0, config=K.Config(**refused),
                                   bits=jnp.zeros((1, 1, 128, 4), jnp.int32))


@pytest.mark.parametrize("mask_mod", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_alibi_lowers_in_the_impl_differentiated(d: int, mask_mod: bool) -> None:
    # masks.alibi's term in the forward, dQ (with the slopes' row sums) and dK/dV, with and
    # without a mask_mod's lists; the slopes differentiated.
    from jaxattn import masks

    impl = MosaicFlashAttention(AttentionMetadata(), H100)

    def loss(q: Any, k: Any, v: Any, slopes: Any) -> Any:
        res = impl(q, k, v, causal=True, score_mod=masks.alibi(slopes),
                   mask_mod=masks.chunked_causal(100) if mask_mod else None)
        return res.attention_outputs.astype(jnp.float32).sum()

    slopes = jax.ShapeDtypeStruct((4,), jnp.float32)
    text = _lowered(jax.grad(loss, argnums=(0, 1, 2, 3)), _spec(333, 4, d), _spec(517, 2, d), _spec(517, 2, d), slopes)
    assert _kernels(text) == 3


def test_a_score_mod_other_than_alibi_is_declined_with_the_reason() -> None:
    impl = MosaicFlashAttention(AttentionMetadata(), H100)
    q, kv = jnp.zeros((1, 128, 2, 64), jnp.bfloat16), jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    from jaxattn.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=r"runs only the score_mod jaxattn\.masks\.alibi"):
        impl(q, kv, kv, score_mod=lambda score, b, h, qi, kv_: score * 2.0)
