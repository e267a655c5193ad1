"""When the Pallas TPU ragged paged-attention kernel can serve a call, in pure Python.

No jax here: an AttentionImpl lists its capabilities and explains a refusal from static
facts (dtypes, head counts and dims, page geometry, requested features) without tracing,
and importing this module costs nothing. ``kernel.py`` and ``decode.py`` run the same
rules, so a call these functions accept is a call the wrappers run.

The kernel, ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (identical source in
jax 0.10.2 and 0.11.2; only its tuned-block-size table's device-name parsing differs), as
read from its source and checked by lowering it for TPU from a CPU host:

* KV cache in the combined layout ``(num_pages, page_size, 2 * Hkv, D)``, K head h at
  ``2h``, V head h at ``2h + 1``: one head dim for q, k and v;
* q and the cache in float32 or bfloat16 (its q folding asserts one of the two; float8/int
  caches need ``k_scale``/``v_scale``, which this wrapper does not expose);
* the head dim must be a multiple of 128: the softmax statistics live in 128-lane rows and
  are tiled onto the ``(rows, D)`` accumulator (an assertion at trace time, on every
  platform). Zero padding of q/k and of v's dropped columns is exact;
* ``2 * Hkv`` must be "XLA fully tiled" for the cache dtype's packing p (32 / bits): a
  multiple of p whose quotient is 1, 2, 4, 8 or a multiple of 8, else it raises. Extra
  zero KV heads (with zero query heads, outputs dropped) are exact;
* it processes ``8 * p`` combined heads (or all of them) per grid step with the matching
  query heads; when that query-head count is not itself fully tiled for q's packing it
  silently falls back to all heads per step. Of the head counts upstream's tests list,
  (12, 2) is the one that takes this fallback, and it is the one they report broken
  ("(12, 2) does not work after libtpu-2025-07-21"). Padding each group of query heads
  with zero heads keeps every call on the tiled path, exactly, at a little extra compute;
* causal masking per sequence, bottom-right aligned (row i of a q_len-row sequence sits at
  ``kv_len - q_len + i``); ``sliding_window=w`` hides keys ``j <= pos - w``, i.e. the query
  sees itself and ``w - 1`` keys before it, so the contract's ``window_left`` is ``w - 1``
  (``w`` must be positive); ``soft_cap`` applies ``c * tanh(x / c)`` to the scaled logits,
  as the contract does, and must not be 0;
* no attention sinks and no log-sum-exp output, so sinks cannot be added outside the
  kernel (a dummy key carrying the sink logit would have to sit at position 0 of every
  sequence, shifting the whole cache, and a window would hide it): they are declined;
* its tuned block sizes come from a table keyed on the TPU generation that raises off TPU
  and on TPU v2/v3 (upstream tests skip below v4); the wrappers always pass their own
  block sizes (:func:`ragged_tiling`), so that lookup never runs, and decline v2/v3;
* TPU interpret mode cannot run it: the kernel reshapes (and, for bfloat16, bitcasts)
  VMEM refs and reads them with a stride, which the interpreter's ref accessor does not
  model ("'ReshapeTransform' object has no attribute 'indices'" on jax 0.10.2 and 0.12.1),
  and the older HLO interpreter (``interpret=True``) fails discharging the kernel's masked
  ``pltpu.store`` on an integer-indexed ref. Whether this jax's interpreter can is asked of
  it, not of a version number (:func:`interpreter_runs_kernel`: a tiny kernel doing the
  same to a ref, run once a process): interpret mode is declined wherever it cannot. CPU
  CI checks the wrappers by lowering the real kernel for TPU and by running them over an
  emulation of the kernel's semantics (``tests/pallas/test_ragged.py``);
* page sizes: nothing in the kernel's source or its lowering constrains them; upstream
  tests only 16, and whether Mosaic compiles every size on a TPU is unverified here.

Dynamic hazards the wrappers fix up outside the kernel (see ``kernel.py``): rows past
``cu_q_lens[num_seqs]`` and rows that see no key are left as garbage (uninitialised VMEM
or an average of masked keys), a real sequence with ``kv_len == 0`` breaks the kernel's
prefetch chain (the next sequence would read its pages), and ``num_seqs == 0`` leaves a
started DMA unawaited.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import re
from typing import Any, Literal

__all__ = [
    "DEFAULT_QUERIES_PER_BLOCK",
    "KV_BUFFER_BUDGET_BYTES",
    "LANES",
    "MAX_DEFAULT_KV_PAGES_PER_BLOCK",
    "SUPPORTED_DTYPES",
    "Layout",
    "RaggedTiling",
    "installed_jax_version",
    "interpreter_probe",
    "interpreter_runs_kernel",
    "kernel_heads_per_block",
    "paged_decode_reasons",
    "ragged_reasons",
    "ragged_tiling",
]

Layout = Literal["separate", "combined"]

LANES = 128
SUPPORTED_DTYPES = ("float32", "bfloat16")
_BITS = {"float32": 32, "bfloat16": 16}
#: Upstream's untuned default for the query block (its table's fallback is (128 pages, 32)).
DEFAULT_QUERIES_PER_BLOCK = 32
#: Each KV page of a block is its own DMA, unrolled in the kernel body: 16 keeps the code
#: small and matches the 4 to 16 pages upstream's tuned table picks.
MAX_DEFAULT_KV_PAGES_PER_BLOCK = 16
#: The double-buffered KV block stays under this, so that with the q block, the float32
#: accumulator and the softmax statistics it fits the 16 MiB default scoped VMEM of TPU v4/v5e.
KV_BUFFER_BUDGET_BYTES = 8 * 2**20

_KERNEL = "the Pallas TPU ragged paged attention kernel"


@functools.cache
def installed_jax_version() -> tuple[int, ...]:
    """The installed jax version as integers, read from package metadata (jax is not imported)."""
    return _parse_version(importlib.metadata.version("jax"))


def _parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


@functools.cache
def interpreter_runs_kernel(dtype: str) -> bool:
    """Whether this jax's TPU interpreter runs what the ragged kernel does to its KV buffer:
    reshape a VMEM ref, read it with a stride and, for bfloat16, bitcast it to uint32 first.

    Asked of the interpreter itself, once a process and dtype, with a kernel of one (8, 128)
    tile (:func:`interpreter_probe`): a version ceiling would either lock out a jax that fixed
    it or, as jax 0.12.1 did, wave through one that had not and crash inside the call. Eager
    even under a trace; the interpreter's state is reset after a failure (a failed
    interpretation poisons the next one), and jax's log of the failed callback is held back."""
    import logging

    import jax
    import numpy as np
    from jax.experimental.pallas import tpu as pltpu

    call, x = interpreter_probe(dtype)
    log = logging.getLogger("jax._src.callback")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with jax.ensure_compile_time_eval(), pltpu.force_tpu_interpret_mode():
            np.asarray(call(x))
    except Exception:  # any failure means: this interpreter cannot run the kernel
        pltpu.reset_tpu_interpret_mode_state()
        return False
    finally:
        log.setLevel(level)
    return True


