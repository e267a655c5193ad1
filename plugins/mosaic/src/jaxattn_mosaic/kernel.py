"""The forward attention kernel of jaxattn-mosaic, in Pallas Mosaic GPU (sm_90 only).

This module imports jax's Mosaic GPU Pallas dialect at its top, so only the impl's forward
imports it (never ``import jaxattn`` nor plugin discovery). It needs nothing of jaxattn: the
probe script in benchmarks/ loads it on its own.

Design (one CTA = three warpgroups):

* warpgroup 2 is the producer: it gives most of its registers back and streams K and V
  blocks into a ring of ``stages`` shared-memory slots with bulk tensor copies (TMA), each
  slot guarded by a "loaded" barrier and refilled once both consumers arrived on its
  "consumed" barrier;
* warpgroups 0 and 1 are consumers: each owns ``block_q`` query rows (its Q tile loaded once
  by TMA), runs S = Q K^T and O += P V as asynchronous wgmma into register accumulators, and
  the online softmax in float32 on the log2 scale (the softmax scale folded into one FMA);
* a shared "schedule" barrier makes the two consumers ping-pong: one's softmax runs while
  the other's two GEMMs hold the tensor cores (with ``Config.pass_turns`` they pass turns
  instead of meeting: a consumer waits only before its P V, for the other's Q K^T);
* with ``Config.persistent`` (the default at D <= 128 below 16k keys) one CTA per SM loops
  over the tiles in ``Config.q_group``'s order (causal, with ``Config.scheduled``: the tiles
  a schedule made when the call is traced gives it): the K/V ring runs on across tiles, and with
  ``Config.q_double`` each consumer loads its next tile's Q into a second slot while it runs;
* with ``Config.named_barriers``, "consumed" slots (and the turns) are signalled with the
  SM's hardware named barriers instead of mbarriers in shared memory;
* with ``Config.overlap``, each consumer also overlaps itself: block ``j``'s Q K^T and block
  ``j - 1``'s P V are issued together, and the softmax of block ``j`` runs while that P V is
  still in flight; two "turn" barriers pass the right to issue from one consumer to the other;
* with ``Config.exp2_fma_cols``, the exp2 of a block's last key columns runs as a polynomial on
  the FMA units (``exp2_fma``) while the special-function unit does the rest: the softmax's
  exponentials, not its FMAs, may bound the consumer that is not on the tensor cores.

Masks: causal is bottom-right aligned (query ``i`` sees key ``j`` iff ``j <= i + S - T``),
and a key tail past ``S`` (the key length padded up to a block) is masked too. Blocks that
need no mask run a loop without the iota/compare; only the diagonal band and the tail block
pay for it. A sliding window (``sliding_window``) narrows each query tile to the band of key
blocks its rows see: the producer streams the band alone, blocks cut by its left edge are
masked too, and the second consumer, whose rows start later, releases the blocks left of its
own. (A block wholly masked for some row before its first seen key is harmless: the finite
mask value becomes that row's running max, and the first real key's rescale, ``2^(-1e30 ...)``,
zeroes what it summed.) Rows that see no key at all (causal or a window with T > S) come out
as zeros with an LSE of ``-inf``, as jaxattn's contract asks. A logits soft cap (``soft_cap``)
caps each block's scores before the mask and the online softmax: ``cap * tanh(logit / cap)``
(``blocks.soft_capped``).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import struct
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxattn_mosaic.blocks import (
    FIRST_NAMED_BARRIER,
    NO_WINDOW,
    TRANSFORMS,
    KeyBlocks,
    NamedBarriers,
    Window,
    await_signal,
    bits_keep,
    cdiv,
    check_inputs,
    keys_ahead,
    load_vector,
    plus,
    release_unread,
    ring_slot,
    signal,
    soft_capped,
    store_to_gmem,
    stream_kv,
    transposed,
    window_sides,
)
from jaxattn_mosaic.mods import WORD, row_blocks, tile_lists

__all__ = ["Config", "default_config", "exp2_fma", "mod_config", "mosaic_attention_forward"]

_LOG2E = math.log2(math.e)
#: Head dims the forward takes: tiles of 64 columns (128-byte swizzle), up to what shared memory holds.
HEAD_DIMS = (64, 128, 192, 256)
_LN2 = math.log(2.0)
#: Rows of the tiling Mosaic GPU's TMA copies need a global array's length to be a multiple of.
_TMA_ROWS = 8
#: The value a masked score takes (unscaled, as the running max). Finite, so a block whose row max
#: is still "nothing seen" never computes -inf - -inf. Where it wins a row's max (a window's
#: block left of the row's first key), that row's sum collects 1s until its first real key,
#: whose rescale 2^((-1e30 - m) * scale) = 0 wipes them; rows that see no key are zeroed after
#: the kernel.
_MASKED = -1e30


#: Named barrier ids: the two consumers' turns, then the K slots' and the V slots' "consumed".
_NAMED_TURNS = FIRST_NAMED_BARRIER
_NAMED_SLOTS = _NAMED_TURNS + 2
_NAMED_LIMIT = 16
#: Threads at a turn (one consumer passes, the other waits) and at a slot (both consumers
#: arrive, the producer waits): a warpgroup is 128.
_TURN_THREADS = 256
_SLOT_THREADS = 384


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes: ``block_q`` rows per consumer warpgroup (2 consumers per CTA)."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    #: The two consumers take turns on the tensor cores (off: an ablation, both issue freely).
    pingpong: bool = True
    #: Intra-warpgroup overlap: each consumer issues the next block's Q K^T with this block's
    #: P V and runs the next softmax while P V is in flight (two S tiles' worth of registers
    #: live); the consumers pass the tensor cores by turns instead of meeting at a barrier.
    overlap: bool = False
    #: Key columns per block (a multiple of 64, the last ones) whose exp2 runs as an FMA
    #: polynomial (``exp2_fma``) instead of on the special-function unit, which does all of
    #: them otherwise: the two units then share the softmax's exponentials. 0: none. An
    #: ablation: 9-20% slower on an H100 (the softmax is not exp2-bound; docs/bench.md).
    exp2_fma_cols: int = 0
    #: Compile without the barriers Pallas inserts around shared-memory stores and before each
    #: TMA load it issues (``unsafe_no_auto_barriers``), and with no scratch for cross-warp
    #: reductions (the softmax's row reductions stay within a warp). Safe here: no thread
    #: reads and writes one shared-memory region except the epilogue's output tile, after its
    #: wgmma waits, and ``commit_smem`` (a fence and a warpgroup barrier) orders it before the
    #: TMA store. The ping-pong loop stores nothing to shared memory, so only the producer's
    #: loads and the epilogue change. An ablation: within 2.4% either way on an H100 (docs/bench.md).
    lean_barriers: bool = False
    #: Ping-pong by turns: after issuing its Q K^T a consumer passes the tensor cores to the
    #: other and waits for them back only before its P V, so its softmax may start as soon as
    #: its scores land. Off: the two meet at a shared barrier twice per block, which also keeps
    #: one's softmax from starting before the other's ends.
    pass_turns: bool = False
    #: Signal consumed K/V slots (and, with ``pass_turns``, the turns) with the SM's hardware
    #: named barriers (``bar.arrive`` / ``bar.sync``) instead of mbarriers in shared memory.
    named_barriers: bool = False
    #: The epilogue waits only until the TMA store of its output tile has read shared memory,
    #: not until the write lands (the kernel's end covers that), so the CTA exits and the next
    #: one starts sooner.
    store_read_wait: bool = False
    #: One CTA per SM (``ctas`` of them; 0: the device's SM count) loops over tiles in a
    #: snake of the order ``q_group`` sets (a CTA given a round's heaviest causal tile gets the
    #: next round's lightest): the producer streams the next tile's K/V while the consumers
    #: finish a tile, and each consumer loads its next Q under its epilogue, which stages the
    #: output in a shared tile of its own where that fits (64x128 at D = 128) and stores from
    #: registers otherwise.
    persistent: bool = False
    ctas: int = 0
    #: (persistent) The tiles' order: query tiles in chunks of ``q_group`` (0: all of a
    #: head's), each chunk's tiles for every (batch, head) in turn, the heads of a batch
    #: side by side, and the chunks heavy (late) first when causal. The CTAs running at once
    #: share K/V in L2 the more, the larger the chunk; heavy causal tiles come first, for
    #: balance, the more strictly, the smaller it is. (A non-persistent grid's order is Mosaic
    #: GPU's: the batch fastest, then query tiles, then heads.)
    q_group: int = 0
    #: (persistent) Two Q slots per consumer, where they fit beside the K/V ring and the
    #: output's own tile (D <= 128 at 64x128 tiles; one slot otherwise): each tile's first step
    #: loads the next tile's Q into the slot the last tile used, so no tile waits for its Q.
    q_double: bool = False
    #: (full attention) Where the last round of a persistent kernel, or the last wave of one
    #: CTA per tile, would hold a few whole tiles and leave most SMs idle (``tail_split``),
    #: those tiles are cut by key blocks into pieces for the idle CTAs; each piece is an
    #: attention over its keys (output and LSE in float32), and a tile's pieces are merged
    #: after the kernel by their LSEs. One CTA per tile then takes a 1-D grid (``launch_order``).
    split_tail: bool = False
    #: (persistent, causal) Each CTA takes the tiles a schedule made when the call is traced
    #: gives it (``schedule_tiles``), not the snake: the (batch, head) pairs in groups of as
    #: many as make about one round of CTAs, each group's tiles heaviest first, each tile to the
    #: CTA the schedule's clock frees first. A snake of a head's tiles leaves the busiest CTA
    #: 3.1% over the mean in work at 1k-8k keys; the schedule, under 1% at 4k-8k keys
    #: (0.05-0.2% at D = 128), with few heads at once
    #: (``plugins/mosaic/benchmarks/mosaic_schedule.py``).
    scheduled: bool = False

    def summary(self) -> str:
        """The tiles and the schedule in one line (``jaxattn explain`` shows it)."""
        tiles = (f"{2 * self.block_q}x{self.block_kv} tiles ({self.block_q} query rows per consumer), "
                 f"{self.stages} K/V stages")
        tail = ", a short last round of full attention split by keys" if self.split_tail else ""
        if not self.persistent:
            return f"{tiles}, one CTA per tile{tail}"
        order = f"query tiles in chunks of {self.q_group}" if self.q_group else "a head's query tiles together"
        slots = ", two Q slots per consumer" if self.q_double else ""
        return f"{tiles}, persistent (one CTA per SM looping over the tiles, {order}{slots}{tail})"

    def __post_init__(self) -> None:
        if self.block_q % 64 or self.block_kv % 64:
            raise ValueError(f"blocks must be multiples of 64, got {self}")
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")
        if self.exp2_fma_cols % 64 or not 0 <= self.exp2_fma_cols < self.block_kv:
            raise ValueError(f"exp2_fma_cols must be a multiple of 64 below block_kv, got {self}")
        if self.exp2_fma_cols and self.overlap:
            raise ValueError(f"exp2_fma_cols is built for the ping-pong loop only, not with overlap: {self}")
        if self.pass_turns and (self.overlap or not self.pingpong):
            raise ValueError(f"pass_turns is a ping-pong schedule without overlap (which passes turns "
                             f"of its own): set pingpong=True and overlap=False, got {self}")
        if self.persistent and self.overlap:
            raise ValueError(f"persistent is built for the ping-pong loop only, not with overlap: {self}")
        if self.scheduled and not self.persistent:
            raise ValueError(f"scheduled assigns a persistent CTA its tiles: set persistent=True, got {self}")
        if self.q_double and not self.persistent:
            raise ValueError(f"q_double serves a persistent CTA's next tile: set persistent=True, got {self}")
        if self.q_group < 0:
            raise ValueError(f"q_group must be >= 0 (0: all of a head's query tiles), got {self.q_group}")
        if self.ctas < 0:
            raise ValueError(f"ctas must be >= 0 (0: one per SM), got {self.ctas}")
        if self.named_barriers and _NAMED_SLOTS + 2 * self.stages > _NAMED_LIMIT:
            raise ValueError(f"named_barriers signal each K and V slot with a barrier of its own; "
                             f"{self.stages} stages need more than the SM's 16: use at most "
                             f"{(_NAMED_LIMIT - _NAMED_SLOTS) // 2}, got {self}")


#: Keys from which a full (non-causal) D = 128 forward takes 64x192 tiles (measured on an H100:
#: 1.4-4.9% faster than 64x128 at 16k and 32k keys, a tie or slower below; slower causal, where
#: 192-key blocks cut the diagonal band of 128-row tiles worse), and from which the default
#: kernel is not persistent (the 64x192 tiles leave no room for a second Q slot; causal, see
#: ``default_config``).
WIDE_KV_FROM = 16384


def _fits(head_dim: int, block_q: int, block_kv: int, stages: int, *, q_slots: int, o_tile: bool,
          itemsize: int = 2, extra: int = 0) -> bool:
    """Whether a CTA's tiles fit its shared memory: ``q_slots`` Q tiles per consumer, the K/V
    ring, (``o_tile``) an output tile per consumer and ``extra`` bytes (a mask_mod's bits beside
    the ring), 1 KiB left for the barriers and Mosaic's scratch."""
    rows = 2 * q_slots * block_q + 2 * stages * block_kv + (2 * block_q if o_tile else 0)
    return rows * head_dim * itemsize + extra <= _SMEM_BYTES - 1024


