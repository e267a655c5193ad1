"""The quantized-cache conformance cases: calls over an int8 / float8 KV cache, as data.

A ``QuantizedCase`` takes a case of the paged matrix (``paged_cases``) or of the dense one with
``kv_lengths`` (``cases``) and stores its cache in one format (``int8``, ``float8_e4m3fn``,
``float8_e5m2``) at one granularity (``tensor``, ``head``, ``token``; ``jaxattn.quantize_kv``).
Every slot no sequence reads (rows past a length, spare pages) is poisoned in the narrow values
(NaN / Inf where the format has them, out-of-range int8 otherwise) and, per token, in the scales
(K NaN, V Inf): the contract says they are unread. The float64 oracle gets the dequantized cache
without the poison (``values * scale`` in float64), so the check is "attention over the cache the
quantized one means"; the error against the unquantized cache is the format's, measured in
docs/serving.md, not checked here.

The suites hook these in: ``PagedConformanceSuite.test_quantized_kv`` and
``ConformanceSuite.test_quantized_kv``; a backend that does not declare
``Feature.QUANTIZED_KV`` must decline each with reasons.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..backend.quantize import GRANULARITIES, QUANTIZED_KV_DTYPES
from .paged_cases import read_slots

__all__ = ["QUANTIZED_DENSE_CASES", "QUANTIZED_PAGED_CASES", "QuantizedCase", "quantize_dense_inputs",
           "quantize_paged_inputs", "quantized_to_jax"]

_FORMATS = tuple(sorted(QUANTIZED_KV_DTYPES))  # float8_e4m3fn, float8_e5m2, int8


@dataclasses.dataclass(frozen=True)
class QuantizedCase:
    """The case named ``base`` of the paged or dense matrix, its cache in ``kv_dtype`` at ``granularity``."""

    base: str
    kv_dtype: str
    granularity: str

    @property
    def name(self) -> str:
        return f"{self.base}-{self.kv_dtype}-{self.granularity}"


def _latin(bases: tuple[str, ...]) -> tuple[QuantizedCase, ...]:
    """Every format x granularity once, the base cases rotated so that each format and each
    granularity meets every base (a 3 x 3 Latin square over three bases)."""
    return tuple(QuantizedCase(bases[(i + j) % len(bases)], fmt, gran)
                 for i, fmt in enumerate(_FORMATS) for j, gran in enumerate(GRANULARITIES))


#: A uniform decode over a fragmented pool (GQA 8:1), a ragged batch, the combined layout.
QUANTIZED_PAGED_CASES: tuple[QuantizedCase, ...] = _latin(("decode_gqa_8to1_permuted", "ragged_mixed",
                                                           "decode_combined"))
#: Dense decode and speculative steps over a cache with per-sequence lengths.
QUANTIZED_DENSE_CASES: tuple[QuantizedCase, ...] = _latin(("kv_lengths_decode", "kv_lengths_spec",
                                                           "kv_lengths_decode"))


def _quantize(x: np.ndarray, qcase: QuantizedCase) -> tuple[np.ndarray, np.ndarray]:
    import jax.numpy as jnp

    from ..backend.quantize import quantize_kv

    values, scale = quantize_kv(jnp.asarray(x, jnp.float32), qcase.kv_dtype, qcase.granularity)
    return np.asarray(values), np.asarray(scale, np.float32)


def _dequantize64(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return values.astype(np.float64) * scale.astype(np.float64)[..., None]


def _poison(values: np.ndarray, scale: np.ndarray, unread: np.ndarray, which: str,
            granularity: str) -> tuple[np.ndarray, np.ndarray]:
    """``values`` and ``scale`` with every unread slot (``unread``: the cache's shape without its
    last two axes) holding garbage: K NaN, V Inf (int8: -128 / 127, outside or at the symmetric
    range's edge); scales too where they are per token (a shared scale is read by someone)."""
    values, scale = values.copy(), scale.copy()
    name = values.dtype.name
    if name == "int8":
        bad: Any = -128 if which == "k" else 127
    elif name == "float8_e4m3fn":  # no infinity in this format
        bad = np.nan
    else:
        bad = np.nan if which == "k" else np.inf
    values[unread] = np.asarray(bad).astype(values.dtype)
    if granularity == "token":
        scale[unread] = np.float32(np.nan if which == "k" else np.inf)
    return values, scale


def quantize_paged_inputs(case: Any, qcase: QuantizedCase, arrays: dict[str, Any]) -> tuple[dict[str, Any],
                                                                                         dict[str, Any]]:
    """``(call arrays, oracle arrays)`` of a paged case (``arrays``: ``make_paged_inputs``'s).

    The call's cache is quantized and poisoned where unread, with ``k_scale`` and ``v_scale``;
    the oracle's is the dequantized cache in float64 (same keys as ``arrays``)."""
    combined = "kv_pages" in arrays
    k, v = (arrays["kv_pages"][:, :, 0::2], arrays["kv_pages"][:, :, 1::2]) if combined else \
        (arrays["k_pages"], arrays["v_pages"])
    (kq, ks), (vq, vs) = _quantize(k, qcase), _quantize(v, qcase)
    unread = ~read_slots(arrays["page_table"], case.kv_lens, k.shape[0], k.shape[1])
    call, ref = dict(arrays), dict(arrays)
    kq_bad, ks_bad = _poison(kq, ks, unread, "k", qcase.granularity)
    vq_bad, vs_bad = _poison(vq, vs, unread, "v", qcase.granularity)
    if combined:
        kv = np.empty(arrays["kv_pages"].shape, kq.dtype)
        kv[:, :, 0::2], kv[:, :, 1::2] = kq_bad, vq_bad
        call["kv_pages"] = kv
        deq = np.empty(arrays["kv_pages"].shape)
        deq[:, :, 0::2], deq[:, :, 1::2] = _dequantize64(kq, ks), _dequantize64(vq, vs)
        ref["kv_pages"] = deq
    else:
        call["k_pages"], call["v_pages"] = kq_bad, vq_bad
        ref["k_pages"], ref["v_pages"] = _dequantize64(kq, ks), _dequantize64(vq, vs)
    call["k_scale"], call["v_scale"] = ks_bad, vs_bad
    return call, ref


def quantize_dense_inputs(qcase: QuantizedCase, arrays: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(call arrays, oracle arrays)`` of a dense case with ``kv_lengths`` (``make_inputs``'s):
    k and v quantized, poisoned at positions past each length, plus ``k_scale`` and ``v_scale``."""
    (kq, ks), (vq, vs) = _quantize(arrays["k"], qcase), _quantize(arrays["v"], qcase)
    s = kq.shape[1]
    unread = np.arange(s)[None, :] >= np.asarray(arrays["kv_lengths"])[:, None]  # (B, S)
    call, ref = dict(arrays), dict(arrays)
    call["k"], call["k_scale"] = _poison(kq, ks, unread, "k", qcase.granularity)
    call["v"], call["v_scale"] = _poison(vq, vs, unread, "v", qcase.granularity)
    ref["k"], ref["v"] = _dequantize64(kq, ks), _dequantize64(vq, vs)
    return call, ref


def quantized_to_jax(arrays: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The call's arrays as jax arrays: q (and other floats) in ``dtype``, the narrow cache as it
    is, scales and sinks float32, indices int32, masks bool."""
    import jax.numpy as jnp

    out: dict[str, Any] = {}
    for name, value in arrays.items():
        kind = np.asarray(value).dtype
        if kind.name in QUANTIZED_KV_DTYPES:
            out[name] = jnp.asarray(value)
        elif name in ("k_scale", "v_scale", "softmax_aux", "d_output"):
            out[name] = jnp.asarray(value, jnp.float32)
        elif kind.kind == "b":
            out[name] = jnp.asarray(value, bool)
        elif np.issubdtype(kind, np.integer):
            out[name] = jnp.asarray(value, jnp.int32)
        else:
            out[name] = jnp.asarray(value, dtype)
    return out