def interpreter_probe(dtype: str) -> tuple[Any, Any]:
    """``(call, x)``: the Pallas TPU call :func:`interpreter_runs_kernel` runs (a legal Mosaic
    kernel: it lowers for a TPU) and its input."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl

    packed = dtype == "bfloat16"
    rows = 32 if packed else 16

    def kernel(x_ref: Any, o_ref: Any) -> None:
        flat = x_ref.reshape(rows, LANES)
        if packed:
            o_ref[...] = flat.bitcast(jnp.uint32)[0::2, :].astype(jnp.float32)
        else:
            o_ref[...] = flat[0::2, :]

    x = np.arange(rows * LANES, dtype=np.float32).reshape(2, rows // 2, LANES).astype(jnp.dtype(dtype))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, LANES), jnp.float32)), x


def _packing(dtype: str) -> int:
    return 32 // _BITS[dtype]


def _fully_tiled(n: int, packing: int) -> bool:
    """The kernel's ``can_be_xla_fully_tiled``."""
    if n % packing:
        return False
    n //= packing
    return n in (1, 2, 4, 8) or n % 8 == 0


def kernel_heads_per_block(num_q_heads: int, num_kv_heads: int, q_dtype: str, kv_dtype: str) -> tuple[int, int] | None:
    """``(q heads, combined kv heads)`` per grid step as the kernel picks them, or None where
    it raises (a mirror of its ``get_min_heads_per_blk``)."""
    combined = 2 * num_kv_heads
    kv_packing = _packing(kv_dtype)
    if not _fully_tiled(combined, kv_packing):
        return None
    tiling = 8 * kv_packing
    min_combined = tiling if combined % tiling == 0 else combined
    min_q = min_combined // 2 * (num_q_heads // num_kv_heads)
    if _fully_tiled(min_q, _packing(q_dtype)):
        return min_q, min_combined
    return num_q_heads, combined