def _bits_slots(stages: int, words: int, block_q: int) -> tuple[int, int, int, int]:
    """The int32 shared-memory slots of a mask_mod's bits: per K/V stage, each consumer's rows'
    ``words`` words of the block (``_Body.mod_keep``)."""
    return (stages, 2, words, block_q)


def default_config(head_dim: int, *, causal: bool = False, kv_len: int = 0, block_q: int | None = None,
                   block_kv: int | None = None, stages: int | None = None, window: Window = NO_WINDOW) -> Config:
    """Tiles that fit the 227 KiB of shared memory and the consumers' 232 registers (or those
    given), and the schedule measured fastest with them.

    ``causal`` and ``kv_len`` (the key length) choose between measured tiles at D = 128. Below
    ``WIDE_KV_FROM`` keys the kernel is persistent with two Q slots per consumer wherever those
    and the output's own tile fit (D <= 128 at the default tiles): measured on an H100 up to 4%
    faster at 4k-8k keys and 6-30% at 1k-2k, a head's tiles taken together (docs/bench.md);
    causal, with its tiles scheduled (``Config.scheduled``), 2-4% faster again at 4k-8k keys.

    With a sliding window (``window``'s sides that cut, ``blocks.window_sides``) the keys a row
    sees stand for the key length: a tile's CTA streams only their band.
    """
    if window != NO_WINDOW:
        left, ahead = window[0], keys_ahead(causal, window[1])
        kv_len = min(kv_len, (kv_len if left is None else left) + (kv_len if ahead is None else ahead) + 1)
    if head_dim <= 64:
        tiles = (64, 256)
    elif head_dim <= 128:
        tiles = (64, 192) if not causal and kv_len >= WIDE_KV_FROM else (64, 128)
    else:
        tiles = (64, 64)
    bq, bkv, n_stages = block_q or tiles[0], block_kv or tiles[1], stages or 2
    # From 16k keys, causal D = 128 in chunks of 4 query tiles (heavy ones first across heads)
    # measured 0.8-2.1% faster than the non-persistent kernel in four runs and 4.8% slower in a
    # fifth (S = 16k, GQA 32/8; docs/bench.md): not persistent there until that is understood.
    persistent = kv_len < WIDE_KV_FROM and _fits(head_dim, bq, bkv, n_stages, q_slots=2, o_tile=True)
    # The last round cut by keys where persistent: measured 0.1-1.6% faster at 2k-8k keys, 2-5%
    # with few tiles. One CTA per tile, at 16k keys, it measured 0.2-0.8% slower (its last wave
    # starts staggered, as CTAs before it end): not there.
    # Causal tiles scheduled where persistent: by medians (minima) of nine interleaved rounds on
    # an H100, D = 128, 4.4% (1.2%) faster at B4 S4k, 3.7% (2.0%) at B2 S8k, 2.8% (2.8%) at
    # S8k GQA 4, a tie at 1k-2k; D = 64 0.5% (0.2%) at S4k, 1.8% (2.7%) at S8k. At 16k keys,
    # persistent and scheduled, 1.3% slower than one CTA per tile: not there.
    return Config(block_q=bq, block_kv=bkv, stages=n_stages, persistent=persistent, q_double=persistent,
                  split_tail=persistent, scheduled=persistent)


def mod_config(head_dim: int) -> Config:
    """The tiles of a mask_mod's forward (``bits``): a causal call's (64x128 at D = 128; a mask_mod's
    partial tiles sit on diagonals and edges as causal ones do), one CTA per SM looping over them
    in the grid's order, one Q slot per consumer."""
    # A mask_mod's query tiles mostly run short loops (a document's or a chunk's key blocks):
    # a persistent CTA starts its next tile's loads while the last one's epilogue runs. Measured
    # on an H100 (D 128, 32 heads, 16k tokens; plugins/mosaic/benchmarks/mod_tiles_bench.py
    # --reps 3), ms, persistent vs one CTA per tile: 8 documents 0.572 vs 0.616, chunks of 1,024
    # 0.380 vs 0.417, prefix-LM (long loops) 3.777 vs 3.752; two Q slots no faster (0.574,
    # 0.375, 3.811) for their shared memory.
    return dataclasses.replace(default_config(head_dim, causal=True, kv_len=WIDE_KV_FROM), persistent=True,
                               q_double=False, split_tail=False, scheduled=False)


