"""``MosaicFlashAttention``: ``mosaic_flash`` on Hopper GPUs, the Pallas Mosaic GPU kernels of
this package: its forward, differentiated by its own backward kernel or by cuDNN's backward fed
its output and lse (``backward``; which one: :func:`backward_choice`).

This module imports no jax: ``kernel`` (and through it ``jax.experimental.pallas.mosaic_gpu``)
is imported when the first call runs, or when ``explain`` describes a call this backend would
run (on a Hopper GPU), so listing, choosing and ``supports`` stay cheap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from jaxattn.backend import (
    AttentionCall,
    AttentionImpl,
    AttentionMetadata,
    AttentionOutput,
    AttentionProblem,
    DeviceInfo,
    Feature,
    InvalidInputError,
)
from jaxattn_mosaic.plugin import MOSAIC_FLASH

if TYPE_CHECKING:
    from jaxattn_mosaic.kernel import Config

__all__ = [
    "OWN_BACKWARD_BELOW_KEYS",
    "OWN_BACKWARD_HEAD_DIMS",
    "SCORE_MOD_ONLY_ALIBI",
    "WHY_NOT",
    "MosaicFlashAttention",
    "backward_choice",
    "cudnn_grad_reasons",
    "device_reasons",
    "requested_backward",
]

#: Why the features it lacks are declined (added to the generic reason).
WHY_NOT: dict[Feature, str] = {
    Feature.MASK: "mosaic_flash masks only causally (bottom-right) and past the key length; no dense mask",
    Feature.BIAS: "mosaic_flash adds no bias to the logits",
    Feature.SEGMENT_IDS: "mosaic_flash has no segment ids (no packed sequences)",
    Feature.SINKS: "mosaic_flash has no attention sinks",
    Feature.DROPOUT: "mosaic_flash has no dropout (no in-kernel random generator)",
    Feature.WEIGHTS: "flash attention never forms the (B, Hq, T, S) probabilities",
    Feature.VALUE_DIM: "mosaic_flash needs v's head dim equal to q's and k's",
    Feature.KV_LENGTHS: "mosaic_flash has no per-sequence key lengths",
    Feature.QUANTIZED_KV: "mosaic_flash reads no quantized K/V",
}

#: Why a score_mod other than ``masks.alibi`` is declined.
SCORE_MOD_ONLY_ALIBI = (
    "mosaic_flash runs only the score_mod jaxattn.masks.alibi(slopes) (its term added in registers): a Mosaic GPU "
    "kernel cannot run a traced JAX function over the logits (a mask_mod is evaluated in JAX into packed bits it "
    "reads); blockwise or vanilla runs any score_mod"
)

#: Head dims this package's backward kernel takes (``backward_kernel.HEAD_DIMS``; declared here
#: too so that choosing imports no kernel; a GPU test asserts the two agree).
OWN_BACKWARD_HEAD_DIMS = (64, 128)
#: With ``mosaic_backward="auto"``, calls with fewer keys than this take the own backward even
#: where cuDNN's runs. Measured on an H100 (bf16, D=128; benchmarks/mosaic_bench.py --bench --bwd,
#: cuDNN's forward+backward in the same run): own forward+backward 1.16x (full) and 1.28x
#: (causal) cuDNN's at 8 x 1024 keys, 0.94x and 1.00x at 4 x 4096, 0.90-0.97x at 8k and 16k;
#: mosaic's forward with cuDNN's backward 0.99-1.02x everywhere.
OWN_BACKWARD_BELOW_KEYS = 4096

Backward = Literal["own", "cudnn"]
BACKWARDS = ("auto", "own", "cudnn")


def cudnn_grad_reasons(problem: AttentionProblem, device: DeviceInfo) -> list[str]:
    """Why cuDNN's backward (fed mosaic_flash's output and lse: ``backward.py``) cannot
    differentiate ``problem`` here."""
    try:
        from jaxattn_sdpa.cudnn import cudnn_reasons, cudnn_version
        from jaxattn_sdpa.residual import unavailable
    except ImportError as err:
        return [f"cuDNN's backward is reached through jaxattn-sdpa, which is not importable here ({err}); "
                'pip install "jaxattn[gpu]"']
    reasons = [f"cuDNN's backward cannot be fed mosaic_flash's residuals: {why}"] if (why := unavailable()) else []
    reasons += [r for r in cudnn_reasons(problem, device, cudnn_version()) if r not in reasons]
    if problem.logits_soft_cap is not None:
        reasons.append("cuDNN's backward takes no logits soft cap")
    if problem.mask_mod:
        reasons.append("cuDNN's backward takes no mask_mod")
    if problem.score_mod:
        reasons.append("cuDNN's backward takes no score_mod")
    if problem.sliding_window is not None:
        reasons.append("cuDNN's backward, fed mosaic_flash's residuals, takes no sliding window")
    if problem.causal and problem.seq_q != problem.seq_k:
        reasons.append(f"cuDNN's backward aligns a causal mask top-left: it needs T == S, got T={problem.seq_q}, "
                       f"S={problem.seq_k}")
    return reasons


def _own_reasons(problem: AttentionProblem) -> list[str]:
    if problem.head_dim in OWN_BACKWARD_HEAD_DIMS:
        return []
    dims = " and ".join(map(str, OWN_BACKWARD_HEAD_DIMS))
    return [f"mosaic_flash's own backward takes head dims {dims}, got {problem.head_dim} (its dK/dV "
            "accumulators would not fit a warpgroup's registers)"]


def requested_backward(metadata: AttentionMetadata) -> str:
    """``metadata.extra["mosaic_backward"]``: "auto" (default), "own" or "cudnn"."""
    requested = str(metadata.extra.get("mosaic_backward", "auto"))
    if requested not in BACKWARDS:
        raise InvalidInputError("metadata.extra['mosaic_backward']", f"{requested!r} is not one of {list(BACKWARDS)}",
                                "'auto' picks per call; 'own' is this package's kernel, 'cudnn' cuDNN's")
    return requested


def backward_choice(problem: AttentionProblem, device: DeviceInfo,
                    requested: str = "auto") -> tuple[Backward | None, list[str]]:
    """The backward that differentiates ``problem`` and, when none can, every reason.

    "auto": the own kernel below :data:`OWN_BACKWARD_BELOW_KEYS` keys (measured faster there)
    and wherever cuDNN's backward cannot run the call (odd lengths, causal with T != S, no
    cuDNN); cuDNN's elsewhere (head dim 256, and long sequences, where it measured faster).
    """
    own = _own_reasons(problem)
    if requested == "own":
        return (None, own) if own else ("own", [])
    cudnn = cudnn_grad_reasons(problem, device)
    if requested == "cudnn":
        return (None, cudnn) if cudnn else ("cudnn", [])
    if not own and (cudnn or problem.seq_k < OWN_BACKWARD_BELOW_KEYS):
        return "own", []
    if not cudnn:
        return "cudnn", []
    return None, own + cudnn


def device_reasons(device: DeviceInfo) -> list[str]:
    """Why the kernel cannot run on ``device``: it needs Hopper (sm_90: wgmma, TMA, setmaxnreg)."""
    if device.platform != "gpu":
        return [f"Pallas Mosaic GPU runs on NVIDIA Hopper GPUs only (sm_90); it does not run on {device.platform}"]
    cc = device.compute_capability
    if cc is not None and not str(cc).startswith("9."):
        return [f"mosaic_flash is built for Hopper (compute capability 9.0: wgmma, TMA); this GPU is {cc}"]
    return []


def _window(problem: AttentionProblem) -> tuple[int | None, int | None]:
    """The sides of ``problem``'s sliding window that cut (``blocks.window_sides``; imported on
    use, as the kernels are)."""
    from jaxattn_mosaic.blocks import window_sides

    return window_sides(problem.sliding_window, problem.seq_q, problem.seq_k)


class MosaicFlashAttention(AttentionImpl, declaration=MOSAIC_FLASH):
    """Warp-specialised flash attention forward in Pallas Mosaic GPU (a TMA producer warpgroup,
    two consumer warpgroups ping-ponging on asynchronous wgmma)."""

    why_not = WHY_NOT

    def __init__(self, metadata: AttentionMetadata | None = None, device: DeviceInfo | None = None) -> None:
        super().__init__(metadata, device)
        self._backwards: dict[AttentionProblem, tuple[Backward | None, tuple[str, ...]]] = {}

    def _backward(self, problem: AttentionProblem) -> tuple[Backward | None, list[str]]:
        """:func:`backward_choice` for ``problem`` differentiated, once per problem: the reasons,
        ``notes`` and every forward (each eager call) ask, and cuDNN's reasons look up its version."""
        key = dataclasses.replace(problem, needs_grad=True)
        cached = self._backwards.get(key)
        if cached is None:
            chosen, reasons = backward_choice(key, self.device, requested_backward(self.metadata))
            cached = self._backwards[key] = (chosen, tuple(reasons))
        return cached[0], list(cached[1])

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if self.metadata.softmax_dtype != "float32":
            reasons.append(
                "mosaic_flash computes the softmax in float32; "
                f"softmax_dtype={self.metadata.softmax_dtype!r} cannot be honoured"
            )
        for name, value in self._overrides().items():
            if name.startswith("block") and value % 64:
                reasons.append(f"metadata.{name}={value}: mosaic_flash tiles are multiples of 64 rows")
            if name == "num_stages" and value < 2:
                reasons.append(f"metadata.num_stages={value}: the K/V ring needs at least 2 stages")
        if problem.score_mod and not problem.score_mod_alibi:
            reasons.append(SCORE_MOD_ONLY_ALIBI)
        reasons += device_reasons(self.device)
        if problem.needs_grad and not reasons:
            try:
                reasons += self._backward(problem)[1]
            except InvalidInputError as err:
                reasons.append(str(err))
        return reasons

    def notes(self, problem: AttentionProblem) -> list[str]:
        # Only an impl that runs the call is asked (on a Hopper GPU, where its forward imports
        # the kernel module anyway).
        from jaxattn_mosaic.kernel import schedule_work, sm_count, tail_pieces, tile_schedule

        cfg = self._config(problem)
        said = [f"forward: {cfg.summary()}"]
        window = _window(problem)
        shape: dict[str, Any] = {"batch": problem.batch, "heads": problem.heads_q, "t_len": problem.seq_q,
                                 "s_len": problem.seq_k, "causal": problem.causal, "sms": sm_count(), "window": window}
        if window != (None, None):
            said.append(f"sliding window {window} (None: unbounded): each query tile streams only the band of key "
                        "blocks its rows see, masked at its edges")
        cut, pieces = tail_pieces(cfg, **shape)
        if cut:
            said.append(f"forward's last round: {cut} tiles, each cut by keys into {pieces} pieces for "
                        "the idle SMs and merged by their log-sum-exps")
        scheduled = tile_schedule(cfg, **shape)
        if problem.mask_mod:
            said.append("mask_mod evaluated in JAX into packed bits (32 keys a word; a block_mask built with bits=True "
                        "lends its own), the causal rule and window ANDed in; each kernel walks its tiles' lists: "
                        "empty tiles never loaded, full ones without mask arithmetic, partial ones expanding the bits "
                        "in registers; one CTA per SM looping over the tiles")
        if problem.score_mod_alibi:
            said.append("score_mod masks.alibi: slopes[h] * (kv_idx - q_idx) added to each score in registers, "
                        "forward and backward (the slopes' gradient from the dQ kernel's row sums)")
        if scheduled is not None:
            work = schedule_work(*scheduled)
            over = max(work) / (sum(work) / len(work)) - 1
            said.append(f"forward's causal tiles: scheduled over {len(work)} SMs, heaviest first, a few heads at "
                        f"a time; the busiest SM has {100 * over:.1f}% more key blocks than the mean")
        try:
            chosen, _ = self._backward(problem)
        except InvalidInputError:
            return said
        if chosen == "own":
            said.append("backward: this package's Mosaic GPU kernels (dQ, then dK/dV; deterministic), fed this "
                        "forward's output and lse")
        if chosen == "cudnn":
            said.append("backward: cuDNN's, fed this forward's output and lse (no forward of cuDNN's runs)")
        return said

    def _config(self, problem: AttentionProblem) -> Config:
        """The forward kernel's ``Config`` for ``problem``: its measured default, with the tiles
        ``AttentionMetadata`` gives."""
        from jaxattn_mosaic.kernel import default_config, mod_config

        tiles = self._overrides()
        if problem.mask_mod:
            cfg = mod_config(problem.head_dim)
            return dataclasses.replace(cfg, block_q=tiles.get("block_q", cfg.block_q),
                                       block_kv=tiles.get("block_k", cfg.block_kv),
                                       stages=tiles.get("num_stages", cfg.stages))
        return default_config(problem.head_dim, causal=problem.causal, kv_len=problem.seq_k, window=_window(problem),
                              block_q=tiles.get("block_q"), block_kv=tiles.get("block_k"),
                              stages=tiles.get("num_stages"))

    def forward_cuda(self, call: AttentionCall) -> AttentionOutput:
        from jaxattn_mosaic.kernel import mosaic_attention_forward

        slopes = None
        if call.score_mod is not None:
            from jaxattn import masks

            slopes = masks.alibi_slopes(call)
            if slopes is None:  # declined by the call; a direct forward_* call must not drop it
                raise NotImplementedError(SCORE_MOD_ONLY_ALIBI)
        cfg = self._config(call.problem)
        k, v, bits = call.k, call.v, None
        causal, window = call.causal, call.sliding_window
        if call.mask_mod is not None:
            from jaxattn_mosaic.mods import call_bits, unread_zeroed

            # The kernels read the mask_mod's bits, the causal rule and window ANDed in.
            bits = call_bits(call.mask_mod, call.block_mask, batch=call.problem.batch, heads=call.problem.heads_q,
                             t_len=call.problem.seq_q, s_len=call.problem.seq_k, causal=causal,
                             window=_window(call.problem))
            k, v = unread_zeroed(k, v, bits, call.mask_mod)
            causal, window = False, None

        # The arrays beside q, k and v, arguments of the custom gradient (they may be traced).
        aux = {n: a for n, a in (("bits", bits), ("alibi_slopes", slopes)) if a is not None}

        def forward(q: Any, k: Any, v: Any, **given: Any) -> tuple[Any, Any]:
            return mosaic_attention_forward(q, k, v, causal=causal, softmax_scale=call.softmax_scale,
                                            soft_cap=call.logits_soft_cap, sliding_window=window, config=cfg,
                                            **(given or aux))

        attend: Callable[[Any, Any, Any], tuple[Any, Any]] = forward
        chosen, _ = self._backward(call.problem)
        if chosen is not None:
            from jaxattn_mosaic import backward

            if chosen == "own":
                attend = backward.with_own_backward(forward, causal=causal, softmax_scale=call.softmax_scale,
                                                    soft_cap=call.logits_soft_cap, sliding_window=window, aux=aux)
            else:
                attend = backward.with_cudnn_backward(forward, causal=causal, softmax_scale=call.softmax_scale)
        out, lse = attend(call.q, k, v)
        return AttentionOutput(attention_outputs=out, softmax_lse=lse)

    def _overrides(self) -> dict[str, int]:
        md = self.metadata
        return {n: v for n in ("block_q", "block_k", "num_stages") if (v := getattr(md, n, None)) is not None}
