"""Launch descriptions of the paged attention kernels (``kernel.py``), library-free.

A :class:`PagedSpec` is the static description of one call (shapes, layout, features); a
:class:`PagedTiles` the tiling and the number of key splits. :func:`attention` returns a
:class:`~jaxattn_triton.flash.launch.Launch` in ``launch.py``'s style, one launch whatever the
splits (the last split merges them), which ``paged.ops`` runs through ``jax_triton`` and the
tests through ``torch_launch.run_launch``; :func:`run` picks its outputs for either.

The kernels see every query in token-major layout ``(num_tokens, Hq, D)``: paged decode's
``(num_seqs, T, Hq, D)`` and dense decode's ``(B, T, Hq, D)`` are the same memory. The cache
is addressed by ``(page, row in page, head)`` strides:

* separate ``k_pages (P, page_size, Hkv, D)`` / ``v_pages (P, page_size, Hkv, Dv)``;
* combined ``kv_pages (P, page_size, 2*Hkv, D)``: the same array is passed as K and V, K head
  ``h`` at head index ``2h`` and V head ``h`` at ``2h + 1`` (a head stride of ``2*D`` and a
  V offset of ``D`` elements), so no copy is made;
* dense ``k (B, S, Hkv, D)``: one page of ``S`` rows per sequence, ``page = sequence``
  (``identity_pages``, no page-table read).

A quantized cache (``cache_dtype`` int8 / float8_e4m3fn / float8_e5m2, q 16-bit) comes with
float32 scales, each described by its ``(page, row, head)`` strides (0 along a broadcast axis:
``()`` per tensor, ``(Hkv,)`` per head, the full ``(P, page_size, Hkv)`` per token; a dense
cache's ``(B, S, Hkv)`` the same with one page per sequence).

A ragged call's ``mask_mod`` comes as its packed visibility bits and key bounds per query token
(``paged.visibility``; ``mask_heads`` says the bits' head count: 1, or Hq when it uses ``h``).

Kernel arguments: q, k, v, page_table, kv_lengths, cu_q_lens, num_seqs, sinks, k_scale,
v_scale, mask words, mask bounds (absent ones one-element dummies), then the outputs (see
:func:`attention`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from jaxattn_triton.flash.launch import Launch, interpreted
from jaxattn_triton.spec import block_dim

SEPARATE = "separate"
COMBINED = "combined"
DENSE = "dense"

#: Dtypes the kernels take for q and the cache (the same dtype for both).
DTYPES = frozenset({"bfloat16", "float16", "float32"})
#: Narrow cache dtypes the kernels load as they are and dequantize in registers (``cache_dtype``).
QUANT_DTYPES = frozenset({"int8", "float8_e4m3fn", "float8_e5m2"})
#: A scale's element strides along (page, row in page, KV head); 0 along a broadcast axis.
ScaleStrides = tuple[int, int, int]
#: Largest head dim (q/k and v): a [BLOCK_M, 256] float32 accumulator per program.
MAX_HEAD_DIM = 256
#: Query heads of one KV head in one program at most; larger groups are cut into chunks.
MAX_HEAD_CHUNK = 64
#: SMs of an H100 SXM, the default when the device does not say.
DEFAULT_NUM_SMS = 132
#: The lse the kernel writes for a row that sees no key (padding tokens are such rows): the lowest
#: finite float32, not -inf, so that an eager call under jax.debug_infs meets no Inf in the
#: launch's outputs; ``ops`` gives -inf where an lse is asked for (the contract's).
NO_KEY_LSE = -3.4028234663852886e38


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """Static description of one paged (or dense-as-paged) attention call.

    ``q_len`` is the uniform number of queries per sequence (paged/dense decode) or None for
    a ragged batch (``cu_q_lens``/``num_seqs`` arrays). ``max_seqs`` is the number of rows of
    ``page_table``/``kv_lengths``. Query ``i`` of a sequence sits at position
    ``kv_len - q_len + i`` and sees keys ``j`` with ``pos - window_left <= j <= pos +
    window_right`` and ``j < kv_len``; ``window_right = 0`` is causal, None unbounded.
    """

    num_tokens: int
    max_seqs: int
    q_len: int | None
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str
    num_pages: int
    page_size: int
    pages_per_seq: int
    layout: str = SEPARATE
    softmax_scale: float = 1.0
    softcap: float | None = None
    window_left: int | None = None
    window_right: int | None = 0
    sinks: bool = False
    #: The cache's dtype when it is quantized (one of QUANT_DTYPES); None: ``dtype``, as q.
    cache_dtype: str | None = None
    #: Strides of the K / V scales (see :func:`scale_strides`); None: no scale (1).
    k_scale: ScaleStrides | None = None
    v_scale: ScaleStrides | None = None
    #: Heads of a mask_mod's packed bits (``paged.visibility``): 0 none, 1 (it ignores h) or heads_q.
    mask_heads: int = 0

    def __post_init__(self) -> None:
        reasons = self.reasons()
        if reasons:
            raise ValueError("; ".join(reasons))

    def reasons(self) -> list[str]:
        """Why the kernels cannot run this call (empty when they can)."""
        why = []
        if self.heads_kv < 1 or self.heads_q % self.heads_kv:
            why.append(f"heads_q={self.heads_q} must be a positive multiple of heads_kv={self.heads_kv}")
        if self.dtype not in DTYPES:
            why.append(f"dtype {self.dtype} is not one of {sorted(DTYPES)}")
        if max(self.head_dim, self.head_dim_v) > MAX_HEAD_DIM or min(self.head_dim, self.head_dim_v) < 1:
            why.append(f"head dims ({self.head_dim}, {self.head_dim_v}) must lie in 1..{MAX_HEAD_DIM}")
        if self.layout not in (SEPARATE, COMBINED, DENSE):
            why.append(f"unknown cache layout {self.layout!r}")
        if self.layout == COMBINED and self.head_dim != self.head_dim_v:
            why.append("the combined kv_pages layout holds K and V heads of one size (D == Dv)")
        if self.page_size < 1 or self.pages_per_seq < 1 or self.num_pages < 1:
            why.append("the cache needs at least one page of at least one row")
        if self.q_len is not None and self.q_len < 1:
            why.append(f"q_len={self.q_len} must be >= 1")
        if self.softcap is not None and not self.softcap > 0:
            why.append(f"logits_soft_cap={self.softcap} must be > 0")
        if self.window_left is not None and self.window_left < 0:
            why.append(f"window_left={self.window_left} must be >= 0")
        if self.cache_dtype is not None and self.cache_dtype not in QUANT_DTYPES:
            why.append(f"a quantized cache's dtype {self.cache_dtype} is not one of {sorted(QUANT_DTYPES)}")
        if self.cache_dtype is None and (self.k_scale is not None or self.v_scale is not None):
            why.append(
                f"k_scale/v_scale scale a quantized cache ({sorted(QUANT_DTYPES)}); a {self.dtype} cache takes none"
            )
        if self.mask_heads not in (0, 1, self.heads_q):
            why.append(f"mask_heads={self.mask_heads} must be 0, 1 or heads_q={self.heads_q}")
        return why

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def capacity(self) -> int:
        """Tokens a sequence's page-table row can address."""
        return self.pages_per_seq * self.page_size

    @property
    def ragged(self) -> bool:
        return self.q_len is None

    @property
    def quantized(self) -> bool:
        return self.cache_dtype is not None