@dataclasses.dataclass(frozen=True)
class RaggedTiling:
    """What the kernel is given for one call: padded sizes, block sizes, its window."""

    head_dim: int  # D of q, k and v as the kernel sees them (a multiple of 128)
    num_kv_heads: int  # Hkv, padded with zero heads until 2 * Hkv is fully tiled
    q_per_kv: int  # query heads per KV head, padded so each grid step is fully tiled
    num_queries_per_block: int
    num_kv_pages_per_block: int
    num_tokens: int  # query rows, padded to a multiple of num_queries_per_block
    sliding_window: int | None  # the kernel's: window_left + 1
    cache_copy: str | None  # what the one whole-cache copy the call makes does, if it makes one

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.q_per_kv


def _shape_reasons(
    *,
    q_dtype: str,
    kv_dtype: str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    layout: Layout,
    page_size: int,
    softmax_scale: float,
    logits_soft_cap: float | None,
    window_left: int | None,
    num_queries_per_block: int | None,
    num_kv_pages_per_block: int | None,
) -> list[str]:
    reasons = []
    for name, dtype in (("q", q_dtype), ("the KV cache", kv_dtype)):
        if dtype not in SUPPORTED_DTYPES:
            reasons.append(f"{name} dtype {dtype} is not supported by {_KERNEL} (float32 or bfloat16)")
    if q_dtype != kv_dtype:
        reasons.append(f"q ({q_dtype}) and the KV cache ({kv_dtype}) must share a dtype")
    if num_kv_heads <= 0 or num_q_heads <= 0 or num_q_heads % num_kv_heads:
        reasons.append(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if head_dim <= 0 or v_head_dim <= 0:
        reasons.append(f"head dims must be positive, got D={head_dim}, Dv={v_head_dim}")
    if layout == "combined" and v_head_dim != head_dim:
        reasons.append("the combined KV layout has one head dim for K and V")
    if page_size <= 0:
        reasons.append(f"page_size must be positive, got {page_size}")
    if not math.isfinite(softmax_scale):
        reasons.append(f"softmax_scale must be finite, got {softmax_scale}")
    if logits_soft_cap is not None and not (math.isfinite(logits_soft_cap) and logits_soft_cap > 0):
        reasons.append(f"logits_soft_cap must be a positive finite number, got {logits_soft_cap}")
    if window_left is not None and (isinstance(window_left, bool) or not isinstance(window_left, int)
                                    or window_left < 0):
        reasons.append(f"window_left must be a non-negative int, got {window_left!r}")
    for name, value in (("num_queries_per_block", num_queries_per_block),
                        ("num_kv_pages_per_block", num_kv_pages_per_block)):
        if value is not None and value <= 0:
            reasons.append(f"{name}={value} must be positive")
    return reasons


def ragged_reasons(
    *,
    q_dtype: str,
    kv_dtype: str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    layout: Layout,
    page_size: int,
    softmax_scale: float = 1.0,
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    has_sinks: bool = False,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    interpret: bool = False,
    interpreter_runs: bool | None = None,
    tpu_generation: int | None = None,
    allow_cache_copy: bool = True,
) -> list[str]:
    """Every reason :func:`jaxattn_pallas.ragged.kernel.ragged_paged_attention` cannot run a call
    with these static facts; empty when it can.

    Dtypes are names (``"bfloat16"``). ``v_head_dim`` equals ``head_dim`` for the combined
    layout. ``interpreter_runs`` (with ``interpret``): whether TPU interpret mode runs the
    kernel, by default :func:`interpreter_runs_kernel` of the KV dtype; ``tpu_generation`` (4 for v4,
    ...) is checked when given. With ``allow_cache_copy=False`` a call that would copy the
    whole KV cache (separate layout, or padding of heads or head dims) is refused too.
    """
    reasons = _shape_reasons(
        q_dtype=q_dtype, kv_dtype=kv_dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, v_head_dim=v_head_dim, layout=layout, page_size=page_size,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, window_left=window_left,
        num_queries_per_block=num_queries_per_block, num_kv_pages_per_block=num_kv_pages_per_block,
    )
    if has_sinks:
        reasons.append(
            f"attention sinks (softmax_aux) are not supported: {_KERNEL} has no extra softmax term "
            "and returns no log-sum-exp, so they cannot be added exactly outside it"
        )
    if interpret and kv_dtype in SUPPORTED_DTYPES and not (
            interpreter_runs_kernel(kv_dtype) if interpreter_runs is None else interpreter_runs):
        shown = ".".join(map(str, installed_jax_version()))
        reasons.append(
            f"TPU interpret mode of jax {shown} cannot run {_KERNEL}: it reshapes and bitcasts "
            "VMEM refs, which the interpreter does not model"
        )
    if tpu_generation is not None and tpu_generation < 4:
        reasons.append(f"{_KERNEL} needs TPU v4 or newer (upstream raises and skips its tests below v4)")
    if not reasons and not allow_cache_copy:
        tiling = ragged_tiling(
            q_dtype=q_dtype, kv_dtype=kv_dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, v_head_dim=v_head_dim, layout=layout, page_size=page_size,
            pages_per_seq=1, num_tokens=1, window_left=window_left,
        )
        if tiling.cache_copy is not None:
            reasons.append(f"would copy the whole KV cache ({tiling.cache_copy})")
    return reasons


def paged_decode_reasons(*, q_len: int, **facts: Any) -> list[str]:
    """:func:`ragged_reasons` for :func:`jaxattn_pallas.ragged.decode.paged_decode`, whose queries
    are ``q_len`` tokens per sequence (any ``q_len >= 0`` runs)."""
    reasons = [] if q_len >= 0 else [f"q_len must be non-negative, got {q_len}"]
    return reasons + ragged_reasons(**facts)


def _default_kv_pages(pages_per_seq: int, page_size: int, combined_per_block: int, head_dim: int,
                      itemsize: int) -> int:
    page_bytes = page_size * combined_per_block * head_dim * itemsize
    fits = max(1, KV_BUFFER_BUDGET_BYTES // (2 * page_bytes))
    return max(1, min(pages_per_seq, MAX_DEFAULT_KV_PAGES_PER_BLOCK, fits))


def ragged_tiling(
    *,
    q_dtype: str,
    kv_dtype: str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    layout: Layout,
    page_size: int,
    pages_per_seq: int,
    num_tokens: int,
    window_left: int | None = None,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
) -> RaggedTiling:
    """The kernel's view of a call. Raises ``ValueError`` listing every shape reason it
    cannot run (feature, platform and interpret reasons are :func:`ragged_reasons`' job).

    An explicit ``num_kv_pages_per_block`` larger than ``pages_per_seq`` is clamped to it;
    query rows are padded to a multiple of ``num_queries_per_block``.
    """
    reasons = _shape_reasons(
        q_dtype=q_dtype, kv_dtype=kv_dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, v_head_dim=v_head_dim, layout=layout, page_size=page_size, softmax_scale=1.0,
        logits_soft_cap=None, window_left=window_left, num_queries_per_block=num_queries_per_block,
        num_kv_pages_per_block=num_kv_pages_per_block,
    )
    if reasons:
        raise ValueError("; ".join(reasons))
    group = num_q_heads // num_kv_heads
    d = -(-max(head_dim, v_head_dim) // LANES) * LANES

    kv_packing, q_packing = _packing(kv_dtype), _packing(q_dtype)
    hkv = num_kv_heads
    while not _fully_tiled(2 * hkv, kv_packing):
        hkv += 1
    combined = 2 * hkv
    tiling = 8 * kv_packing
    combined_per_block = tiling if combined % tiling == 0 else combined
    g = group
    while not _fully_tiled(combined_per_block // 2 * g, q_packing):
        g += 1

    pads = []
    if d != head_dim or d != v_head_dim:
        dims = f"{head_dim}" if head_dim == v_head_dim else f"{head_dim} (K) and {v_head_dim} (V)"
        pads.append(f"head dims zero-padded from {dims} to {d} (the kernel takes multiples of {LANES})")
    if hkv != num_kv_heads:
        pads.append(f"zero KV heads added ({num_kv_heads} -> {hkv}) so that 2*Hkv tiles the {kv_dtype} layout")
    copy = None
    if layout == "separate":
        copy = "; ".join(["K and V pages interleaved into the kernel's combined layout", *pads])
    elif pads:
        copy = "; ".join(pads)

    bq = num_queries_per_block or min(DEFAULT_QUERIES_PER_BLOCK, max(num_tokens, 1))
    bkv = num_kv_pages_per_block or _default_kv_pages(pages_per_seq, page_size, combined_per_block, d,
                                                      _BITS[kv_dtype] // 8)
    bkv = max(1, min(bkv, pages_per_seq))
    return RaggedTiling(
        head_dim=d,
        num_kv_heads=hkv,
        q_per_kv=g,
        num_queries_per_block=bq,
        num_kv_pages_per_block=bkv,
        num_tokens=-(-num_tokens // bq) * bq,
        sliding_window=None if window_left is None else window_left + 1,
        cache_copy=copy,
    )
