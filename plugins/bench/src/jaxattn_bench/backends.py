"""What ``jaxattn bench`` times: registered impls, "auto", and JAX's own Pallas-Triton ``mha``.

Each :class:`Contender` (a jaxattn impl, or an outside kernel timed beside them; a "backend"
column of the tables) answers, for one shape and mode, either the reasons it declines (shown
as "declined: ..." cells, never raised) or the function to time plus a note (which impl
"auto" picked, or that an impl hands the call to another).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxattn.backend import AttentionMetadata, JaxattnError

from .shapes import BenchShape

__all__ = ["PALLAS_MHA", "Contender", "Verdict", "available_backends", "make_backend"]

PALLAS_MHA = "pallas_mha"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A backend's answer for one shape and mode."""

    reasons: tuple[str, ...] = ()
    note: str = ""
    fn: Callable[[Any, Any, Any], Any] | None = None

    @property
    def runs(self) -> bool:
        return not self.reasons and self.fn is not None


class Contender:
    name: str

    def verdict(self, shape: BenchShape, mode: str) -> Verdict:
        raise NotImplementedError


class ImplContender(Contender):
    """A registered impl (or "auto") called through ``jaxattn.attention``."""

    def __init__(self, name: str, metadata: AttentionMetadata) -> None:
        self.name = name
        self.metadata = metadata

    def verdict(self, shape: BenchShape, mode: str) -> Verdict:
        import jaxattn

        q, k, v = shape.structs()
        try:
            impl = jaxattn.get_impl(self.name, self.metadata)
            reasons = impl.supports(q, k, v, needs_grad=mode == "fwdbwd", **shape.call_kwargs)
        except (JaxattnError, ImportError) as err:
            return Verdict(reasons=(str(err),))
        if reasons:
            return Verdict(reasons=tuple(reasons))
        name, kw, md = self.name, shape.call_kwargs, self.metadata

        def fn(q: Any, k: Any, v: Any) -> Any:
            return jaxattn.attention(q, k, v, impl=name, metadata=md, **kw)

        return Verdict(note=self._note(impl, shape), fn=fn)

    def _note(self, impl: Any, shape: BenchShape) -> str:
        import jaxattn

        q, k, v = shape.structs()
        if self.name == "auto":
            # What a plain forward call resolves to (attention() cannot know a gradient follows).
            exp = jaxattn.explain(q, k, v, impl="auto", metadata=self.metadata, **shape.call_kwargs)
            chosen = next((c for c in exp.candidates if c.chosen), None)
            grad = chosen.grad_impl if chosen is not None else None
            return f"-> {exp.chosen}" + (f", grad {grad}" if grad else "") + _source(chosen)
        problem = _spec(q, k, v, shape, self.metadata).problem
        fallback = impl.fallback_reasons(problem)
        return f"via {impl.fallback_impl}: {'; '.join(fallback)}" if fallback else ""


def _source(chosen: Any) -> str:
    """What ranked auto's pick first (``jaxattn.selection.tuning``): " (shipped prior)", " (your tuning
    record)" or " (declared priority)"."""
    reason = chosen.rank_reason if chosen is not None else ""
    for source in ("your tuning record", "shipped prior", "declared priority"):
        if reason.startswith(source):
            return f" ({source})"
    return ""


def _spec(q: Any, k: Any, v: Any, shape: BenchShape, metadata: AttentionMetadata) -> Any:
    from jaxattn.backend import resolve_call

    return resolve_call(q, k, v, metadata=metadata, **shape.call_kwargs)


class PallasMhaContender(Contender):
    """``jax.experimental.pallas.ops.gpu.attention.mha``: JAX's own (deprecated) Triton kernel."""

    name = PALLAS_MHA
    block = 128  # mha's default block_q / block_k

    def verdict(self, shape: BenchShape, mode: str) -> Verdict:
        from jaxattn.backend import detect_device

        device = detect_device()
        reasons = []
        if device.platform != "gpu" or device.vendor != "cuda":
            reasons.append(f"needs a CUDA GPU (Pallas Triton lowering); this is {device.label}")
        if shape.group != 1:
            reasons.append("no grouped-query attention (needs Hq == Hkv)")
        if shape.causal and shape.seq_q != shape.seq_k:
            reasons.append("causal with T != S is not bottom-right aligned in mha")
        if shape.sliding_window is not None or shape.soft_cap is not None:
            reasons.append("no sliding window and no logits soft cap in mha")
        for label, n in (("T", shape.seq_q), ("S", shape.seq_k)):
            if n % min(self.block, n):
                reasons.append(f"{label}={n} is not a multiple of its block size {self.block}")
        if reasons:
            return Verdict(reasons=tuple(reasons))
        try:
            from jax.experimental.pallas.ops.gpu.attention import mha
        except ImportError as err:
            return Verdict(reasons=(f"not importable: {err}",))
        scale, causal = shape.head_dim ** -0.5, shape.causal

        def fn(q: Any, k: Any, v: Any) -> Any:
            return mha(q, k, v, None, sm_scale=scale, causal=causal)

        return Verdict(fn=fn)


def make_backend(name: str, metadata: AttentionMetadata) -> Contender:
    return PallasMhaContender() if name == PALLAS_MHA else ImplContender(name, metadata)


def available_backends(metadata: AttentionMetadata) -> list[str]:
    """Every impl usable on this device (best provider per name), by declared priority."""
    from jaxattn.backend import available_here

    return [p.name for p in available_here(metadata, kind="dense")]