def scale_mode(strides: ScaleStrides | None) -> int:
    """The kernel's ``K_QUANT``/``V_QUANT``: 0 no scale, 1 one per row (per tensor or per KV
    head: no stride along pages and rows), 2 one per token (and head)."""
    if strides is None:
        return 0
    return 1 if strides[0] == 0 and strides[1] == 0 else 2


def scale_strides(shape: Sequence[int], lead: Sequence[int], name: str = "scale") -> ScaleStrides:
    """Element strides of a C-contiguous scale of ``shape`` broadcast against ``lead``, the
    cache's shape without its last axis (``(P, page_size, Hkv)``, or ``(B, S, Hkv)`` dense).

    ``()`` is one scale per tensor, ``(Hkv,)`` one per head, ``lead`` itself one per token and
    head; any shape that broadcasts works (``(P, page_size, 1)``: one per token), read in
    place. Raises ``ValueError`` naming ``name`` when the shape does not broadcast.
    """
    shape, lead = tuple(int(n) for n in shape), tuple(int(n) for n in lead)
    if len(shape) > len(lead) or any(a not in (1, b) for a, b in zip(shape[::-1], lead[::-1], strict=False)):
        raise ValueError(
            f"{name} has shape {shape}, which does not broadcast against the cache's {lead} (the cache's shape "
            f"without its last axis); pass a scalar (per tensor), ({lead[-1]},) (per head) or {lead} (per token)"
        )
    full = (1,) * (len(lead) - len(shape)) + shape
    strides = [0, 0, 0]
    step = 1
    for axis in (2, 1, 0):
        if full[axis] != 1:
            strides[axis] = step
        step *= full[axis]
    return strides[0], strides[1], strides[2]


@dataclasses.dataclass(frozen=True)
class PagedTiles:
    """``block_q`` query tokens x ``kv_heads`` KV heads x ``head_chunk`` query heads of each
    per program (rows padded to a power of two >= 16), ``block_n`` key tokens per iteration (of
    every one of the ``kv_heads``), ``num_splits`` key splits. ``kv_heads > 1`` needs the
    whole group in the program (``head_chunk == group``) and ``kv_heads`` dividing Hkv.

    ``decode_q > 0`` (ragged batches only) adds one *decode program* per sequence in front of
    the query blocks: a sequence of at most ``decode_q`` queries is attended there, in a tile of
    ``decode_m`` rows with ``decode_block_n`` keys per iteration, and the query blocks skip it,
    so a mixed batch's decode rows keep decode-shaped tiles in the same launch as the prefill
    blocks."""

    block_q: int
    head_chunk: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    kv_heads: int = 1
    decode_q: int = 0
    decode_block_n: int = 0

    @property
    def block_m(self) -> int:
        return max(16, _pow2_at_least(self.block_q * self.head_chunk * self.kv_heads))

    @property
    def decode_m(self) -> int:
        return max(16, _pow2_at_least(self.decode_q * self.head_chunk * self.kv_heads))


def query_blocks(spec: PagedSpec, block_q: int, decode_q: int = 0) -> int:
    """Programs along the grid's first axis (see the kernel module for the ragged allotment),
    with ``max_seqs`` decode programs in front when ``decode_q > 0``."""
    if decode_q > 0:
        return spec.max_seqs + query_blocks(spec, block_q)
    if spec.q_len is not None:
        return spec.max_seqs * _cdiv(spec.q_len, block_q)
    if block_q == 1:
        return spec.num_tokens
    return spec.num_tokens // block_q + spec.max_seqs + 1


#: Decode over a quantized cache: the fewest keys of capacity one key split keeps.
QUANT_SPLIT_KEYS = 1024
#: Decode over a quantized cache of at most this capacity takes 128-token tiles on 4 warps.
QUANT_SHORT_KEYS = 2048