def tail_split(n_tiles: int, n_ctas: int, n_blocks: int) -> int:
    """Pieces per tile of a short last round (``Config.split_tail``) on ``n_ctas`` CTAs at
    once; 1: not split. The ``n_tiles % n_ctas`` tiles left after the whole rounds
    (all of them, if fewer than the CTAs) are cut into equal pieces of at least two of the
    ``n_blocks`` key blocks, as many as make the tail shortest, counting the rounds of pieces
    the CTAs take and one block's time per piece for what a piece costs beside its blocks (its
    epilogue, its float32 output, the merge). No piece is empty.

    B4 S4k MHA at D = 128: 4096 tiles on 132 CTAs leave 4 for a 32nd round that would take a
    whole tile's 32 blocks; cut 16 ways, it takes 2 (and 1 for the piece). B2 S8k: 68 tiles
    left, 64 blocks each; cut 5 ways, 340 pieces take 3 rounds of 13 blocks (and 3), 42 in all
    against 64. B1 T128 S8k, 32 heads: 32 tiles, each cut 4 ways."""
    rest = n_tiles % n_ctas
    if not rest:
        return 1

    def tail(pieces: int) -> tuple[int, int]:
        per = cdiv(n_blocks, pieces)
        real = cdiv(n_blocks, per)
        return cdiv(rest * real, n_ctas) * (per + (real > 1)), real

    return min((tail(p) for p in range(1, max(1, n_blocks // 2) + 1)), key=lambda c: c[0])[1]


def tail_pieces(cfg: Config, *, batch: int, heads: int, t_len: int, s_len: int, causal: bool,
                sms: int, window: Window = NO_WINDOW) -> tuple[int, int]:
    """How ``Config.split_tail`` cuts a call's last round (a persistent kernel's) or wave (one
    CTA per tile) on ``sms`` SMs: the tiles cut and the pieces each is cut into; ``(0, 1)``
    where none is (causal attention, a sliding window, a last round not worth cutting)."""
    if not cfg.split_tail or causal or window != NO_WINDOW:
        return 0, 1
    n_tiles = batch * heads * cdiv(t_len, 2 * cfg.block_q)
    # A non-persistent launch runs in waves of one CTA per SM (its tiles take more than half
    # of an SM's shared memory).
    ctas = (cfg.ctas if cfg.persistent else 0) or sms
    pieces = tail_split(n_tiles, ctas, cdiv(s_len, cfg.block_kv))
    return (n_tiles % ctas, pieces) if pieces > 1 else (0, 1)


#: 2**f on [-1/2, 1/2]: the Taylor terms (ln 2)**k / k!; relative error below 4e-6 there.
_EXP2_TERMS = (1.0, 0.6931472, 0.2402265, 0.05550411, 0.009618129, 0.001333356)
#: 1.5 * 2**23: adding it to a float32 of magnitude below 2**22 rounds it to an integer,
#: which the sum's low mantissa bits then hold.
_ROUND = 12582912.0
#: _ROUND's float32 bits, as a Python int: a bitcast of a scalar does not lower in
#: jax 0.11's Mosaic GPU (a vector<i32> where a scalar belongs).
_ROUND_BITS: int = struct.unpack("<i", struct.pack("<f", _ROUND))[0]


#: What a scheduled tile costs beside its key blocks (its epilogue, its next Q), in blocks.
SCHEDULE_TILE_COST = 1


@functools.lru_cache(maxsize=64)
def schedule_tiles(costs: tuple[int, ...], *, pairs: int, n_ctas: int) -> np.ndarray:
    """``Config.scheduled``: which tiles each of ``n_ctas`` persistent CTAs runs, in order, as
    an int32 array ``(n_ctas, 1 + rounds)``: a CTA's count of tiles, then the tiles (the
    rest zeros). A tile is ``t = pair * n_q + i`` (``persistent_order`` with a head's tiles
    together), ``i`` counting from the heaviest; ``costs[i]`` is its key blocks.

    The (batch, head) pairs go in groups of ``round(n_ctas / n_q)``, so the CTAs at work at
    once share about that many heads' K/V in L2; a group's tiles go heaviest first, across
    its pairs, each to the CTA whose work so far (its tiles' blocks, plus one per tile for
    what a tile costs beside its blocks) is least: list scheduling, longest first. Plain
    numpy, on the host; cached (tens of ms at tens of thousands of tiles), so read-only."""
    n_q = len(costs)
    size = max(1, round(n_ctas / n_q))
    clock = [(0, c) for c in range(n_ctas)]  # a heap: (work so far, CTA)
    lists: list[list[int]] = [[] for _ in range(n_ctas)]
    for first in range(0, pairs, size):
        group = range(first, min(pairs, first + size))
        for i in range(n_q):
            for pair in group:
                work, cta = heapq.heappop(clock)
                lists[cta].append(pair * n_q + i)
                heapq.heappush(clock, (work + costs[i] + SCHEDULE_TILE_COST, cta))
    schedule = np.zeros((n_ctas, 1 + max(map(len, lists))), np.int32)
    for cta, tiles in enumerate(lists):
        schedule[cta, 0] = len(tiles)
        schedule[cta, 1 : 1 + len(tiles)] = tiles
    schedule.flags.writeable = False
    return schedule


def schedule_work(schedule: np.ndarray, costs: tuple[int, ...],
                  per_tile: float = SCHEDULE_TILE_COST) -> list[float]:
    """Each CTA's work under ``schedule`` (``schedule_tiles``): its tiles' key blocks, plus
    ``per_tile`` a tile (the schedule's own cost model by default; another, to see how the
    schedule holds up)."""
    n_q = len(costs)
    return [sum(costs[t % n_q] + per_tile for t in row[1 : 1 + row[0]]) for row in schedule.tolist()]


def tile_schedule(cfg: Config, *, batch: int, heads: int, t_len: int, s_len: int, causal: bool,
                  sms: int, window: Window = NO_WINDOW) -> tuple[np.ndarray, tuple[int, ...]] | None:
    """A call's tile schedule (``Config.scheduled``, ``schedule_tiles``) on ``sms`` SMs and the key
    blocks of its query tiles, last (heaviest) first: the one account the kernel runs and ``jaxattn
    explain`` tells; ``None`` where the tiles are not scheduled (not persistent, or not causal)."""
    if not (cfg.persistent and cfg.scheduled and causal):
        return None
    n_q = cdiv(t_len, 2 * cfg.block_q)
    blocks = KeyBlocks(s_len=s_len, block=cfg.block_kv, causal=True, offset=s_len - t_len, left=window[0],
                       right=window[1])
    rows = 2 * cfg.block_q
    costs = tuple(blocks.seen_before((n_q - i) * rows) - blocks.first_seen((n_q - 1 - i) * rows) for i in range(n_q))
    n_ctas = min(batch * heads * n_q, cfg.ctas or sms)
    return schedule_tiles(costs, pairs=batch * heads, n_ctas=n_ctas), costs


def exp2_fma(x: Any) -> Any:
    """``2**x`` for float32 ``x <= 0`` with adds, multiplies and integer ops only: no exp2
    instruction, and no float/int conversion (on sm_90 both run at the special-function
    unit's rate, which this is meant to relieve).

    ``x = n + f`` with ``n`` the nearest integer and ``|f| <= 1/2``, both read off
    ``x + 1.5 * 2**23``; ``2**f`` is a degree-5 polynomial (relative error below 4e-6), and
    ``n`` is added to its exponent bits. An optimisation barrier keeps ``(x + c) - c`` from
    being folded to ``x`` (XLA on a CPU did, under jit). Inputs below -125 give ``2**-125``
    or so instead of less (masked keys: a weight of 1e-38 beside a row sum of at least 1).
    Plain jax: it runs in the kernel and, for its tests, on any array.
    """
    x = jnp.maximum(x, -125.0)
    big = lax.optimization_barrier(x + _ROUND)
    f = x - (big - _ROUND)
    poly = jnp.full_like(f, _EXP2_TERMS[-1])
    for c in reversed(_EXP2_TERMS[:-1]):
        poly = poly * f + c
    n = lax.bitcast_convert_type(big, jnp.int32) - _ROUND_BITS
    return lax.bitcast_convert_type(lax.bitcast_convert_type(poly, jnp.int32) + lax.shift_left(n, 23), jnp.float32)


#: Shared memory a CTA may take on sm_90 (227 KiB).
_SMEM_BYTES = 227 * 1024
#: SMs of an H100 SXM: persistent kernels lowered on a host without a GPU (CI) launch this many CTAs.
_H100_SMS = 132


def sm_count() -> int:
    """The GPU's SMs: a persistent kernel's CTAs (an H100's 132 on a host without a GPU)."""
    try:
        return int(jax.devices("gpu")[0].core_count)
    except RuntimeError:  # no GPU backend: lowering on a CPU host
        return _H100_SMS


def persistent_order(t: Any, *, batch: int, heads: int, chunk: int) -> tuple[Any, Any, Any]:
    """The ``t``-th tile of a persistent kernel's order (``Config.q_group``), as its batch,
    head and query-tile index (before a causal kernel reverses it): chunks of ``chunk`` query
    tiles, each chunk's tiles for every (batch, head) in turn, heads fastest within a batch.
    ``chunk`` divides the query tiles' count. Plain jax: it runs in the kernel and, for its
    tests, on any array."""
    level, rest = lax.rem(t, jnp.int32(chunk)), lax.div(t, jnp.int32(chunk))
    pair = lax.rem(rest, jnp.int32(batch * heads))
    q_idx = lax.div(rest, jnp.int32(batch * heads)) * chunk + level
    return lax.div(pair, jnp.int32(heads)), lax.rem(pair, jnp.int32(heads)), q_idx


def launch_order(t: Any, *, batch: int, heads: int, n_q: int) -> tuple[Any, Any, Any]:
    """The ``t``-th CTA of a non-persistent launch as its batch, head and query-tile index, in
    the order Mosaic GPU runs the grid ``(heads, query tiles, batch)``: the batch fastest, then
    a head's query tiles (so CTAs running at once share K/V in L2). A launch that cuts its last
    wave (``Config.split_tail``) takes a 1-D grid in this order. Plain jax."""
    b, rest = lax.rem(t, jnp.int32(batch)), lax.div(t, jnp.int32(batch))
    return b, lax.div(rest, jnp.int32(n_q)), lax.rem(rest, jnp.int32(n_q))


def mosaic_attention_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    softmax_scale: float,
    soft_cap: float | None = None,
    sliding_window: tuple[int | None, int | None] | None = None,
    config: Config | None = None,
    bits: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of q ``(B, T, Hq, D)`` over k, v ``(B, S, Hkv, D)``, the logits
    ``softmax_scale * q k`` capped at ``soft_cap`` (``cap * tanh(logit / cap)``) if given;
    with ``sliding_window=(left, right)`` (sides >= 0, None: unbounded) query ``i`` sees keys
    ``i' - left .. i' + right``, ``i' = i + S - T``, as jaxattn's contract says.

    ``bits``: a mask_mod's visibility instead (``mods.call_bits``, int32 ``(B|1, Hq|1, T,
    ceil(S / 32))``, the causal rule and window ANDed in, so ``causal`` is False and no window is
    given): each query tile runs the key blocks holding a visible pair (``mods.tile_lists``),
    the partial ones masked by the bits (``mod_config``'s tiles, one CTA per SM looping over them
    in the grid's order; a ``config`` not persistent: one CTA per tile). Rows that see no key come
    out zeros with an LSE of -inf. Keys no query of their KV head sees must hold finite values
    (``mods.unread_zeroed``).

    ``alibi_slopes``: float32 ``(Hq,)``, ALiBi's term ``slopes[h] * (kv_idx - q_idx)`` (raw
    positions, ``jaxattn.masks.alibi``) added to each capped logit before the mask, in registers.

    Returns the output ``(B, T, Hq, D)`` in q's dtype and the log-sum-exp of the scaled
    logits ``(B, Hq, T)`` in float32 (natural log).
    """
    check_inputs(q, k, v, HEAD_DIMS, "the forward")
    t_len, head_dim = q.shape[1], q.shape[3]
    s_len = k.shape[1]
    window = window_sides(sliding_window, t_len, s_len)
    if bits is not None and (causal or window != NO_WINDOW):
        raise ValueError("with bits, AND the causal rule and the window into them (mods.call_bits)")
    cfg = config or (mod_config(head_dim) if bits is not None else
                     default_config(head_dim, causal=causal, kv_len=s_len, window=window))
    bq, bkv = cfg.block_q, cfg.block_kv
    t_pad = cdiv(t_len, 2 * bq) * 2 * bq
    s_pad = cdiv(s_len, bkv) * bkv
    if t_pad != t_len:
        q = jnp.pad(q, ((0, 0), (0, t_pad - t_len), (0, 0), (0, 0)))
    if s_pad != s_len and s_len % _TMA_ROWS:
        # Keys are copied out to whole blocks only where Mosaic GPU's TMA needs it (a length
        # off its 8-row tiling). Otherwise a last block past the keys' end loads zeros where
        # it lies out of bounds (TMA fills them) and is masked anyway: no copy of K and V
        # (258 MiB at B1 S16k H32 with the 192-key blocks of a full forward).
        pad = ((0, 0), (0, s_pad - s_len), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    out, lse2 = _forward_call(q, k, v, causal=causal, scale=float(softmax_scale), s_len=s_len,
                              t_len=t_len, cfg=cfg, window=window, bits=bits, alibi_slopes=alibi_slopes,
                              cap=None if soft_cap is None else float(soft_cap) / float(softmax_scale))
    out = out[:, :t_len]
    lse2 = lse2[:, :, :t_len]
    # Rows that see no key: -inf (the kernel left _MASKED there, as in the rows it pads).
    lse = jnp.where(lse2 > _MASKED, lse2, -jnp.inf) * _LN2
    ahead = keys_ahead(causal, window[1])
    if ahead is not None and t_len > s_len + ahead:
        # Rows i < T - S - ahead see no key: zeros, whatever the kernel left there (a mask_mod's
        # kernel zeroes its own).
        seen = (jnp.arange(t_len) + (s_len - t_len + ahead)) >= 0
        out = jnp.where(seen[None, :, None, None], out, jnp.zeros((), out.dtype))
    return out, lse


@dataclasses.dataclass(frozen=True)
class _Launch:
    """One forward launch, decided before its kernel is traced: the shapes, the tiles, the key
    blocks, the ring's stages and the order of the CTAs' items (``_launch``)."""

    cfg: Config
    causal: bool
    cap: float | None  # the soft cap in the unscaled scores' units (cap / scale)
    qk_scale: float  # the logits' scale on the log2 scale
    dtype: Any
    batch: int
    hq: int
    group: int  # query heads per KV head
    head_dim: int
    t_pad: int
    n_q_tiles: int
    blocks: KeyBlocks
    stages: int
    n_tiles: int
    n_whole: int  # the order's whole tiles; then ``n_parts`` pieces (Config.split_tail)
    pieces: int
    per_piece: int
    n_parts: int
    n_items: int
    n_ctas: int
    n_rounds: int
    schedule: Any  # the CTAs' scheduled tiles (Config.scheduled), or None
    chunk: int
    q_slots: int
    o_staged: bool
    #: With a mask_mod's bits: the lists' and bits' leading dims (B or 1, Hq or 1) and the words
    #: of a key block; None without.
    mods: tuple[int, int, int] | None = None
    #: ALiBi's slopes are an input (``mosaic_attention_forward``'s ``alibi_slopes``).
    alibi: bool = False

    @property
    def bq(self) -> int:
        return self.cfg.block_q

    @property
    def bkv(self) -> int:
        return self.cfg.block_kv


def _launch(q: Any, k: Any, *, causal: bool, scale: float, s_len: int, t_len: int, cfg: Config,
            cap: float | None, window: Window, mods: tuple[int, int, int] | None = None,
            alibi: bool = False) -> _Launch:
    batch, t_pad, hq, head_dim = q.shape
    bq, bkv = cfg.block_q, cfg.block_kv
    n_q_tiles = t_pad // (2 * bq)
    blocks = KeyBlocks(s_len=s_len, block=bkv, causal=causal, offset=s_len - t_len, left=window[0], right=window[1])
    # At least two stages (the ring's two slots), at most one a block: a key shorter than a
    # block still gets its two slots, the second never loaded.
    stages = max(2, min(cfg.stages, blocks.count))
    n_tiles = batch * n_q_tiles * hq
    sms = sm_count()
    # The last round's few whole tiles cut by key blocks (Config.split_tail): the first
    # ``n_whole`` of the order stay whole, each later one is ``pieces`` pieces of ``per_piece``
    # blocks, and the order's items are the whole tiles, then the pieces.
    cut, pieces = tail_pieces(cfg, batch=batch, heads=hq, t_len=t_len, s_len=s_len, causal=causal, sms=sms,
                              window=window)
    n_whole = n_tiles - cut
    n_parts = cut * pieces
    n_items = n_whole + n_parts
    n_ctas = min(n_items, cfg.ctas or sms)
    scheduled = tile_schedule(cfg, batch=batch, heads=hq, t_len=t_len, s_len=s_len, causal=causal, sms=sms,
                              window=window)
    schedule = None if scheduled is None else scheduled[0]
    # Query tiles per chunk of the persistent order: the largest divisor of their count up to
    # q_group; a head's tiles together where the CTAs' tiles are scheduled (Config.scheduled).
    chunk = max(g for g in range(1, n_q_tiles + 1)
                if n_q_tiles % g == 0 and g <= (cfg.q_group if cfg.q_group and schedule is None else n_q_tiles))

    # A persistent kernel's own output tiles (one per consumer) if they fit beside Q's and the
    # K/V ring; with ``q_double``, two Q slots per consumer where they fit with those.
    def fits(q_slots: int) -> bool:
        bits = 0 if mods is None else math.prod(_bits_slots(stages, mods[2], bq)) * 4
        return _fits(head_dim, bq, bkv, stages, q_slots=q_slots, o_tile=True, itemsize=q.dtype.itemsize, extra=bits)

    q_slots = 2 if cfg.q_double and fits(2) else 1
    return _Launch(cfg=cfg, causal=causal, cap=cap, qk_scale=scale * _LOG2E, dtype=q.dtype, batch=batch, hq=hq,
                   group=hq // k.shape[2], head_dim=head_dim, t_pad=t_pad, n_q_tiles=n_q_tiles, blocks=blocks,
                   stages=stages, n_tiles=n_tiles, n_whole=n_whole, pieces=pieces,
                   per_piece=cdiv(blocks.count, pieces), n_parts=n_parts, n_items=n_items, n_ctas=n_ctas,
                   n_rounds=cdiv(n_items, n_ctas), schedule=schedule, chunk=chunk, q_slots=q_slots,
                   o_staged=cfg.persistent and fits(q_slots), mods=mods, alibi=alibi)


def _forward_call(q: Any, k: Any, v: Any, *, causal: bool, scale: float, s_len: int, t_len: int,
                  cfg: Config, cap: float | None = None, window: Window = NO_WINDOW,
                  bits: Any = None, alibi_slopes: Any = None) -> tuple[Any, Any]:
    """The kernel's launch; ``cap``: the soft cap in the unscaled scores' units (cap / scale);
    ``window``: the sliding window's sides that cut (``blocks.window_sides``); ``bits``: a
    mask_mod's (``mosaic_attention_forward``)."""
    if cfg.overlap and window != NO_WINDOW:
        raise ValueError(f"overlap runs every tile from key block 0: it takes no sliding window, got {window}")
    if cfg.overlap and alibi_slopes is not None:
        raise ValueError(f"ALiBi's term is added in the ping-pong loop only, not with overlap: {cfg}")
    mod_inputs: tuple[Any, ...] = ()
    mods = None
    if bits is not None:
        if cfg.overlap or cfg.split_tail or cfg.scheduled:
            raise ValueError(f"a mask_mod's tiles run whole, in the ping-pong loop, unscheduled (their "
                             f"lists are known only when the kernel runs): {cfg}")
        rows, t_pad = 2 * cfg.block_q, q.shape[1]
        per_block = cfg.block_kv // WORD
        lists = tile_lists(bits, s_len, rows=rows, keys=cfg.block_kv)
        words = row_blocks(bits, rows=cfg.block_q, t_pad=t_pad, words=cdiv(s_len, cfg.block_kv) * per_block)
        mods = (int(bits.shape[0]), int(bits.shape[1]), per_block)
        mod_inputs = (lists, words)
    lz = _launch(q, k, causal=causal, scale=scale, s_len=s_len, t_len=t_len, cfg=cfg, cap=cap, window=window,
                 mods=mods, alibi=alibi_slopes is not None)
    if alibi_slopes is not None:
        # In the kernel's unscaled units (its scores are q k, the scale applied with log2(e) later).
        mod_inputs += (jnp.asarray(alibi_slopes, jnp.float32) / scale,)
    batch, hq, bq, head_dim, pieces, n_parts = lz.batch, lz.hq, lz.bq, lz.head_dim, lz.pieces, lz.n_parts
    params = plgpu.CompilerParams(approx_math=True)
    if cfg.lean_barriers:
        params = dataclasses.replace(params, unsafe_no_auto_barriers=True, reduction_scratch_bytes=0)

    def entry(*refs: Any) -> None:  # the kernel's name ("entry") in the lowered module and profiles
        _entry(lz, *refs)

    out, lse, *parts = plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct(q.shape, lz.dtype),
            jax.ShapeDtypeStruct((batch, hq, lz.t_pad), jnp.float32),
            # A piece's output and LSE (Config.split_tail), merged below.
            *((jax.ShapeDtypeStruct((n_parts, 2 * bq, head_dim), jnp.float32),
               jax.ShapeDtypeStruct((n_parts, 2 * bq), jnp.float32)) if n_parts else ()),
        ),
        grid=(lz.n_ctas,) if cfg.persistent else (lz.n_items,) if pieces > 1 else (hq, lz.n_q_tiles, batch),
        grid_names=("cta",) if cfg.persistent else ("t",) if pieces > 1 else ("h", "q", "b"),
        num_threads=3,
        thread_name="wg",
        compiler_params=params,
    )(q, k, v, *(() if lz.schedule is None else (jnp.asarray(lz.schedule),)), *mod_inputs)
    if n_parts:
        last = jnp.arange(lz.n_whole, lz.n_tiles, dtype=jnp.int32)
        tail = (persistent_order(last, batch=batch, heads=hq, chunk=lz.chunk) if cfg.persistent
                else launch_order(last, batch=batch, heads=hq, n_q=lz.n_q_tiles))
        out, lse = merge_pieces(out, lse, *parts, tiles=tail, pieces=pieces)
    return out, lse


