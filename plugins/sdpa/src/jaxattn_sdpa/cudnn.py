"""What cuDNN flash attention (through ``jax.nn``, ``implementation="cudnn"``) can take.

The limits are jax's own checks (``jax/_src/cudnn/fused_attention_stablehlo.py``, the same in
jax 0.10 and 0.11) plus two that jax does not check and that would otherwise give wrong
numbers rather than errors. Everything here is static: shapes, flags, the GPU's compute
capability and the cuDNN version, so ``supports`` and ``explain`` can answer for
``jax.ShapeDtypeStruct`` inputs.

How a call reaches cuDNN (see ``kernel.py``): ``is_causal`` / the sliding window natively
only when T == S (cuDNN's own alignment for T != S is not part of jax's contract, so we
never rely on it); everything else (masks, segment ids, bands with T != S, sinks) goes in
as one additive bias tensor of full ``(T, S)`` extent, which is what cuDNN accepts.
``kv_lengths`` go in as cuDNN's ``kv_seqlen`` (mask type ``PADDING``) when they are the
whole rule, and as a per-sequence ``(B, 1, T, S)`` mask when causal or a window must align
to each length (cuDNN's ``PADDING_CAUSAL`` is top-left, as jax exposes it).
"""

from __future__ import annotations

import dataclasses
import functools

from jaxattn.backend import AttentionProblem, DeviceInfo

from .translate import Band, kv_band_restricts, structural_band

__all__ = [
    "EMPTY_ROWS_GRAD",
    "CudnnLayout",
    "band_is_native",
    "cudnn_layout",
    "cudnn_reasons",
    "cudnn_version",
    "sink_columns",
]

EMPTY_ROWS_GRAD = (
    "cuDNN's backward returns NaN for queries that see no key, as bottom-right causal with T > S leaves the "
    "first T - S queries (seen on an H200, jax 0.11.2); use impl='sdpa' (XLA) for training such shapes"
)


@functools.lru_cache(maxsize=1)
def cudnn_version() -> int | None:
    """The cuDNN version jax's CUDA plugin loads (e.g. 91000), or None without one."""
    try:
        # jax keeps this module private; it is the only place that reports cuDNN's presence.
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except Exception:  # a plugin without a loadable libcudnn counts as none
        return None


def _capability(device: DeviceInfo) -> tuple[int, int] | None:
    if device.compute_capability is None:
        return None
    major, _, minor = device.compute_capability.partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        return None


def band_is_native(t: int, s: int, band: Band | None) -> bool:
    """Whether cuDNN runs the band itself (``is_causal``, ``local_window_size=(l, 0)``).

    Only for T == S, where top-left and bottom-right agree, and only for bands cuDNN has: a
    right edge on the diagonal and a left edge at or below it (cuDNN's window is
    ``(i - w, i]`` with ``w >= 1``).
    """
    if band is None:
        return True
    return t == s and band.hi == 0 and (band.lo is None or band.lo <= 0)


def sink_columns(s: int) -> int:
    """Keys prepended for a sink on cuDNN: the sink, plus a masked one when S is even.

    cuDNN's backward with a bias needs an even S, so S keeps its parity.
    """
    return 1 if s % 2 else 2


@dataclasses.dataclass(frozen=True)
class CudnnLayout:
    """What cuDNN receives for one call."""

    band: Band | None
    band_native: bool
    seq_k: int  # S after sink columns
    bias_sources: tuple[str, ...]  # what the additive bias tensor carries; empty = no bias tensor
    bias_batch: int  # its batch dim (1 or B)
    differentiable_bias: bool  # carries the user's bias or sinks (whose gradients flow through it)


