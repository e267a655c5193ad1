"""``MosaicFlashAttention``: ``mosaic_flash`` on Hopper GPUs, the Pallas Mosaic GPU kernel of
this package, differentiated by cuDNN's backward fed its output and lse (``backward``).

This module imports no jax: ``kernel`` (and through it ``jax.experimental.pallas.mosaic_gpu``)
is imported when the first call runs, so listing, ``explain`` and ``supports`` stay cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxattn.call import AttentionCall
from jaxattn.capabilities import Feature
from jaxattn.device import DeviceInfo
from jaxattn.impl import AttentionImpl
from jaxattn.output import AttentionOutput
from jaxattn.problem import AttentionProblem
from jaxattn_mosaic.plugin import MOSAIC_FLASH

__all__ = ["WHY_NOT", "MosaicFlashAttention", "device_reasons", "grad_reasons"]

#: Why the features it lacks are declined (added to the generic reason).
WHY_NOT: dict[Feature, str] = {
    Feature.MASK: "mosaic_flash masks only causally (bottom-right) and past the key length; no dense mask",
    Feature.BIAS: "mosaic_flash adds no bias to the logits",
    Feature.SLIDING_WINDOW: "mosaic_flash has no sliding window yet (causal or full only)",
    Feature.SEGMENT_IDS: "mosaic_flash has no segment ids (no packed sequences)",
    Feature.SOFT_CAP: "mosaic_flash has no logits soft cap",
    Feature.SINKS: "mosaic_flash has no attention sinks",
    Feature.DROPOUT: "mosaic_flash has no dropout (no in-kernel random generator)",
    Feature.WEIGHTS: "flash attention never forms the (B, Hq, T, S) probabilities",
    Feature.VALUE_DIM: "mosaic_flash needs v's head dim equal to q's and k's",
    Feature.KV_LENGTHS: "mosaic_flash has no per-sequence key lengths",
    Feature.QUANTIZED_KV: "mosaic_flash reads no quantized K/V",
}


def grad_reasons(problem: AttentionProblem, device: DeviceInfo) -> list[str]:
    """Why cuDNN's backward (fed mosaic_flash's output and lse: ``backward.py``) cannot
    differentiate ``problem`` here."""
    try:
        from jaxattn_sdpa.cudnn import cudnn_reasons, cudnn_version
        from jaxattn_sdpa.residual import unavailable
    except ImportError as err:
        return [f"mosaic_flash's backward is cuDNN's, through jaxattn-sdpa, which is not importable here ({err}); "
                'pip install "jaxattn[gpu]"']
    reasons = [f"cuDNN's backward cannot be fed mosaic_flash's residuals: {why}"] if (why := unavailable()) else []
    reasons += [r for r in cudnn_reasons(problem, device, cudnn_version()) if r not in reasons]
    if problem.causal and problem.seq_q != problem.seq_k:
        reasons.append(f"mosaic_flash's backward (cuDNN's) aligns a causal mask top-left: differentiated causal "
                       f"calls need T == S, got T={problem.seq_q}, S={problem.seq_k}; the forward alone runs "
                       "bottom-right causal")
    return reasons


def device_reasons(device: DeviceInfo) -> list[str]:
    """Why the kernel cannot run on ``device``: it needs Hopper (sm_90: wgmma, TMA, setmaxnreg)."""
    if device.platform != "gpu":
        return [f"Pallas Mosaic GPU runs on NVIDIA Hopper GPUs only (sm_90); it does not run on {device.platform}"]
    cc = device.compute_capability
    if cc is not None and not str(cc).startswith("9."):
        return [f"mosaic_flash is built for Hopper (compute capability 9.0: wgmma, TMA); this GPU is {cc}"]
    return []


class MosaicFlashAttention(AttentionImpl, declaration=MOSAIC_FLASH):
    """Warp-specialised flash attention forward in Pallas Mosaic GPU (a TMA producer warpgroup,
    two consumer warpgroups ping-ponging on asynchronous wgmma)."""

    why_not = WHY_NOT

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
        reasons += device_reasons(self.device)
        if problem.needs_grad and not reasons:
            reasons += grad_reasons(problem, self.device)
        return reasons

    def notes(self, problem: AttentionProblem) -> list[str]:
        return ["backward: cuDNN's, fed this forward's output and lse (no forward of cuDNN's runs)"]

    def forward_cuda(self, call: AttentionCall) -> AttentionOutput:
        from jaxattn_mosaic.kernel import Config, default_config, mosaic_attention_forward

        cfg = default_config(int(call.q.shape[-1]), causal=call.causal, kv_len=int(call.k.shape[1]))
        overrides = self._overrides()
        if overrides:
            cfg = Config(
                block_q=overrides.get("block_q", cfg.block_q),
                block_kv=overrides.get("block_k", cfg.block_kv),
                stages=overrides.get("num_stages", cfg.stages),
            )
        def forward(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
            return mosaic_attention_forward(q, k, v, causal=call.causal, softmax_scale=call.softmax_scale, config=cfg)

        attend: Callable[[Any, Any, Any], tuple[Any, Any]] = forward
        if not self.grad_reasons(call.problem):
            from jaxattn_mosaic.backward import with_cudnn_backward

            attend = with_cudnn_backward(forward, causal=call.causal, softmax_scale=call.softmax_scale)
        out, lse = attend(call.q, call.k, call.v)
        return AttentionOutput(attention_outputs=out, softmax_lse=lse)

    def _overrides(self) -> dict[str, int]:
        md = self.metadata
        return {n: v for n in ("block_q", "block_k", "num_stages") if (v := getattr(md, n, None)) is not None}