def _entry(lz: _Launch, q_ref: Any, k_ref: Any, v_ref: Any, *refs: Any) -> None:
    """The kernel: its shared memory and barriers, then the body (``_Body``) in their scope."""
    schedule_ref, refs = (refs[0], refs[1:]) if lz.schedule is not None else (None, refs)
    mod_refs, refs = (refs[:2], refs[2:]) if lz.mods is not None else ((), refs)
    slopes_ref, (out_ref, lse_ref, *parts) = (refs[0], refs[1:]) if lz.alibi else (None, refs)
    bq, bkv, head_dim, dtype, stages, q_slots, cfg = lz.bq, lz.bkv, lz.head_dim, lz.dtype, lz.stages, lz.q_slots, lz.cfg
    smem = [
        plgpu.SMEM((2 * q_slots, bq, head_dim), dtype, transforms=TRANSFORMS),
        plgpu.SMEM((stages, bkv, head_dim), dtype, transforms=TRANSFORMS),
        plgpu.SMEM((stages, bkv, head_dim), dtype, transforms=TRANSFORMS),
        *([plgpu.SMEM((2, bq, head_dim), dtype, transforms=TRANSFORMS)] if lz.o_staged else []),
    ]
    pl.run_scoped(
        lambda *scoped: _Body(lz, (q_ref, k_ref, v_ref, schedule_ref, out_ref, lse_ref), parts, scoped,
                              mod_refs, slopes_ref).run(),
        smem,
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=2 * q_slots)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=2),
        # By turns (overlap, pass_turns): turn[c] is consumer c's right to issue (the other
        # passes it); named barriers stand in for these with ``named_barriers``.
        *((plgpu.Barrier(num_arrivals=1, num_barriers=2),)
          if (cfg.overlap or cfg.pass_turns) and not cfg.named_barriers else ()),
        # A mask_mod's bits: a partial block's words for each consumer's rows, beside its K/V slot.
        *(((plgpu.SMEM(_bits_slots(stages, lz.mods[2], bq), jnp.int32), plgpu.Barrier(num_barriers=stages)),)
          if lz.mods is not None else ()),
        collective_axes="wg",
    )


