"""What the forward and backward Mosaic GPU kernels share: which key blocks a run of query rows
sees, and the producer warpgroup that streams K and V blocks through a ring of shared-memory
slots.

Like the kernel modules, it imports jax's Mosaic GPU dialect at its top: only they import it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm

from jaxattn_mosaic.mods import WORD

__all__ = ["FIRST_NAMED_BARRIER", "NO_WINDOW", "TRANSFORMS", "KeyBlocks", "NamedBarriers", "Window", "await_signal",
           "bits_keep", "cdiv", "check_inputs", "keys_ahead", "load_vector", "named_barrier", "plus", "release_unread",
           "ring_slot", "signal", "soft_cap_slope", "soft_capped", "store_to_gmem", "stream_kv", "transposed",
           "window_sides"]

#: Shared-memory tiles of 64 columns (128 bytes of 16-bit values), as wgmma reads them.
TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ring_slot(i: Any, slots: int) -> Any:
    """``i % slots``: Python arithmetic for a Python int (a concrete array does not lower in
    jax 0.11's Mosaic GPU), ``lax.rem`` for a traced index."""
    return i % slots if isinstance(i, int) else lax.rem(i, jnp.int32(slots))


def plus(i: Any, k: Any) -> Any:
    """``i + k``, and ``i`` itself for a Python 0 ``k``: a kernel that never offsets an index
    lowers exactly as one written without the offset."""
    return i if isinstance(k, int) and k == 0 else i + k


_TWO_LOG2E = 2.0 * math.log2(math.e)


def soft_capped(s: Any, cap: float | None) -> Any:
    """Scores ``s`` soft-capped at ``cap`` in their own units: ``cap * tanh(s / cap)`` (the
    kernels' scores are unscaled, so ``cap`` is the logits' cap over the softmax scale).

    As ``2 cap / (1 + e) - cap`` with ``e = 2^(-2 log2(e) s / cap)``: five operations, exact to a
    few ulp of ``cap`` (``e`` overflowing to inf gives ``-cap``, never NaN). The kernels compile
    with approximate math, where ``tanh`` would be ``tanh.approx.f32``, about 2^-11 relative: a
    capped logit of 50 off by up to 0.02. ``None``: ``s``."""
    if cap is None:
        return s
    e = jnp.exp2(s * (-_TWO_LOG2E / cap))
    return (2.0 * cap) / (1.0 + e) - cap


def soft_cap_slope(capped: Any, cap: float) -> Any:
    """``d soft_capped(s) / d s`` from the capped scores: ``1 - tanh^2``."""
    t = capped * (1.0 / cap)
    return 1.0 - t * t


#: A sliding window's ``(left, right)`` sides, each None where unbounded.
Window = tuple[int | None, int | None]
NO_WINDOW: Window = (None, None)


def window_sides(window: tuple[int | None, int | None] | None, t_len: int, s_len: int) -> Window:
    """``window`` (jaxattn's ``sliding_window``, sides >= 0) with each side that hides no key
    (at least ``max(T, S)``) as None, so that kernels mask and skip only what a window cuts."""
    if window is None:
        return NO_WINDOW
    longest = max(t_len, s_len)
    left, right = window
    if (left is not None and left < 0) or (right is not None and right < 0):
        raise ValueError(f"window sides must be >= 0, got {window}")
    return (None if left is None or left >= longest else int(left),
            None if right is None or right >= longest else int(right))


def keys_ahead(causal: bool, right: int | None) -> int | None:
    """Keys a row sees past its own position: 0 causal, a window's right side, None: all."""
    sides = [side for side in (0 if causal else None, right) if side is not None]
    return min(sides) if sides else None


def check_inputs(q: Any, k: Any, v: Any, head_dims: tuple[int, ...], who: str) -> None:
    """q ``(B, T, Hq, D)``, k and v ``(B, S, Hkv, D)`` of one 16-bit dtype, D in ``head_dims``."""
    hq, head_dim = q.shape[2:]
    hkv = k.shape[2]
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have one shape")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are no multiple of {hkv} key heads")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.dtype not in (jnp.float16, jnp.bfloat16):
        raise ValueError(f"q, k, v must share float16 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if head_dim not in head_dims:
        raise ValueError(f"{who} takes head dims {', '.join(map(str, head_dims))}, got {head_dim}")


@dataclasses.dataclass(frozen=True)
class KeyBlocks:
    """``s_len`` keys in blocks of ``block``. Query row ``i`` sits at key position ``i + offset``
    (``offset = S - T``: bottom-right) and sees key ``j < s_len`` iff, where given,
    ``j <= i + offset + right`` (``causal``: ``right`` is 0 or less) and ``j >= i + offset - left``
    (a sliding window; sides >= 0, None: unbounded)."""

    s_len: int
    block: int
    causal: bool
    offset: int
    left: int | None = None
    right: int | None = None

    @property
    def ahead(self) -> int | None:
        return keys_ahead(self.causal, self.right)

    @property
    def count(self) -> int:
        """Blocks holding any key (padding past them is never read)."""
        return cdiv(self.s_len, self.block)

    def seen_before(self, row_end: Any) -> Any:
        """Blocks up to the last holding a key that rows < ``row_end`` may see: traced in a
        kernel, or a Python int on the host (a persistent kernel's schedule, ``kernel.schedule_tiles``)."""
        ahead = self.ahead
        if isinstance(row_end, int):
            if ahead is None:
                return self.count
            return min(max(cdiv(min(row_end + self.offset + ahead, self.s_len), self.block), 0), self.count)
        if ahead is None:
            return row_end * 0 + self.count  # traced: a concrete array cannot enter the kernel
        last = jnp.minimum(row_end + (self.offset + ahead), self.s_len)  # keys < last
        return jnp.clip(lax.div(last + (self.block - 1), jnp.int32(self.block)), 0, self.count)

    def first_seen(self, row_start: Any) -> Any:
        """The first block holding a key that rows >= ``row_start`` may see (0 without a left
        side: a Python 0, so that a kernel without a window lowers as one written without it)."""
        if self.left is None:
            return 0
        first = row_start + (self.offset - self.left)  # row row_start sees keys >= first
        if isinstance(row_start, int):
            return min(max(first, 0) // self.block, self.count)
        return jnp.minimum(lax.div(jnp.maximum(first, 0), jnp.int32(self.block)), self.count)

    def run_start(self, row0: Any, lo: Any, end: Any) -> Any:
        """The first block that the rows from ``row0`` run, in a CTA streaming blocks ``lo`` to
        ``end``: ``lo`` without a left side, else their first seen block (at most ``end``; a
        second consumer's rows start later than the CTA's)."""
        return lo if self.left is None else jnp.minimum(self.first_seen(row0), end)

    def keep(self, j: Any, row0: Any, shape: tuple[int, int]) -> Any:
        """Which keys of block ``j`` the ``shape[0]`` rows from ``row0`` see: a bool tile in
        wgmma's register layout (false past ``S`` and outside each row's window)."""
        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        keys = cols + j * self.block
        keep = keys < self.s_len
        seen = self.sees(keys, rows, row0)
        return keep if seen is None else keep & seen

    def sees(self, keys: Any, rows: Any, row0: Any) -> Any:
        """Whether rows ``row0 + rows`` see ``keys`` (tiles) by the causal mask and the window,
        not counting keys past ``S``; None where neither cuts."""
        seen = None
        if (ahead := self.ahead) is not None:
            seen = keys <= rows + (row0 + (self.offset + ahead))
        if self.left is not None:
            after = keys >= rows + (row0 + (self.offset - self.left))
            seen = after if seen is None else seen & after
        return seen

    def whole_from(self, row_start: Any) -> Any:
        """Blocks (from 0) that every row >= ``row_start`` (traced) sees up to their last key:
        none is cut on the right nor by the key tail."""
        full = self.s_len // self.block
        if (ahead := self.ahead) is None:
            return row_start * 0 + full
        first = row_start + (self.offset + ahead) + 1  # keys < first are seen by row row_start
        return jnp.clip(lax.div(jnp.maximum(first, 0), jnp.int32(self.block)), 0, full)

    def whole_after(self, row_end: Any) -> Any:
        """The first block that every row < ``row_end`` (traced) sees from its first key: none
        from there on is cut on the left by the window (0 without one)."""
        if self.left is None:
            return row_end * 0
        first = row_end + (self.offset - self.left - 1)  # row row_end - 1 sees keys >= first
        return lax.div(jnp.maximum(first, 0) + (self.block - 1), jnp.int32(self.block))

    def row_spans(self, key0: Any, keys: int, block_q: int, n_q: int) -> tuple[Any, Any, tuple[Any, ...]]:
        """The transposed view (the dK/dV kernel's): the query blocks of ``block_q`` rows, of
        ``n_q`` in all, that see some of the ``keys`` keys from ``key0`` (traced), as ``(first,
        end, spans)``, the spans ``(from, to, masked)`` runs over ``first .. end`` as
        ``spans``'. Row ``i`` sees key ``k`` iff ``k - offset - ahead <= i <= k - offset +
        left``; keys past ``S`` are not masked (their gradients are never kept)."""
        zero = key0 * 0  # traced: a concrete array cannot enter the kernel
        first = full = zero
        last_key = key0 + keys - 1
        if (ahead := self.ahead) is not None:
            # The first block that sees any key of the run, and the first whose rows see every
            # one of them on this side.
            first = jnp.minimum(lax.div(jnp.maximum(key0 - (self.offset + ahead), 0), jnp.int32(block_q)), n_q)
            full = lax.div(jnp.maximum(last_key - (self.offset + ahead), 0) + (block_q - 1), jnp.int32(block_q))
            full = jnp.clip(full, first, n_q)
        if self.left is None:
            if ahead is None:
                return first, n_q, ((first, n_q, False),)
            return first, n_q, ((first, full, True), (full, n_q, False))
        # The block after the last that sees any key of the run, and after the last whose rows
        # see every one of them on this side.
        end = lax.div(jnp.maximum(last_key - (self.offset - self.left) + 1, 0) + (block_q - 1), jnp.int32(block_q))
        end = jnp.clip(end, first, n_q)
        whole = jnp.clip(lax.div(jnp.maximum(key0 - (self.offset - self.left) + 1, 0), jnp.int32(block_q)), full, end)
        return first, end, ((first, full, True), (full, whole, False), (whole, end, True))

    def spans(self, row0: Any, rows: int, start: Any, end: Any) -> tuple[tuple[Any, Any, bool], ...]:
        """Blocks ``start .. end`` that the ``rows`` rows from ``row0`` run, as ``(from, to,
        masked)`` runs: the unmasked ones see every key of the block (no iota/compare)."""
        whole = jnp.minimum(self.whole_from(row0), end)
        if self.left is None:
            return (start, whole, False), (whole, end, True)
        a = jnp.clip(self.whole_after(row0 + rows), start, end)
        b = jnp.clip(whole, a, end)
        return (start, a, True), (a, b, False), (b, end, True)


#: The first hardware named barrier free for a kernel's own use: Mosaic GPU takes 0 (a CTA-wide
#: barrier) and 1 + i for warpgroup i's own barrier (three warpgroups here); an SM has 16.
FIRST_NAMED_BARRIER = 4
_NAMED_BARRIERS = 16


def _void() -> Any:
    return ir.Type.parse("!llvm.void")  # in the kernel's MLIR context, so only while lowering


def named_barrier(op: str, barrier: Any, threads: int) -> None:
    """``bar.<op> barrier, threads`` (``op``: ``sync`` waits, ``arrive`` does not) for every
    thread of the warpgroup that runs it. ``barrier`` is a Python int or a traced int32."""
    if isinstance(barrier, int):

        @plgpu.inline_mgpu()
        def emit(_ctx: Any) -> None:
            llvm.inline_asm(_void(), [], f"bar.{op} {barrier}, {threads};", "", has_side_effects=True)

        emit()
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
    def emit_traced(_ctx: Any, barrier_id: Any) -> None:
        llvm.inline_asm(_void(), [barrier_id.registers[()]], f"bar.{op} $0, {threads};", "r",
                        has_side_effects=True)

    emit_traced(barrier)


@dataclasses.dataclass(frozen=True)
class NamedBarriers:
    """``count`` hardware named barriers from id ``first``, each completing once ``threads``
    threads reached it: ``arrive`` counts the calling warpgroup's 128 and goes on, ``wait``
    counts them and waits. Unlike an mbarrier, a phase counts its waiters' threads too, so one
    side must not arrive twice before the other's wait; no shared memory, no phase bits."""

    first: int
    count: int
    threads: int

    def __post_init__(self) -> None:
        if self.first < FIRST_NAMED_BARRIER or self.first + self.count > _NAMED_BARRIERS:
            raise ValueError(f"named barriers {self.first}..{self.first + self.count - 1} are outside "
                             f"{FIRST_NAMED_BARRIER}..{_NAMED_BARRIERS - 1}")

    def arrive(self, i: Any) -> None:
        named_barrier("arrive", self.first + i, self.threads)

    def wait(self, i: Any) -> None:
        named_barrier("sync", self.first + i, self.threads)


def signal(barriers: Any, i: Any) -> None:
    """Arrive on barrier ``i`` of ``barriers``, an mbarrier array or ``NamedBarriers`` (a
    consumer done with a ring slot, or passing a turn)."""
    if isinstance(barriers, NamedBarriers):
        barriers.arrive(i)
    else:
        plgpu.barrier_arrive(barriers.at[i])


def await_signal(barriers: Any, i: Any) -> None:
    """Wait on barrier ``i`` of ``barriers`` (see ``signal``): the producer for a free slot, a
    consumer for its turn."""
    if isinstance(barriers, NamedBarriers):
        barriers.wait(i)
    else:
        plgpu.barrier_wait(barriers.at[i])


def stream_kv(k_ref: Any, v_ref: Any, smem: tuple[Any, Any], ready: tuple[Any, Any], free: tuple[Any, Any], *,
              b: Any, kv_head: Any, n_blocks: Any, block: int, stages: int, base: Any = 0, first: Any = 0,
              listed: Callable[[Any], Any] | None = None,
              beside: Callable[[Any, Any, Any], None] | None = None) -> None:
    """The producer: key blocks ``first .. first + n_blocks - 1`` of batch ``b``, head ``kv_head``
    into the K and V rings, the ``j``-th into slot ``(base + j) % stages`` (``base``: blocks streamed
    before, by a persistent kernel's earlier tiles), each copy arriving on its slot's ``ready``
    barrier and waiting, from the ring's second round, for its slot's ``free`` signal (an
    mbarrier array or ``NamedBarriers``, see ``signal``). ``listed(j)``: the ``j``-th block is
    that block instead (a mask_mod's tile list); ``beside(j, block, slot)`` then copies what goes
    with it (its bits), once its V slot is free."""
    (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free) = smem, ready, free

    @pl.loop(0, n_blocks)
    def _load(j: Any) -> None:
        ring = base + j
        slot = ring_slot(ring, stages)
        key_block = plus(j, first) if listed is None else listed(j)
        idx = (b, pl.ds(key_block * block, block), kv_head)
        pl.when(ring >= stages)(lambda: await_signal(k_free, slot))
        plgpu.copy_gmem_to_smem(k_ref.at[idx], k_smem.at[slot], k_ready.at[slot])
        pl.when(ring >= stages)(lambda: await_signal(v_free, slot))
        plgpu.copy_gmem_to_smem(v_ref.at[idx], v_smem.at[slot], v_ready.at[slot])
        if beside is not None:
            beside(j, key_block, slot)


def load_vector(ref: Any, layout: Any) -> Any:
    """A shared-memory vector into registers: jax 0.11 takes the ref alone (an index beside it is
    deprecated there, and gone in 0.12), jax 0.10 wants one."""
    load: Any = plgpu.load
    idx = inspect.signature(load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return load(ref, (), layout=layout)
    return load(ref, layout=layout)


def store_to_gmem(ref: Any, value: Any) -> None:
    """Registers straight to global memory, as jax 0.10 and 0.11 lower ``ref[...] = value``.
    jax 0.12 lowers that assignment as an "optimized" store, which refuses a layout whose lanes
    do not fill whole 32-byte sectors (a wgmma bf16 tile: 16 bytes a row of four lanes), and
    gives ``plgpu.store(..., optimized=False)`` for the plain one."""
    store: Any = getattr(plgpu, "store", None)
    if store is None:
        ref[...] = value
    else:
        store(ref, value, optimized=False)


def transposed(ref: Any) -> Any:
    """A 2-D shared-memory tile as wgmma's transposed operand. ``ref.transpose`` is what
    ``plgpu.transpose_ref`` did (jax 0.12 removed that one); one name, so the Mosaic GPU
    interpreter's stand-ins (tests/mosaic/conftest.py) replace it in one place."""
    return ref.transpose((1, 0))


def bits_keep(words: list[Any], shape: tuple[int, int], key_axis: int) -> Any:
    """Which pairs of a tile a mask_mod's packed bits keep: a bool tile of ``shape`` in wgmma's
    register layout whose ``key_axis`` counts the block's keys (1: a forward's or dQ's scores,
    0: dK/dV's transposed ones). ``words[w]``: word ``w`` of the block's keys for each row along
    the other axis (a vector in that axis's reduced layout; key ``32 w + i`` at bit ``i``)."""
    keys = plgpu.broadcasted_iota(jnp.int32, shape, key_axis, layout=plgpu.Layout.WGMMA)
    tiles = [lax.broadcast_in_dim(w, shape, [1 - key_axis]) for w in words]
    word = tiles[-1]
    for i in range(len(tiles) - 2, -1, -1):
        word = jnp.where(keys < WORD * (i + 1), tiles[i], word)
    return (lax.shift_right_logical(word, keys & (WORD - 1)) & 1) != 0


def release_unread(j: Any, ready: tuple[Any, Any], free: tuple[Any, Any], *, stages: int, wait: bool = True) -> None:
    """Free key block ``j``'s K and V slots for a consumer that does not read the block (the
    other consumer of its CTA sees more keys).

    A slot's ``free`` barrier completes a phase on two arrivals, one per consumer. A consumer
    that runs ahead of the other would, by arriving for block ``j``, complete the phase of the
    slot's previous block ``j - stages`` in the other's place, and the producer would overwrite
    a block the other consumer still reads. Waiting for block ``j`` to land first orders the
    arrival: the producer loads ``j`` only once ``j - stages`` is free. ``wait=False`` is for
    schedules that already keep the consumers within a block of each other (the forward's
    ping-pong), where the wait would cost a barrier and change nothing, with mbarriers: named
    barriers (``NamedBarriers``) count the producer's threads too, so an early arrival for
    block ``j`` could complete ``j - stages``'s phase before the producer reached it: they
    always wait.
    """
    slot = ring_slot(j, stages)
    for ready_bar, free_sig in zip(ready, free, strict=True):
        if wait or isinstance(free_sig, NamedBarriers):
            plgpu.barrier_wait(ready_bar.at[slot])
        signal(free_sig, slot)
