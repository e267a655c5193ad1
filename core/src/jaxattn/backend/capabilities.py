"""What an implementation can do, declared as data, and the generic checks against a problem."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from enum import StrEnum

__all__ = ["ALL_FEATURES", "PLATFORM_TOKENS", "Feature", "head_dim_reason", "platform_matches"]


class Feature(StrEnum):
    """Capabilities a call may need. ``AttentionProblem.required_features()`` lists a call's."""

    CAUSAL = "causal"
    MASK = "mask"
    BIAS = "bias"
    GQA = "gqa"  # Hq != Hkv (grouped-query and multi-query)
    CROSS = "cross"  # T != S
    DECODE = "decode"  # T == 1
    VALUE_DIM = "value_dim"  # Dv != D
    SLIDING_WINDOW = "sliding_window"
    SEGMENT_IDS = "segment_ids"
    SOFT_CAP = "soft_cap"
    SINKS = "sinks"
    DROPOUT = "dropout"
    GRAD = "grad"
    WEIGHTS = "weights"  # fills AttentionOutput.attention_weights
    LSE = "lse"  # fills AttentionOutput.softmax_lse
    KV_LENGTHS = "kv_lengths"  # per-sequence key lengths: decode over a dense KV cache
    # Paged (cached) calls: docs/contract.md, "Serving attention"
    MULTI_TOKEN = "multi_token"  # more than one query per sequence (speculative decoding, chunked prefill)
    RAGGED = "ragged"  # sequences with different query counts packed in one call (mixed prefill and decode)
    # K and V stored as int8 / float8 values with float32 k_scale, v_scale (jaxattn.backend.quantize): the
    # backend reads the narrow cache itself (paged calls, and dense ones with kv_lengths)
    QUANTIZED_KV = "quantized_kv"
    # Masks and scores as programs (jaxattn.masks): mask_mod(b, h, q_idx, kv_idx) -> bool and
    # score_mod(score, b, h, q_idx, kv_idx) -> score, traced into the kernel
    MASK_MOD = "mask_mod"
    SCORE_MOD = "score_mod"


ALL_FEATURES: frozenset[Feature] = frozenset(Feature)

#: Platform tokens an impl may declare: a platform, or a GPU vendor.
PLATFORM_TOKENS = frozenset({"cpu", "gpu", "tpu", "cuda", "rocm"})


def platform_matches(tokens: Iterable[str], platform: str, vendor: str | None) -> bool:
    """Whether an impl declared for ``tokens`` runs on ``platform`` (with GPU ``vendor``)."""
    for token in tokens:
        if token == platform:
            return True
        if platform == "gpu" and token == vendor:
            return True
    return False


def head_dim_reason(label: str, dim: int, allowed: tuple[int, int] | Collection[int]) -> str | None:
    """A reason when ``dim`` is outside a declared range ``(lo, hi)`` or set, else None."""
    if isinstance(allowed, tuple) and len(allowed) == 2 and allowed[0] <= allowed[1]:
        lo, hi = allowed
        if lo <= dim <= hi:
            return None
        return f"{label} {dim} is outside the supported range {lo}..{hi}"
    if dim in allowed:
        return None
    return f"{label} {dim} is not one of the supported sizes {sorted(allowed)}"


def describe_features(features: Iterable[Feature | str]) -> str:
    return ", ".join(sorted(str(f) for f in features)) or "none"