def cudnn_layout(problem: AttentionProblem, *, segment_mask: bool | None = None) -> CudnnLayout:
    """The layout of ``problem`` on cuDNN. ``segment_mask``: segment ids become a mask (the
    default assumes they do; only concrete padding patterns become sequence lengths)."""
    t, s, b = problem.seq_q, problem.seq_k, problem.batch
    seg = problem.segment_ids if segment_mask is None else segment_mask
    per_sequence = problem.kv_lengths and kv_band_restricts(t, s, problem.causal, problem.sliding_window)
    if problem.kv_lengths:  # the band follows each sequence's length: kv_seqlen, or a mask
        band, native = None, True
    else:
        band = structural_band(t, s, problem.causal, problem.sliding_window)
        native = band_is_native(t, s, band) and not (problem.sinks and band is not None)
    sources: list[str] = []
    batch = 1
    if problem.bias_shape is not None:
        sources.append("bias")
        batch = max(batch, problem.bias_shape[0])
    if problem.mask_shape is not None:
        sources.append("mask")
        batch = max(batch, problem.mask_shape[0])
    if seg:
        sources.append("segment ids")
        batch = max(batch, b)
    if not native:
        sources.append("causal/sliding window as a mask (cuDNN aligns them natively only for T == S)")
    if per_sequence:
        sources.append("kv_lengths with causal/sliding window as a per-sequence mask")
    if problem.kv_lengths and (per_sequence or (problem.mask_shape is not None and not problem.sinks)):
        # The mask follows the lengths (and, without sinks, shows key 0 to rows that see nothing).
        batch = b
    if problem.sinks:
        sources.append("sinks")
    return CudnnLayout(
        band=band,
        band_native=native,
        seq_k=s + (sink_columns(s) if problem.sinks else 0),
        bias_sources=tuple(sources),
        bias_batch=batch,
        differentiable_bias=problem.bias_shape is not None or problem.sinks,
    )


def cudnn_reasons(problem: AttentionProblem, device: DeviceInfo, version: int | None) -> list[str]:
    """Why cuDNN cannot run ``problem`` on ``device`` (beyond dtype/feature declarations).

    ``problem.needs_grad`` adds the limits of cuDNN's backward pass.
    """
    reasons: list[str] = []
    if version is None:
        reasons.append(
            "cuDNN is not available to jax here (no jax CUDA plugin with cuDNN was found); "
            "install jax[cuda12] or jax[cuda13] on an NVIDIA GPU host"
        )
    capability = _capability(device)
    if capability is not None and capability < (8, 0):
        reasons.append(
            f"cuDNN flash attention needs an sm_80 (Ampere) or newer GPU; this one is "
            f"sm_{capability[0]}{capability[1]}"
        )
    # The declared range (8..256, CudnnAttention.head_dims) covers sm_90+; older GPUs stop at 128.
    pre_hopper = capability is not None and capability < (9, 0)
    for label, dim in (("head dim", problem.head_dim), ("value head dim", problem.head_dim_v)):
        if dim % 8:
            reasons.append(f"cuDNN needs a {label} that is a multiple of 8, got {dim}")
        if pre_hopper and dim > 128:
            reasons.append(f"cuDNN takes a {label} of at most 128 before sm_90, got {dim}")
    if problem.needs_grad:
        layout = cudnn_layout(problem)
        # jax's Python guard names only patterns with a bias, but its cuDNN backward refuses
        # odd lengths without one too (seen on an H200, jax 0.11.2: causal T=S=9 and decode
        # T=1 raised "Unsupported sequence length").
        if problem.seq_q % 2 or layout.seq_k % 2:
            carried = f" (the bias carries: {', '.join(layout.bias_sources)})" if layout.bias_sources else ""
            reasons.append(
                f"cuDNN's backward pass needs even T and S, got T={problem.seq_q}, S={layout.seq_k}{carried}; "
                "use impl='sdpa' (XLA for these lengths) or pad to even lengths"
            )
        if problem.causal and problem.seq_q > problem.seq_k:
            reasons.append(EMPTY_ROWS_GRAD)
        if layout.differentiable_bias and layout.bias_batch > 1:
            reasons.append(
                "cuDNN computes the bias gradient only for a bias shared across the batch, (1, Hq, T, S); "
                "this call's bias tensor varies over the batch (it carries: "
                f"{', '.join(layout.bias_sources)}); use impl='sdpa' or a bias with batch dim 1"
            )
    return reasons