class _Body:
    """The kernel body of one CTA, traced once: warpgroups 0 and 1 the consumers (Q K^T,
    softmax, P V for their half of a tile's rows), warpgroup 2 the producer (the K/V ring).
    Its methods are the steps of the body, each reading the launch (``lz``) and the refs."""

    def __init__(self, lz: _Launch, refs: tuple[Any, ...], parts: Any, scoped: Any,
                 mod_refs: tuple[Any, ...] = (), slopes_ref: Any = None) -> None:
        self.lz, self.cfg = lz, lz.cfg
        self.q_ref, self.k_ref, self.v_ref, self.schedule_ref, self.out_ref, self.lse_ref = refs
        self.parts = parts
        (self.q_smem2, self.k_smem, self.v_smem, *self.o_smem2), (self.k_ready, self.v_ready, self.q_ready), \
            (self.k_free, self.v_free), self.sched, *extra = scoped
        self.slopes_ref = slopes_ref
        # Set per round (``consumer_round``): ALiBi's slope of the tile's head, the key block of a
        # step of its loop (a mask_mod's list's, or the step itself).
        self.slope: Any = None
        self.key_block: Callable[[Any], Any] = lambda j: j
        if lz.mods is not None:
            self.list_ref, self.bits_ref = mod_refs
            *extra, (self.bits_smem, self.bits_ready) = extra
        self.turns: Any = extra[0] if extra else None
        if self.cfg.named_barriers:
            self.turns = NamedBarriers(_NAMED_TURNS, 2, _TURN_THREADS)
            self.k_free = NamedBarriers(_NAMED_SLOTS, lz.stages, _SLOT_THREADS)
            self.v_free = NamedBarriers(_NAMED_SLOTS + lz.stages, lz.stages, _SLOT_THREADS)
        self.wg = lax.axis_index("wg")
        self.cta: Any = None
        if self.schedule_ref is not None:
            self.cta = lax.axis_index("cta")
            self.rounds: Any = self.schedule_ref[self.cta, 0]
        elif self.cfg.persistent:
            self.cta = lax.axis_index("cta")
            self.rounds = (lz.n_rounds - 1) + (self.tile_of(lz.n_rounds - 1) < lz.n_items).astype(jnp.int32)
        else:
            self.rounds = 1
        self.fma_cols = self.cfg.exp2_fma_cols
        self.fma_cut = lz.bkv - self.fma_cols

    def run(self) -> None:
        pl.when(self.wg < 2)(self.consumer)
        pl.when(self.wg == 2)(self.producer)

    # -- which tile a round runs ---------------------------------------------------------------

    def tile(self, t: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
        """Item ``t``: its tile's batch, head and first query row, the key blocks its CTA
        streams (``lo`` to the end), and the piece it is (``None`` where no tile is cut;
        negative for a whole tile). Persistent: ``t`` counts in ``Config.q_group``'s
        order (a mask_mod's tiles: in ``launch_order``); one CTA per tile with a cut wave: in
        ``launch_order``; otherwise ``t`` is ``h + Hq * (q + n_q * b)`` of the grid's axes."""
        lz, cfg, blocks = self.lz, self.cfg, self.lz.blocks
        pieces, n_q_tiles, hq, bq = lz.pieces, lz.n_q_tiles, lz.hq, lz.bq
        lo: Any = 0
        piece: Any = None
        if lz.mods is not None:  # the tile's list's blocks (``listed``)
            if cfg.persistent:  # in the order a grid runs: tiles at once share a head's keys in L2
                b, head, q_tile = launch_order(t, batch=lz.batch, heads=hq, n_q=n_q_tiles)
            else:
                head, rest = lax.rem(t, jnp.int32(hq)), lax.div(t, jnp.int32(hq))
                q_tile, b = lax.rem(rest, jnp.int32(n_q_tiles)), lax.div(rest, jnp.int32(n_q_tiles))
            n_partial, n_full = (self.list_ref[(*self.mod_row(b, head, q_tile), i)] for i in (0, 1))
            return b, head, q_tile * (2 * bq), n_partial + n_full, lo, piece
        if pieces > 1:
            piece = t - lz.n_whole
            cut = piece >= 0
            part = jnp.maximum(piece, 0)
            t = jnp.where(cut, lz.n_whole + lax.div(part, jnp.int32(pieces)), t)
            lo = jnp.where(cut, lax.rem(part, jnp.int32(pieces)) * lz.per_piece, 0)
        if cfg.persistent:
            b, head, q_idx = persistent_order(t, batch=lz.batch, heads=hq, chunk=lz.chunk)
        elif pieces > 1:
            b, head, q_idx = launch_order(t, batch=lz.batch, heads=hq, n_q=n_q_tiles)
        else:
            head, rest = lax.rem(t, jnp.int32(hq)), lax.div(t, jnp.int32(hq))
            q_idx = lax.rem(rest, jnp.int32(n_q_tiles))
        # Heavy (late) causal tiles first: the tail of the launch is then the short ones.
        q_tile = (n_q_tiles - 1) - q_idx if lz.causal else q_idx
        tile_start = q_tile * (2 * bq)
        cta_blocks = blocks.seen_before(tile_start + 2 * bq)
        if blocks.left is not None:  # a window: the CTA streams its rows' band of blocks
            lo = blocks.first_seen(tile_start)
        if cfg.overlap:
            # Every consumer of the overlapped loop runs at least block 0 (see ``overlapped``).
            cta_blocks = jnp.maximum(cta_blocks, 1)
        if not cfg.persistent and pieces == 1:
            # Here, not above: the non-persistent module stays the one the GPU runs measured.
            b = lax.div(rest, jnp.int32(n_q_tiles))
        if piece is not None:  # full attention: a piece ends ``per_piece`` blocks on
            cta_blocks = jnp.where(piece >= 0, jnp.minimum(cta_blocks, lo + lz.per_piece), cta_blocks)
        return b, head, tile_start, cta_blocks, lo, piece

    def mod_row(self, b: Any, head: Any, q_tile: Any) -> tuple[Any, Any, Any]:
        """Where query tile ``q_tile`` of ``(b, head)`` finds its list and bits (their leading
        dims are 1 where the mask_mod varies along neither batch nor head)."""
        lead_b, lead_h, _ = self.lz.mods or (1, 1, 0)
        return b if lead_b > 1 else 0, head if lead_h > 1 else 0, q_tile

    def listed(self, b: Any, head: Any, tile_start: Any) -> tuple[Any, Callable[[Any], Any]]:
        """A mask_mod's tile: its count of partial blocks and its ``i``-th block (``mods.tile_lists``)."""
        row = self.mod_row(b, head, lax.div(tile_start, jnp.int32(2 * self.lz.bq)))
        return self.list_ref[(*row, 0)], lambda i: self.list_ref[(*row, i + 2)]

    def mod_keep(self, slot: Any) -> Any:
        """A partial block's visible pairs from the bits its producer copied beside it."""
        plgpu.barrier_wait(self.bits_ready.at[slot])
        words = [load_vector(self.bits_smem.at[slot, self.wg, w], plgpu.Layout.WGMMA.reduce(1))
                 for w in range(self.lz.mods[2])]  # type: ignore[index]
        return bits_keep(words, (self.lz.bq, self.lz.bkv), 1)

    def tile_of(self, r: Any) -> Any:
        """The item this CTA runs in round ``r``."""
        lz, cta = self.lz, self.cta
        if self.schedule_ref is not None:
            return self.schedule_ref[cta, r + 1]
        if self.cfg.persistent:
            # A snake: CTA c takes the c-th tile of even rounds and the c-th from the end of
            # odd ones, so a CTA given a round's heaviest causal tile gets the next round's
            # lightest. (A Python int round stays Python arithmetic: a concrete array
            # does not lower in jax 0.11's Mosaic GPU.)
            if isinstance(r, int):
                return r * lz.n_ctas + (cta if r % 2 == 0 else (lz.n_ctas - 1) - cta)
            return r * lz.n_ctas + jnp.where(lax.rem(r, 2) == 0, cta, (lz.n_ctas - 1) - cta)
        if lz.pieces > 1:  # a 1-D grid: whole tiles in launch_order, then the pieces
            return lax.axis_index("t")
        return lax.axis_index("h") + lz.hq * (lax.axis_index("q") + lz.n_q_tiles * lax.axis_index("b"))

    def per_tile(self, run: Any) -> None:
        """``run(r, base)`` for each of this CTA's rounds, ``base`` the K/V ring's count of
        blocks before the round's tile (returns ``base`` plus its blocks)."""
        if self.cfg.persistent:
            lax.fori_loop(0, self.rounds, run, jnp.int32(0))
        else:
            run(0, 0)  # Python ints: a concrete array does not lower in jax 0.11's Mosaic GPU

    # -- the consumers' ping-pong ----------------------------------------------------------------

    def sched_sync(self) -> None:
        if self.cfg.pingpong:
            plgpu.barrier_arrive(self.sched)
            plgpu.barrier_wait(self.sched)

    def take_turn(self) -> None:
        """Wait until the other consumer passes this one the tensor cores."""
        if self.cfg.pingpong:
            await_signal(self.turns, self.wg)

    def pass_turn(self) -> None:
        if self.cfg.pingpong:
            signal(self.turns, 1 - self.wg)

    def release(self, j: Any, later: bool = False) -> None:
        # Ping-pong (a rendezvous or a turn per block) keeps the other consumer within a
        # block: no wait is needed before releasing (see ``release_unread``), unless the
        # consumer reads later blocks (``later``: a window's blocks left of its rows) or a
        # next tile follows: then each wait on a "ready" barrier keeps its phase bit in step.
        cfg = self.cfg
        release_unread(j, (self.k_ready, self.v_ready), (self.k_free, self.v_free), stages=self.lz.stages,
                       wait=not cfg.pingpong or cfg.persistent or later)

    # -- the online softmax ----------------------------------------------------------------------

    def mask(self, s: Any, j: Any, row0: Any) -> Any:
        """Scores of block ``j`` with keys past ``S`` (and, causal, right of the diagonal) masked."""
        return jnp.where(self.lz.blocks.keep(j, row0, (self.lz.bq, self.lz.bkv)), s, _MASKED)

    def exponents(self, s: Any, j: Any, m_i: Any, row0: Any, masked: bool, keep: Any = None,
                  bias: Any = None) -> tuple[Any, Any, Any]:
        """Online softmax on the log2 scale for block ``j``'s scores ``s`` (masked if
        ``masked``): the new running max ``m``, the factor ``alpha`` for what came before,
        and the exponents whose exp2 is ``p``. ``m`` is kept unscaled and the scale applied
        after it is subtracted, ``(s - m) * scale``: the fused ``s * scale - m`` takes the
        exact product, up to half an ulp of the rounded max away from it, and past ~2^32
        that gap alone overflows exp2 (NaN out of finite inputs). One multiply more."""
        s = soft_capped(s, self.lz.cap)
        if bias is not None:  # ALiBi's (``alibi``), on the capped scores
            s = s + bias
        if masked:  # ``keep``: a mask_mod's (``mod_keep``)
            s = self.mask(s, j, row0) if keep is None else jnp.where(keep, s, _MASKED)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2((m_i - m_new) * self.lz.qk_scale)
        return m_new, alpha, (s - lax.broadcast_in_dim(m_new, s.shape, [0])) * self.lz.qk_scale

    def alibi(self, j: Any, row0: Any) -> Any:
        """ALiBi's term for step ``j``'s block and the rows from ``row0``: ``slope * (key - row)``,
        raw positions, the slope in the unscaled scores' units."""
        shape = (self.lz.bq, self.lz.bkv)
        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        return (cols - rows + (self.key_block(j) * self.lz.bkv - row0)).astype(jnp.float32) * self.slope

    def exp2_parts(self, x: Any) -> list[Any]:
        """exp2 of a block's scaled scores, by column parts: the special-function unit's
        for the first ``fma_cut`` keys, ``exp2_fma`` for the rest (``Config.exp2_fma_cols``)."""
        if not self.fma_cols:
            return [jnp.exp2(x)]
        return [jnp.exp2(x[:, :self.fma_cut]), exp2_fma(x[:, self.fma_cut:])]

    @staticmethod
    def row_sum(parts: list[Any]) -> Any:
        total = parts[0].sum(axis=1)
        for part in parts[1:]:
            total = total + part.sum(axis=1)
        return total

    def v_parts(self, slot: Any) -> list[Any]:
        """The V rows each part of P multiplies (the keys of ``exp2_parts``' columns)."""
        if not self.fma_cols:
            return [self.v_smem.at[slot]]
        return [self.v_smem.at[slot, pl.ds(0, self.fma_cut)], self.v_smem.at[slot, pl.ds(self.fma_cut, self.fma_cols)]]

    def softmax(self, s: Any, j: Any, m_i: Any, l_i: Any, row0: Any, masked: bool) -> Any:
        """Block ``j``'s scores ``s`` into ``(p, m, l, alpha)``, ``p`` in the inputs' dtype."""
        m_new, alpha, x = self.exponents(s, j, m_i, row0, masked)
        p = jnp.exp2(x)
        return p.astype(self.lz.dtype), m_new, l_i * alpha + p.sum(axis=1), alpha

    # -- the consumer's loop: ping-pong alone ------------------------------------------------------

    def in_turns(self, q_smem: Any, carry: Any, *, row0: Any, spans: Any, n_blocks: Any, cta_blocks: Any,
                 base: Any, first: Any, last: Any, lo: Any, start: Any) -> Any:
        """The consumer's loop with ping-pong alone: per block, Q K^T, softmax, P V, over
        blocks ``start`` to ``n_blocks`` in ``spans`` (``KeyBlocks.spans``). The CTA streams
        blocks ``lo`` (0 but for a piece of a tile or a window's band) to ``cta_blocks``;
        block ``j`` sits in the ring's slot ``(base + j - lo) % stages``. ``first`` and
        ``last``: whether the tile is the CTA's first and last."""
        cfg, wg, stages = self.cfg, self.wg, self.lz.stages

        def slot_of(j: Any) -> Any:
            return ring_slot(base + plus(j, -lo), stages)

        def first_wait() -> None:
            pl.when(n_blocks > start)(lambda: plgpu.barrier_wait(self.k_ready.at[slot_of(start)]))

        def drain(j: Any, _: Any, later: bool = False) -> None:
            # The other consumer needs more blocks: release our share of them and keep
            # the ping-pong in step (as if this one issued Q K^T, then took its P V turn).
            self.release(base + plus(j, -lo), later)
            if cfg.pass_turns:
                self.pass_turn()
                self.take_turn()
            else:
                self.sched_sync()
                self.sched_sync()

        if self.lz.blocks.left is None:
            first_wait()
        # Consumer 1 starts half a step behind consumer 0: the ping-pong. By meeting (the
        # default): both reach the schedule barrier after each Q K^T issue and before each
        # P V. By turns: Q K^T issues pass the turn, and only P V waits for it; the issue
        # order is the same (0's Q K^T, 1's Q K^T, 0's P V, 0's next Q K^T, 1's P V, ...).
        after_qk, stagger, finish_turns = ((self.pass_turn, self.take_turn, self.pass_turn) if cfg.pass_turns
                                           else (self.sched_sync, self.sched_sync, self.sched_sync))
        if cfg.pass_turns:
            # Turns run on from tile to tile of a persistent CTA: consumer 1's last P V
            # waits for consumer 0's next Q K^T, as within a tile. Passing one more turn at
            # each tile's end would let consumer 0 pass twice before consumer 1 took the
            # first (a named barrier then completes without its waiter; an mbarrier's
            # phase bit comes back where it was).
            pl.when((wg == 1) & first)(stagger)
        else:
            pl.when(wg == 1)(stagger)

        if self.lz.blocks.left is not None:
            # A window's blocks left of this consumer's rows (consumer 1's start later),
            # released as steps after the stagger, before its first block's wait.
            lax.fori_loop(lo, start, functools.partial(drain, later=True), None)
            first_wait()

        step = functools.partial(self.turn_step, q_smem=q_smem, row0=row0, n_blocks=n_blocks, slot_of=slot_of,
                                 after_qk=after_qk)
        for begin, end, masked in spans:
            carry = lax.fori_loop(begin, end, functools.partial(step, masked=masked), carry)
        acc, m_i, l_i = carry
        lax.fori_loop(n_blocks, cta_blocks, drain, None)

        pl.when(((wg == 0) & last) if cfg.pass_turns else (wg == 0))(finish_turns)
        return acc, m_i, l_i

    def turn_step(self, j: Any, carry: Any, *, masked: bool, q_smem: Any, row0: Any, n_blocks: Any, slot_of: Any,
                  after_qk: Any) -> Any:
        """Block ``j`` of ``in_turns``: Q K^T, the softmax, P V."""
        cfg, bq, bkv, v_ready = self.cfg, self.lz.bq, self.lz.bkv, self.v_ready
        acc, m_i, l_i = carry
        slot = slot_of(j)

        def qk_gemm(s_ref: Any) -> Any:
            plgpu.wgmma(s_ref, q_smem, transposed(self.k_smem.at[slot]))
            after_qk()
            return s_ref[...]

        s = pl.run_scoped(qk_gemm, plgpu.ACC((bq, bkv), jnp.float32))
        signal(self.k_free, slot)
        keep = self.mod_keep(slot) if masked and self.lz.mods is not None else None
        bias = self.alibi(j, row0) if self.lz.alibi else None
        m_new, alpha, x = self.exponents(s, j, m_i, row0, masked, keep, bias)
        parts = self.exp2_parts(x)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i = l_i * alpha
        p_lo = [p.astype(self.lz.dtype) for p in parts]

        def release_tensor_cores() -> None:
            if cfg.pass_turns:
                plgpu.barrier_wait(v_ready.at[slot])
                self.take_turn()
                return
            if cfg.pingpong:
                plgpu.barrier_arrive(self.sched)
            plgpu.barrier_wait(v_ready.at[slot])
            if cfg.pingpong:
                plgpu.barrier_wait(self.sched)

        if self.lz.head_dim <= 128:
            l_i = l_i + self.row_sum(parts)
            acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p_lo))
            release_tensor_cores()
        else:
            release_tensor_cores()
            l_i = l_i + self.row_sum(parts)

        def pv_gemm(acc_ref: Any) -> None:
            for p_part, v_part in zip(p_lo, self.v_parts(slot), strict=True):
                plgpu.wgmma(acc_ref, p_part, v_part)
            nxt = j + 1

            @pl.when(nxt < n_blocks)
            def _() -> None:
                plgpu.barrier_wait(self.k_ready.at[slot_of(nxt)])

        acc = pl.run_state(pv_gemm)(plgpu.ACC.init(acc))
        signal(self.v_free, slot)
        return acc, m_new, l_i

    # -- the consumer's loop: intra-warpgroup overlap -------------------------------------------

    def next_k(self, j: Any, n_run: Any) -> None:
        @pl.when(j < n_run)
        def _() -> None:
            # lax.rem even for next_k(1): the module the GPU runs measured and tested.
            plgpu.barrier_wait(self.k_ready.at[lax.rem(j, jnp.int32(self.lz.stages))])

    def k_t(self, slot: Any) -> Any:
        return transposed(self.k_smem.at[slot])

    def overlapped(self, q_smem: Any, carry: Any, *, row0: Any, n_blocks: Any, n_full: Any, cta_blocks: Any) -> Any:
        """The consumer's loop with intra-warpgroup overlap (``Config.overlap``)."""
        stages = self.lz.stages
        acc, m_i, l_i = carry
        # Rows that see no key (causal, T > S) run block 0 anyway, fully masked (the wrapper
        # replaces their output and LSE): the loop then always has a first and a last block.
        n_run = jnp.maximum(n_blocks, 1)

        # Consumer 0 issues first.
        pl.when(self.wg == 1)(self.pass_turn)

        # Block 0: Q K^T alone.
        plgpu.barrier_wait(self.k_ready.at[0])

        def first_qk(s_ref: Any) -> Any:
            self.take_turn()
            plgpu.wgmma(s_ref, q_smem, self.k_t(0))
            self.pass_turn()
            return s_ref[...]

        s = pl.run_scoped(first_qk, plgpu.ACC((self.lz.bq, self.lz.bkv), jnp.float32))
        signal(self.k_free, 0)
        p, m_i, l_i, alpha = self.softmax(s, 0, m_i, l_i, row0, masked=True)
        self.next_k(1, n_run)

        step = functools.partial(self.overlap_step, q_smem=q_smem, row0=row0, n_run=n_run)
        carry = (acc, m_i, l_i, p, alpha)
        unmasked_end = jnp.clip(n_full, 1, n_run)
        carry = lax.fori_loop(1, unmasked_end, functools.partial(step, masked=False), carry)
        acc, m_i, l_i, p, alpha = lax.fori_loop(unmasked_end, n_run, functools.partial(step, masked=True), carry)

        # The last block's P V alone.
        last = ring_slot(n_run - 1, stages)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        def last_pv(o_ref: Any) -> None:
            self.take_turn()
            plgpu.barrier_wait(self.v_ready.at[last])
            plgpu.wgmma(o_ref, p, self.v_smem.at[last])
            self.pass_turn()

        acc = pl.run_state(last_pv)(plgpu.ACC.init(acc))
        signal(self.v_free, last)

        def drain(j: Any, _: Any) -> None:
            # Blocks only the other consumer needs: release them, and keep passing turns.
            self.release(j)
            self.take_turn()
            self.pass_turn()

        lax.fori_loop(n_run, cta_blocks, drain, None)
        return acc, m_i, l_i

    def overlap_step(self, j: Any, carry: Any, *, masked: bool, q_smem: Any, row0: Any, n_run: Any) -> Any:
        """Block ``j`` of ``overlapped``: its Q K^T beside block ``j - 1``'s P V."""
        stages = self.lz.stages
        acc, m_i, l_i, p, alpha = carry
        slot, prev = ring_slot(j, stages), ring_slot(j - 1, stages)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        def gemms(refs: Any) -> None:
            o_ref, p_ref, m_ref, l_ref, alpha_ref = refs

            def with_s(s_ref: Any) -> None:
                self.take_turn()
                plgpu.wgmma(s_ref, q_smem, self.k_t(slot))
                plgpu.barrier_wait(self.v_ready.at[prev])
                plgpu.wgmma(o_ref, p, self.v_smem.at[prev])
                self.pass_turn()
                # Q K^T done (P V, issued after it, may still run): its softmax overlaps P V.
                s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
                signal(self.k_free, slot)
                p_ref[...], m_ref[...], l_ref[...], alpha_ref[...] = self.softmax(
                    s, j, m_ref[...], l_ref[...], row0, masked)

            pl.run_scoped(with_s, plgpu.ACC((self.lz.bq, self.lz.bkv), jnp.float32))

        acc, p, m_i, l_i, alpha = pl.run_state(gemms)((plgpu.ACC.init(acc), p, m_i, l_i, alpha))
        signal(self.v_free, prev)
        self.next_k(j + 1, n_run)
        return acc, m_i, l_i, p, alpha

    # -- a tile's epilogue -------------------------------------------------------------------------

    def finish(self, q_smem: Any, acc: Any, m_i: Any, l_i: Any, b: Any, head: Any, row0: Any, piece: Any) -> None:
        l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
        acc = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
        lse = m_i * self.lz.qk_scale + jnp.log2(l_safe)  # m_i unscaled: see exponents
        # Rows that see no key ran masked blocks only (their max still the masked score's) or none
        # (-inf): their LSE is _MASKED, finite, as the contract asks of the rows a kernel pads
        # (no Inf in any array, for jax.debug_infs); the caller turns a real row's into -inf.
        lse = jnp.where(m_i > _MASKED, lse, _MASKED)
        if self.lz.mods is not None:
            # A mask_mod's such rows are zeros, here rather than in a pass over the output.
            acc = jnp.where(lax.broadcast_in_dim(m_i, acc.shape, [0]) > _MASKED, acc, 0.0)
        if piece is None:
            self.store(q_smem, acc, lse, b, head, row0)
            return
        pl.when(piece < 0)(lambda: self.store(q_smem, acc, lse, b, head, row0))

        @pl.when(piece >= 0)
        def _() -> None:
            # A piece's output stays float32 for the merge (from registers: a float32 tile
            # would not fit beside the ring), its LSE beside it.
            part_out, part_lse = self.parts
            bq = self.lz.bq
            part_lse[piece, pl.ds(self.wg * bq, bq)] = lse
            part_out[piece, pl.ds(self.wg * bq, bq)] = acc

    def store(self, q_smem: Any, acc: Any, lse: Any, b: Any, head: Any, row0: Any) -> None:
        """A whole tile's output and LSE."""
        bq, dtype, o_staged = self.lz.bq, self.lz.dtype, self.lz.o_staged
        # The LSE goes from registers straight to global memory (64 floats a consumer):
        # no shared staging buffer (its 512 bytes were more than a third K/V stage or
        # 64x192 tiles missed the shared memory by).
        self.lse_ref[b, head, pl.ds(row0, bq)] = lse
        if self.cfg.persistent and not o_staged:
            # q_smem is loading the next tile's Q: the output goes from registers.
            store_to_gmem(self.out_ref.at[b, pl.ds(row0, bq), head], acc.astype(dtype))
            return
        # Staged in the output's own tile (persistent) or in Q's, done with.
        o_smem = self.o_smem2[0].at[self.wg] if o_staged else q_smem
        if o_staged:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read it
        o_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, self.out_ref.at[b, pl.ds(row0, bq), head])
        if not o_staged:
            plgpu.wait_smem_to_gmem(0, wait_read_only=self.cfg.store_read_wait)

    # -- the warpgroups ----------------------------------------------------------------------------

    def q_slot(self, r: Any) -> tuple[Any, Any]:
        """Round ``r``'s Q tile in shared memory and its barrier."""
        wg = self.wg
        if self.lz.q_slots == 1:
            return self.q_smem2.at[wg], self.q_ready.at[wg]
        slot = ring_slot(r, 2)
        return self.q_smem2.at[2 * wg + slot], self.q_ready.at[2 * wg + slot]

    def load_q(self, r: Any) -> None:
        b, head, tile_start, *_ = self.tile(self.tile_of(r))
        q_smem, ready = self.q_slot(r)
        bq = self.lz.bq
        plgpu.copy_gmem_to_smem(self.q_ref.at[b, pl.ds(tile_start + self.wg * bq, bq), head], q_smem, ready)

    def consumer(self) -> None:
        plgpu.set_max_registers(232, action="increase")
        self.load_q(0)
        self.per_tile(self.consumer_round)
        if self.lz.o_staged:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # before the CTA's shared memory goes

    def consumer_round(self, r: Any, base: Any) -> Any:
        """Round ``r`` of a consumer: its tile's rows over their key blocks, then the epilogue."""
        lz, cfg, blocks, bq, rounds = self.lz, self.cfg, self.lz.blocks, self.lz.bq, self.rounds
        b, head, tile_start, cta_blocks, lo, piece = self.tile(self.tile_of(r))
        row0 = tile_start + self.wg * bq
        if lz.alibi:
            self.slope = self.slopes_ref[head]
        if lz.mods is not None:  # both consumers run the tile's list: partial blocks, then full ones
            n_partial, self.key_block = self.listed(b, head, tile_start)
            n_blocks, start = cta_blocks, 0
            spans: Any = ((0, n_partial, True), (n_partial, n_blocks, False))
        else:
            n_blocks = blocks.seen_before(row0 + bq)
            if piece is not None:  # full attention, a piece: its blocks alone
                n_blocks = cta_blocks
            start = blocks.run_start(row0, lo, n_blocks)
            spans = blocks.spans(row0, bq, start, n_blocks)
        if lz.q_slots == 2:
            # The other slot held the last tile's Q, whose wgmmas have all completed.
            pl.when(r + 1 < rounds)(lambda: self.load_q(r + 1))
        q_smem, ready = self.q_slot(r)
        plgpu.barrier_wait(ready)

        m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((bq, lz.head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        if cfg.overlap:
            acc, m_i, l_i = self.overlapped(q_smem, (acc, m_i, l_i), row0=row0, n_blocks=n_blocks,
                                            n_full=spans[0][1], cta_blocks=cta_blocks)
        else:
            acc, m_i, l_i = self.in_turns(q_smem, (acc, m_i, l_i), row0=row0, spans=spans, n_blocks=n_blocks,
                                          cta_blocks=cta_blocks, base=base, first=r == 0,
                                          last=r + 1 == rounds, lo=lo, start=start)
        if cfg.persistent and lz.q_slots == 1:
            # Every wgmma reading this Q has completed: load the next one under the epilogue.
            pl.when(r + 1 < rounds)(lambda: self.load_q(r + 1))
        self.finish(q_smem, acc, m_i, l_i, b, head, row0, piece)
        return base + plus(cta_blocks, -lo)

    def producer(self) -> None:
        plgpu.set_max_registers(40, action="decrease")
        lz = self.lz

        def run(r: Any, base: Any) -> Any:
            b, head, tile_start, cta_blocks, lo, _ = self.tile(self.tile_of(r))
            listed = beside = None
            if lz.mods is not None:
                n_partial, listed = self.listed(b, head, tile_start)
                lead_b, lead_h, per_block = lz.mods
                rows = (b if lead_b > 1 else 0, head if lead_h > 1 else 0,
                        pl.ds(lax.div(tile_start, jnp.int32(lz.bq)), 2))

                def beside(j: Any, key_block: Any, slot: Any) -> None:
                    words = self.bits_ref.at[(*rows, pl.ds(key_block * per_block, per_block))]
                    pl.when(j < n_partial)(
                        lambda: plgpu.copy_gmem_to_smem(words, self.bits_smem.at[slot], self.bits_ready.at[slot]))

            stream_kv(self.k_ref, self.v_ref, (self.k_smem, self.v_smem), (self.k_ready, self.v_ready),
                      (self.k_free, self.v_free), b=b, kv_head=lax.div(head, jnp.int32(lz.group)),
                      n_blocks=plus(cta_blocks, -lo), block=lz.bkv, stages=lz.stages, base=base, first=lo,
                      listed=listed, beside=beside)
            return base + plus(cta_blocks, -lo)

        self.per_tile(run)


def merge_pieces(out: Any, lse: Any, part_out: Any, part_lse: Any, *, tiles: tuple[Any, Any, Any],
                 pieces: int) -> tuple[Any, Any]:
    """``out`` ``(B, T, Hq, D)`` and ``lse`` ``(B, Hq, T)`` (log2) with the tiles ``tiles``
    (their batch, head and query-tile index, ``(n,)`` each) set from their ``pieces`` pieces:
    ``part_out`` ``(n * pieces, rows, D)`` float32, the attention of a tile's rows over a piece
    of the keys, and ``part_lse`` ``(n * pieces, rows)`` its log2-sum-exp. The tile is their
    sum weighted by ``2**(lse_piece - lse)``, ``lse`` the log2 of the pieces' summed
    ``2**lse_piece``. Plain jax (CPU-testable)."""
    n = tiles[0].shape[0]
    rows = part_out.shape[1]
    part_out = part_out.reshape(n, pieces, rows, -1)
    part_lse = part_lse.reshape(n, pieces, rows)
    top = part_lse.max(axis=1)
    weight = jnp.exp2(part_lse - top[:, None])
    total = weight.sum(axis=1)
    # Elementwise, not a dot: a float32 dot may run in TF32 on a GPU.
    merged = (weight[..., None] * part_out).sum(axis=1) / total[..., None]
    b, head, q_idx = (x[:, None] for x in tiles)
    row = q_idx * rows + jnp.arange(rows, dtype=jnp.int32)[None]
    out = out.at[b, row, head].set(merged.astype(out.dtype))
    lse = lse.at[b, head, row].set(top + jnp.log2(total))
    return out, lse