def _split_count(spec: PagedSpec, block_q: int, head_chunk: int, chunks: int, block_n: int, decode_like: bool,
                 num_sms: int) -> tuple[int, int, bool, bool]:
    """``(num_splits, kv_heads, one_wave, filled)`` where the caller left the splits to
    ``default_tiles``: the key splits and KV heads per program, whether the unsplit programs
    make one nearly full wave, and whether they fill the SMs twice over."""
    kv_heads = 1
    if spec.q_len is not None:
        work_blocks = query_blocks(spec, block_q)
    else:
        work_blocks = min(_cdiv(spec.num_tokens, block_q), query_blocks(spec, block_q))
    programs = max(1, work_blocks * spec.heads_kv * chunks)
    # Prefill-shaped blocks (a speculative step's draft tokens, a short chunk over a long cache)
    # aim at one program per SM, each split keeping >= 16 key tiles: a split's fixed cost (its
    # partial written, then merged by the last one) is the block's, not a decode row's. Measured
    # on an H200 (16 query tokens per sequence, GQA 32/8, D 128, bf16, pages of 16 in a random
    # order, 8 calls in one program: tree_mask_bench.py --layers 8 --splits N), us per call,
    # these splits vs twice the SMs' programs: 1 x 32k 110 vs 198 (17 vs 33 splits), 2 x 32k 122
    # vs 168 (9 vs 17), 4 x 32k 176 vs 227 (5 vs 9), 8 x 32k 292 vs 370 (3 vs 5), 1 x 8k 50 vs
    # 138 (8 vs 32); halving the splits again measured up to 1.47x slower (4 x 32k: 258 at 3).
    target, tiles_per_split = (2 * num_sms, 4) if decode_like else (num_sms, 16)
    most = max(1, spec.capacity // (tiles_per_split * block_n))
    filled = programs >= 2 * num_sms
    # Decode whose unsplit programs already make one nearly full wave: splitting adds the
    # combine kernel and shorter runs for little balance gained.
    one_wave = decode_like and 7 * num_sms <= 8 * programs <= 8 * num_sms
    # Decode between one and two waves (32 sequences of 8 KV heads; 64 of 4, as 2-way head
    # sharding holds GQA 32/8): the base tiles, unsplit, one head per program. Measured on an
    # H200 (bf16, D=128, 32 sequences of GQA 32/8, pages of 16 in a random order;
    # plugins/triton/benchmarks/triton_paged_check.py --sweep, cuDNN's dense decode in the same run), us per
    # call at 4k / 16k tokens: 135.9 / 508.2 (cuDNN 137.6 / 508.0) against 145.5 / 536.8 with
    # the one-wave tiles, 143.6 / 533.1 with 2 KV heads per program, 159.3 / 620.9 with 2 splits.
    waves_1_to_2 = decode_like and num_sms < programs < 2 * num_sms
    num_splits = 1 if one_wave or waves_1_to_2 else max(1, min(_cdiv(target, programs), most, 64))
    if filled and decode_like and chunks == 1:
        kv_heads = _one_wave_kv_heads(spec.heads_kv, block_q * head_chunk, programs, num_sms)
    return num_splits, kv_heads, one_wave, filled


def _decode_tiles(one_wave: bool, kv_heads: int, filled_decode: bool, block_n: int, num_warps: int,
                  num_stages: int, num_splits: int) -> tuple[int, int, int, int]:
    """``(block_n, num_warps, num_stages, num_splits)`` for decode whose splits ``_split_count``
    chose: one wave, several KV heads per program, or enough sequences to fill the SMs
    (``filled_decode``); the tiles given otherwise."""
    if one_wave:
        # Measured on an H100 (bf16, D=128, GQA 32/8, 16 sequences = 128 programs for 132 SMs;
        # plugins/triton/benchmarks/triton_paged_check.py --sweep, cuDNN's dense decode in the same run), us per
        # call, these tiles unsplit vs the split default (64-token tiles, 4 warps, 3 splits):
        # pages of 16, 8k tokens 192.4 vs 195.1 (cuDNN 186.6); pages of 64, 8k 190.2 vs 192.4
        # (186.7); pages of 16, 2k 55.7 vs 59.5 (62.2); pages of 16, 32k 746.1 vs 749.5 (713.8).
        block_n, num_warps, num_stages = 128, 8, 3
    elif kv_heads > 1:
        # Decode with several waves of one-head programs: KV heads folded into the program
        # until the programs make one nearly full wave, a tile of 128 rows (tokens x heads).
        # Measured on an H100 (bf16, D=128, GQA 32/8, 64 sequences, pages of 16 in a random
        # order; plugins/triton/benchmarks/paged_probe.py --kv-heads, cuDNN's dense decode in the same run),
        # us per call, 4 heads x 32 tokens unsplit vs one head, 32 tokens, 4 stages: 8k tokens
        # 747.5 vs 766.3 (cuDNN 743.5), 32k 2914.9 vs 2967.7 (2917.8).
        block_n, num_warps, num_stages, num_splits = 128 // kv_heads, 4, 3, 1
    elif filled_decode:
        # Decode with enough sequences to fill the SMs unsplit: shorter key tiles, one more
        # in flight. Measured on an H100 (bf16, D=128, GQA 32/8, 64 sequences, 8k and 32k
        # tokens, pages of 16 and 64; plugins/triton/benchmarks/triton_paged_check.py --sweep): 2887-2921 GB/s
        # against 2698-2787 with 64-token tiles and 3 stages, cuDNN's dense decode 2914-2918.
        # With fewer sequences (splits > 1) 64 tokens and 3 stages stay ahead.
        block_n, num_stages = 32, 4
    return block_n, num_warps, num_stages, num_splits


def _quantized_decode_tiles(spec: PagedSpec, block_q: int, chunks: int, num_sms: int) -> tuple[int, int, int, int, int]:
    """``(kv_heads, num_splits, block_n, num_stages, num_warps)`` of decode over a quantized cache
    whose splits were left to ``default_tiles``."""
    # One byte per value: one KV head x 64 tokens, 2 warps, 3 stages, and about four
    # programs per SM (184 registers, 54 KB of shared memory each: triton 3.9's sm_90
    # build), with splits when the sequences make fewer. Two warps, not four: a tile's row
    # max, row sum and P's layout change cross half as many warps per barrier, and four
    # programs keep an SM's loads going through any one's barriers. Measured on an H100
    # (GQA 32/8, D=128, pages of 16 in a random order, per-head scales; plugins/triton/
    # benchmarks/triton_paged_check.py --quant-sweep --quant-fast --quant-variants, cuDNN's bf16 dense
    # decode in the same run), us per call, these tiles vs the two-per-SM tiles before (one
    # head x 128 tokens, 4 warps, 2 splits at 16 sequences; 2 KV heads x 64 tokens, 4
    # warps at 64), int8 / e4m3: 16 x 8k 114.7 / 115.0 vs 118.3 / 116.7 (cuDNN 190.7),
    # 16 x 32k 404.2 / 412.9 vs 427.7 / 437.2 (733.9), 64 x 8k 408.7 / 405.6 vs 425.6 /
    # 423.1 (740.2). The same reads with no attention at all (plugins/triton/benchmarks/paged_probe.py
    # --quant-floor) take 97.5-101 us at 16 x 8k: what is left above that is the kernel's
    # work, not its memory traffic.
    #
    # A split must keep at least QUANT_SPLIT_KEYS keys of the cache's capacity: below that
    # the combine kernel and the second launch cost more than the balance buys. A short
    # cache (QUANT_SHORT_KEYS or fewer) reads 128-token tiles on 4 warps: twice the bytes in
    # flight per program where the programs are few or short. Measured on an H200 (GQA 32/8,
    # D=128, pages of 16; triton_paged_check.py --quant-sweep --layers 8 --quant-grans
    # token,head --quant-variants ...: eight calls chained in one program, so that the host's
    # dispatch is not what is timed; two runs), us per call, per-token scales int8 / e4m3, these
    # tiles vs the 64-token unsplit tiles on 4 warps before (bf16 paged in the same run):
    # 16 sequences x 512 13.5 / 13.2 vs 14.8 / 14.9 (13.6), x 1k 17.6 / 17.3 vs 23.7 / 24.8
    # (24.7), x 2k (2 splits) 30.4 / 29.9 vs 44.1 / 46.3 (41.2); 64 x 512 34.7 / 34.4 vs
    # 37.6 / 38.4 (40.4), x 2k 89.8 / 89.3 vs 112.3 / 118.2 (135.5); 16 x 4k, 4 splits of 2
    # warps against 2: 46.6 / 46.1 vs 51.4 / 51.7 (72.9). int8 with one scale per KV head
    # (its cheapest widening) keeps 64-token tiles where its programs fill the SMs unsplit:
    # 64 x 512 26.5 against 33.1, x 2k 79.1 against 83.4.
    unsplit = max(1, query_blocks(spec, block_q) * spec.heads_kv * chunks)
    kv_heads = 1
    num_splits = max(1, min((4 * num_sms) // unsplit, spec.capacity // QUANT_SPLIT_KEYS, 64))
    block_n, num_stages, num_warps = 64, 3, 2
    if spec.capacity <= QUANT_SHORT_KEYS:
        int8_per_head = spec.cache_dtype == "int8" and scale_mode(spec.k_scale) == 1
        block_n, num_warps = (64 if int8_per_head and unsplit >= num_sms else 128), 4
    return kv_heads, num_splits, block_n, num_stages, num_warps


def _mixed_decode_rows(spec: PagedSpec, block_q: int, chunks: int, wide: bool, head_chunk: int) -> tuple[int, int]:
    """``(decode_q, decode_block_n)``: the decode programs a ragged batch's short sequences take
    in its launch (``PagedTiles.decode_q``), ``(0, 0)`` for none."""
    if spec.quantized and spec.ragged and block_q > 1 and chunks == 1 and not wide and head_chunk <= 16:
        # A ragged batch with prefill over a quantized cache: its decode rows (sequences of
        # at most 16 rows) take decode programs of their own in the same launch, 16 rows x
        # 128-token tiles (the decode tiles' bytes per stage), instead of a 64-row prefill block
        # of 4 real rows, and the prefill blocks skip them. Measured on an H100 (GQA 32/8,
        # D=128, per-head scales, 64 decode rows at 4k tokens + 4 x 512 prefill at 4k, pages of
        # 16; plugins/triton/benchmarks/triton_paged_check.py --quant-mixed), us per call: int8 857.9 vs 877.3
        # with every row in prefill blocks, 881.9 with 64-token decode tiles (two calls 853.2);
        # e4m3 901.7 (two calls 891.5). ~106 KB of shared memory (the larger branch's, not
        # the sum) and 188 registers (triton 3.9's sm_90 build): still two programs per SM.
        return 16 // head_chunk, 128
    return 0, 0


def default_tiles(spec: PagedSpec, num_sms: int = DEFAULT_NUM_SMS, num_splits: int | None = None) -> PagedTiles:
    """Tiles for the H100/H200 class, and enough key splits to fill the SMs.

    Decode-shaped calls (one or a few queries per sequence) put the whole GQA group of the
    sequence's queries in one program; ragged batches with prefill chunks take about 64 rows
    per program. ``num_splits`` (when not given) is the smallest count that makes at least
    twice as many programs as SMs, with each split keeping >= 4 key tiles of the cache's
    capacity (prefill-shaped blocks: as many programs as SMs, >= 16 tiles a split); decode
    whose unsplit programs fill at least 7/8 of the SMs runs unsplit, and
    decode with enough sequences for several waves puts several KV heads in one program when
    that makes one nearly full wave. Decode over a quantized cache aims at about four programs
    per SM instead (one KV head x 64 tokens, 2 warps; splits to get there when the sequences
    are few and each split keeps ``QUANT_SPLIT_KEYS`` of the cache; caches of at most
    ``QUANT_SHORT_KEYS`` on 128-token tiles of 4 warps); prefill blocks over one take the
    16-bit tiles, and a ragged batch's short sequences decode programs of their own
    (``PagedTiles.decode_q``).
    """
    chunks = _cdiv(spec.group, MAX_HEAD_CHUNK)
    head_chunk = _cdiv(spec.group, chunks)
    rows_per_token = head_chunk
    if spec.q_len is not None:
        block_q = max(1, min(spec.q_len, 64 // rows_per_token))
    elif spec.num_tokens <= spec.max_seqs:
        block_q = 1  # at most one query per sequence on average: a decode batch
    else:
        block_q = max(1, 64 // rows_per_token)
    wide = max(block_dim(spec.head_dim), block_dim(spec.head_dim_v)) > 128
    block_n = 32 if wide else 64
    num_stages = 2 if wide else 3
    block_m = max(16, _pow2_at_least(block_q * head_chunk))
    num_warps = 8 if block_m >= 128 else 4
    # Decode-shaped: a sequence's queries of one KV head fit 16 rows, head dims <= 128.
    decode_like = block_m <= 16 and not wide
    one_wave = filled = False
    kv_heads = 1
    split_free = num_splits is None
    if num_splits is None:
        num_splits, kv_heads, one_wave, filled = _split_count(spec, block_q, head_chunk, chunks, block_n, decode_like,
                                                              num_sms)
    block_n, num_warps, num_stages, num_splits = _decode_tiles(one_wave, kv_heads, filled and decode_like, block_n,
                                                               num_warps, num_stages, num_splits)
    if spec.quantized and decode_like and split_free:
        kv_heads, num_splits, block_n, num_stages, num_warps = _quantized_decode_tiles(spec, block_q, chunks, num_sms)
    decode_q, decode_block_n = _mixed_decode_rows(spec, block_q, chunks, wide, head_chunk)
    return PagedTiles(
        block_q, head_chunk, block_n, num_warps, num_stages, int(num_splits), kv_heads, decode_q, decode_block_n
    )


def _one_wave_kv_heads(heads_kv: int, rows_per_head: int, programs: int, num_sms: int) -> int:
    """KV heads per program (at most 4, dividing Hkv, rows <= 16) that turn ``programs``
    one-head programs into one wave filling at least 7/8 of the SMs; 1 if none does."""
    for kv_heads in (4, 2):
        fewer = programs // kv_heads
        if heads_kv % kv_heads == 0 and rows_per_head * kv_heads <= 16 and 7 * num_sms <= 8 * fewer <= 8 * num_sms:
            return kv_heads
    return 1


def _cache_strides(spec: PagedSpec) -> dict[str, int]:
    hkv, d, dv, ps = spec.heads_kv, spec.head_dim, spec.head_dim_v, spec.page_size
    if spec.layout == COMBINED:
        row = 2 * hkv * d
        return {
            "stride_kp": ps * row, "stride_kt": row, "stride_kh": 2 * d,
            "stride_vp": ps * row, "stride_vt": row, "stride_vh": 2 * d, "V_OFF": d,
        }  # fmt: skip
    return {
        "stride_kp": ps * hkv * d, "stride_kt": hkv * d, "stride_kh": d,
        "stride_vp": ps * hkv * dv, "stride_vt": hkv * dv, "stride_vh": dv, "V_OFF": 0,
    }  # fmt: skip


#: ``V_WORDS`` of the kernel per cache dtype: V tiles read as int32 words of 4 values.
_WORD_FORMATS = {"int8": 1, "float8_e4m3fn": 2, "float8_e5m2": 3}


def v_words(spec: PagedSpec) -> int:
    """The kernel's ``V_WORDS``: the format code (1 int8, 2 e4m3, 3 e5m2) when a quantized V is
    read as int32 words (q 16-bit, every V offset a multiple of 4 values, Dv a power of two
    >= 32), else 0.

    triton 3.6's dot-operand pass fails on the widened tile of a ragged batch with Dv = 16
    ("Illegal shared layout") or a float32 q (the interpreter tests' exact oracle, not a
    serving dtype): those read V byte-wise.

    The kernel multiplies the words lane by lane: ``P @ V`` as four dots of Dv / 4 columns, one
    per byte lane, with no join of the widened lanes into one tile (a layout change through
    shared memory). Why: in triton 3.9's sm_90 build of the int8 decode's default tiles that
    takes 38.9 KB of shared memory a program instead of 55.3 and 4 shared stores a warp a tile
    instead of 20 (876 instructions in the hot loop instead of 807), and on an H200 the
    quantized decode ran 1.31-1.34x faster than with the tile joined (int8 and e4m3, 16 x 32k and
    64 x 8k tokens: 3.85-3.90 TB/s against 2.89-2.96)."""
    if spec.cache_dtype is None or spec.dtype == "float32":
        return 0
    strides = _cache_strides(spec)
    offsets = (strides["stride_vp"], strides["stride_vt"], strides["stride_vh"], strides["V_OFF"])
    dv = spec.head_dim_v
    if dv < 32 or dv != block_dim(dv) or any(x % 4 for x in offsets):
        return 0
    # The offset's sum is P's own only when no per-token scale rides in P.
    to_fp16 = (pv_f16(spec) or spec.dtype == "float16") and scale_mode(spec.v_scale) != 2
    return INT8_OFFSET if to_fp16 and int8_offset(spec) else _WORD_FORMATS[spec.cache_dtype]


#: widen.py's format code of an int8 cache widened to fp16 with its offset left in.
INT8_OFFSET = 4


def int8_offset(spec: PagedSpec) -> bool:
    """Whether an int8 K or V that widens to fp16 widens as ``(v + 128) * 2^-24`` (format code
    ``INT8_OFFSET`` in ``K_WIDEN``/``V_WORDS``): the sign flipped and the byte as an fp16
    subnormal, three instructions for four values where the exact form takes five. The kernel
    takes the offset out of the sums: ``128 * 2^-24`` times the row's sum of q from its scores,
    and 128 times its sum of P (P rounded to fp16, as the product saw it) from its accumulator,
    once a sweep. The decode is bound by the chip's power cap on an H200, where fewer
    instructions a byte run at higher clocks: with the offset the throttled int8 decode ran
    3.5-4.5% faster (16 x 32k and 64 x 8k tokens, SM clock 1852-1875 MHz against 1755-1770).
    The cost is in the sums' rounding: float32's, relative to sums up to 128 / |v| times larger
    than the exact form's; the outputs stay within 2 ulp of the exact form's in bf16 and fp16 at
    every scale granularity (``tests/triton/test_paged_kernels_quantized.py``)."""
    return spec.cache_dtype == "int8"


#: Cache dtypes whose K is widened by ``widen.py`` whatever its scales. An e4m3 K with
#: one scale per row (per tensor or per KV head) takes Triton's own cast instead where V goes
#: to bf16, which ran faster there beside the word-read V; with per-token scales widen.py stays
#: ahead, and where V goes to fp16 (``pv_f16``) so does widen.py. Measured
#: on an H100 (GQA 32/8, D=128, pages of 16; plugins/triton/benchmarks/triton_paged_check.py --quant-sweep,
#: the K_WIDEN ablation, two runs), us per call, Triton's cast vs widen.py, per-head scales:
#: 16 sequences x 32k tokens 441.8 vs 461.3 and 444.7 vs 456.7, 64 x 8k 436.8 vs 446.3, 64 x
#: 32k 1710.9 vs 1743.7, 16 x 8k 122.7 vs 127.6 (the second run's 147.6 vs 126.3 the one
#: reversal); per-token scales 64 x 8k 490.2 vs 479.4, 64 x 32k 1910.7 vs 1853.2.
#: Since Q K^T runs in fp16 for a bf16 q (``qk_f16``), K widens to fp16, where Triton's cast of
#: e4m3 is the hardware's e4m3x2 -> f16x2 as well: those timings were of K widened to bf16.
K_WIDEN_FORMATS = frozenset({"int8", "float8_e5m2"})


def k_widen(spec: PagedSpec) -> int:
    """The kernel's ``K_WIDEN``: the format code when a quantized K is widened by
    ``widen.py`` (the formats of ``K_WIDEN_FORMATS``, any with per-token K scales, and
    any whose V goes to fp16, ``pv_f16``), else 0 (Triton's casts)."""
    if spec.cache_dtype is None or spec.dtype == "float32":
        return 0
    per_token = scale_mode(spec.k_scale) == 2
    # With P V in fp16, V's e4m3 takes the conversion unit (e4m3x2 -> f16x2), and a K through
    # Triton's cast would queue there behind it: K takes widen.py's integer ops.
    cast = not per_token and spec.cache_dtype not in K_WIDEN_FORMATS and not pv_f16(spec)
    if cast:
        return 0
    to_fp16 = qk_f16(spec) or spec.dtype == "float16"
    return INT8_OFFSET if to_fp16 and int8_offset(spec) else _WORD_FORMATS[spec.cache_dtype]


def pv_f16(spec: PagedSpec) -> bool:
    """The kernel's ``PV_F16``: ``P @ V`` in fp16 for a bf16 q over a quantized V with one
    scale per row or none (applied after the sum), its narrow values widened to fp16 (exact for
    every format, and cheaper: e4m3 takes the hardware's e4m3x2 -> f16x2, e5m2 is an fp16's
    high byte) instead of bf16 (bit tricks and a multiply). P lies in [0, 1], where fp16 holds
    more bits than bf16 and flushes only terms below 2^-24. Per-token V scales ride in P
    (``P diag(vs)``), which fp16's range may not hold: those stay bf16. Why: with K widened by
    widen.py beside it, e4m3 at 64 x 32k tokens ran 1.5-4.6% faster on an H100 and int8 within
    1% (alone, with K through Triton's cast, e4m3 was 4-8% slower: both casts queued on the
    conversion unit, hence ``k_widen``)."""
    return spec.cache_dtype is not None and spec.dtype == "bfloat16" and scale_mode(spec.v_scale) != 2


def qk_f16(spec: PagedSpec) -> bool:
    """The kernel's ``QK_F16``: ``Q K^T`` in fp16 for a bf16 q over a quantized K (any scales:
    K's are applied after the product, in float32). Each query row is multiplied by the power of
    two that puts its largest magnitude in [2^14, 2^15) before it is rounded to fp16 (exact: a
    bf16's 8 significant bits fit fp16's 11, and only parts 2^28 below the row's largest lose
    bits), and its scores by the inverse power after the product, with the K scale. The narrow
    K then widens to fp16, the cheap way (int8: 2.5 instructions a pair against about 4 for
    bf16; e4m3: the hardware's e4m3x2 -> f16x2 against 6; e5m2: an fp16's high byte). Why: on
    an H200 the decode ran 2-10% faster for the fp8 formats and 0-6% for int8 (16 x 8k, 16 x 32k,
    64 x 8k tokens)."""
    return spec.cache_dtype is not None and spec.dtype == "bfloat16"


def fused(tiles: PagedTiles) -> bool:
    """The kernel's ``FUSE``: whenever there are splits, their merge runs in the attention launch
    (the split that finishes last merges its rows, behind a ticket counter zeroed before the
    launch). Why: one launch; against a second launch of its own the merge measured within 1%
    at most shapes on an H100, 0-3% faster for fp8 at 16 x 8k tokens and 2-7% at one sequence of
    64k keys (33 splits), 2% slower at 4 x 8k with pages of 64."""
    return tiles.num_splits > 1


def _scale_constexprs(which: str, strides: ScaleStrides | None) -> dict[str, int]:
    sp, st, sh = strides if strides is not None else (0, 0, 0)
    return {
        f"stride_{which}sp": sp, f"stride_{which}st": st, f"stride_{which}sh": sh,
        f"{which.upper()}_QUANT": scale_mode(strides),
    }  # fmt: skip


def launch_grid(spec: PagedSpec, tiles: PagedTiles) -> tuple[int, int, int]:
    """The attention launch's grid: query blocks, KV head groups x head chunks, key splits."""
    chunks = _cdiv(spec.group, tiles.head_chunk)
    return query_blocks(spec, tiles.block_q, tiles.decode_q), spec.heads_kv // tiles.kv_heads * chunks, tiles.num_splits


def _check_tiles(spec: PagedSpec, tiles: PagedTiles) -> None:
    """Refuse tiles the kernel cannot run (``ValueError`` naming the field)."""
    if tiles.head_chunk < 1 or tiles.head_chunk > spec.group:
        raise ValueError(f"head_chunk={tiles.head_chunk} must lie in 1..{spec.group}")
    if tiles.kv_heads < 1 or spec.heads_kv % tiles.kv_heads:
        raise ValueError(f"kv_heads={tiles.kv_heads} must divide heads_kv={spec.heads_kv}")
    if tiles.kv_heads > 1 and tiles.head_chunk != spec.group:
        raise ValueError(f"kv_heads={tiles.kv_heads} > 1 needs head_chunk == group ({spec.group})")
    if tiles.decode_q < 0 or (tiles.decode_q and not spec.ragged):
        raise ValueError(f"decode_q={tiles.decode_q} must be >= 0, and 0 unless the batch is ragged")
    for name in ("block_n", "decode_block_n") if tiles.decode_q else ("block_n",):
        value = getattr(tiles, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two >= 16")
    if tiles.num_splits < 1:
        raise ValueError(f"num_splits={tiles.num_splits} must be >= 1")


def _window_bounds(spec: PagedSpec) -> tuple[int | None, int | None]:
    """``(left, right)``: the window's sides that can cut, None for a side that cannot."""
    # Large windows cut nothing: treat them as unbounded (and keep the arithmetic in int32).
    # A query sits at pos in [-q_len, capacity - 1] and keys at j in [0, capacity - 1]: a left
    # window >= capacity never cuts, a right one only from capacity + q_len - 1 on (a query
    # before the cache's start, T > kv_len, still sees only keys j <= pos + right).
    q_span = spec.q_len if spec.q_len is not None else spec.num_tokens
    left = spec.window_left if spec.window_left is not None and spec.window_left < spec.capacity else None
    right_bound = spec.capacity + q_span
    right = spec.window_right if spec.window_right is not None and spec.window_right < right_bound else None
    return left, right


def _constexprs(spec: PagedSpec, tiles: PagedTiles) -> dict[str, Any]:
    """The attention kernel's compile-time arguments (strides, sizes, features, tiles)."""
    n, hq, dv = spec.num_tokens, spec.heads_q, spec.head_dim_v
    splits = tiles.num_splits
    fuse = fused(tiles)
    identity = spec.layout == DENSE
    left, right = _window_bounds(spec)
    return {
        "stride_qt": hq * spec.head_dim,
        "stride_qh": spec.head_dim,
        **_cache_strides(spec),
        **_scale_constexprs("k", spec.k_scale),
        **_scale_constexprs("v", spec.v_scale),
        "V_WORDS": v_words(spec),
        "K_WIDEN": k_widen(spec),
        "PV_F16": pv_f16(spec),
        "QK_F16": qk_f16(spec),
        "MASK": spec.mask_heads > 0,
        # The mask_mod's words (heads, tokens, words): a token's, a head's (0: one set for every head).
        "stride_mt": _cdiv(spec.capacity, 32),
        "stride_mh": n * _cdiv(spec.capacity, 32) if spec.mask_heads > 1 else 0,
        "ASM": not interpreted(),
        "stride_pt": 0 if identity else spec.pages_per_seq,
        "NUM_TOKENS": n,
        "MAX_SEQS": spec.max_seqs,
        "Q_LEN": spec.q_len if spec.q_len is not None else 0,
        "RAGGED": spec.ragged,
        "SEARCH_STEPS": max(1, (spec.max_seqs + 1).bit_length()),
        "CAPACITY": spec.capacity,
        "HQ": hq,
        "GROUP": spec.group,
        "HEAD_CHUNK": tiles.head_chunk,
        "KV_HEADS": tiles.kv_heads,
        "D": spec.head_dim,
        "DV": dv,
        "PAGE_SIZE": spec.page_size,
        "NUM_PAGES": spec.num_pages,
        "IDENTITY_PAGES": identity,
        "PAGE_PER_TILE": spec.page_size % tiles.block_n == 0,
        "SM_SCALE": float(spec.softmax_scale),
        "SOFTCAP": float(spec.softcap) if spec.softcap else 1.0,
        "LEFT": 0 if left is None else int(left),
        "RIGHT": 0 if right is None else int(right),
        "HAS_LEFT": left is not None,
        "HAS_RIGHT": right is not None,
        "HAS_SOFTCAP": bool(spec.softcap),
        "HAS_SINK": spec.sinks,
        "NUM_SPLITS": splits,
        "FUSE": fuse,
        "BLOCK_Q": tiles.block_q,
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_D": block_dim(spec.head_dim),
        "BLOCK_DV": block_dim(dv),
        "DECODE_Q": tiles.decode_q,
        "DECODE_M": tiles.decode_m,
        "DECODE_N": tiles.decode_block_n if tiles.decode_q else tiles.block_n,
        "DECODE_PAGE_PER_TILE": spec.page_size % (tiles.decode_block_n or tiles.block_n) == 0,
    }


def _outputs(spec: PagedSpec, tiles: PagedTiles, grid: tuple[int, int, int]) -> tuple[tuple[tuple[int, ...], str], ...]:
    """The launch's outputs, ``(shape, dtype)`` each: see ``attention``."""
    n, hq, dv = spec.num_tokens, spec.heads_q, spec.head_dim_v
    splits = tiles.num_splits
    if splits == 1:
        outputs: tuple[tuple[tuple[int, ...], str], ...] = (
            ((n, hq, dv), spec.dtype),
            ((n, hq), "float32"),
            ((1,), "float32"),
        )
    else:
        outputs = (
            ((splits, n, hq, dv), "float32"),
            ((splits, n, hq), "float32"),
            ((splits, n, hq), "float32"),
        )
    if fused(tiles):
        outputs += (((n, hq, dv), spec.dtype), ((n, hq), "float32"), ((grid[0] * grid[1],), "int32"))
    else:
        outputs += (((1,), spec.dtype), ((1,), "float32"), ((1,), "int32"))
    return outputs


def attention(spec: PagedSpec, tiles: PagedTiles) -> Launch:
    """Inputs: q, k, v, page_table, kv_lengths, cu_q_lens, num_seqs, sinks (f32), k_scale and
    v_scale (f32, contiguous, laid out as ``spec.k_scale``/``v_scale`` say; dummies if None), the
    mask_mod's words and bounds (int32, ``paged.visibility``; dummies unless ``spec.mask_heads``).

    Outputs with one split: ``out (N, Hq, Dv)`` in q's dtype, ``lse (N, Hq)`` float32
    (natural log, sinks excluded, -inf for rows without keys), and a one-element dummy.
    With several: float32 partials ``acc (splits, N, Hq, Dv)``, ``m (splits, N, Hq)`` (base-2
    running max) and ``l (splits, N, Hq)``, which the last split of each program group merges
    (:func:`fused`). Then three more: with splits the merged ``out`` and ``lse`` and the ticket
    counters (int32, zeroed), else one-element dummies.
    """
    from jaxattn_triton.paged.kernel import paged_attn_kernel

    _check_tiles(spec, tiles)
    fuse = fused(tiles)
    constexprs = _constexprs(spec, tiles)
    grid = launch_grid(spec, tiles)
    outputs = _outputs(spec, tiles, grid)
    return Launch(
        kernel=paged_attn_kernel,
        grid=grid,
        outputs=outputs,
        constexprs=constexprs,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        zeroed=(5,) if fuse else (),
    )


ArrayT = TypeVar("ArrayT")


def run(
    spec: PagedSpec,
    tiles: PagedTiles,
    inputs: Sequence[ArrayT],
    execute: Callable[[Launch, list[ArrayT]], Sequence[ArrayT]],
) -> tuple[ArrayT, ArrayT]:
    """``(out (N, Hq, Dv), lse (N, Hq))`` of one call, launching through ``execute``.

    ``inputs`` are the twelve kernel inputs of :func:`attention`, or the first ten when the spec
    has no mask_mod, or the first eight when it has no scales either (the sinks and num_seqs arrays
    then stand in for the dummies, never read);
    ``execute(launch, inputs)`` returns the launch's outputs (jax_triton, the interpreter, or torch).
    """
    inputs = list(inputs)
    if len(inputs) == 8:
        if spec.k_scale is not None or spec.v_scale is not None:
            raise ValueError("the spec has k_scale/v_scale strides: pass the scales as inputs 9 and 10")
        inputs += [inputs[7], inputs[7]]
    if len(inputs) == 10:
        if spec.mask_heads:
            raise ValueError("the spec has a mask_mod: pass its words and bounds as inputs 11 and 12")
        inputs += [inputs[6], inputs[6]]
    launch = attention(spec, tiles)
    first = execute(launch, inputs)
    if tiles.num_splits == 1:
        return first[0], first[1]
    return first[3], first[4]
