"""What the paged mechanisms' impls on TPU (op kind "paged") share: ``ragged_page_attention_v3``
(:mod:`jaxattn_pallas.ragged_impl`) and ``page_attention`` (:mod:`jaxattn_pallas.paged_decode_impl`).

Ranking on a TPU: the ragged kernel (priority 100) is the faster one for decode steps too (no
transpose of the pool per step, no extra terms for float32) and takes every call shape, so
"auto" runs it first; ``page_attention`` (priority 50) serves that name, and "auto" in TPU
interpret mode (where the ragged kernel cannot run on jax <= 0.11.2) picks it for decode steps.
Both rank above jaxattn-vanilla's pure-JAX references (priority 0), which provide the same names
on every platform. Neither imports a Pallas module until a call runs.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from jaxattn.backend import PagedAttentionImpl, PagedProblem

__all__ = ["PallasPagedBase"]

_REFERENCE = "impl='vanilla_paged' (jaxattn-vanilla's pure-JAX reference) runs it, and impl='auto' picks it"


def _generation(platform: str, device: Any, interpret: bool) -> int | None:
    """The TPU generation number (4 for v4, 5 for v5e/v5p...) of a real TPU host, else None."""
    gen = getattr(device, "tpu_generation", None)
    if platform != "tpu" or interpret or getattr(device, "platform", None) != "tpu" or not gen:
        return None
    match = re.match(r"v(\d+)", gen)
    return int(match.group(1)) if match else None


class PallasPagedBase(PagedAttentionImpl):
    """What both share: the float32 softmax, the advice on a decline."""

    #: Why JAX's kernel does not read jaxattn's quantized caches (Feature.QUANTIZED_KV is not declared).
    quantized_why: ClassVar[str] = ""

    def instead(self) -> str:
        """Where a call this backend declines runs: jaxattn-vanilla's reference."""
        return "instead: " + _REFERENCE

    def kernel_reasons(self, problem: PagedProblem) -> list[str]:
        """The kernel's own limits beyond the declarations (each with its own advice)."""
        return []

    def not_supported_reasons(self, problem: PagedProblem) -> list[str]:
        declared = self.declared_reasons(problem)
        # The base class starts from the declarations and adds the op kind's own rules (the mesh).
        rest = super().not_supported_reasons(problem)[len(declared):]
        own = []
        if self.metadata.softmax_dtype != "float32":
            own.append(f"the kernel computes the softmax in float32; softmax_dtype={self.metadata.softmax_dtype!r} "
                       "cannot be honoured")
        if problem.kv_dtype is not None and self.quantized_why:
            own.append(f"a cache of dtype {problem.kv_dtype}: {self.quantized_why}")
        mine = [f"{r}; {self.instead()}" for r in declared + own]
        return mine + self.kernel_reasons(problem) + rest

    def generation(self) -> int | None:
        return _generation(self.platform, self.device, self.metadata.interpret)
