"""``page_attention`` (op kind "paged": decode steps) on JAX's TPU ``paged_attention`` kernel
(:mod:`jaxattn_pallas.decode.kernel`).

What it copies per call, and why: always the whole cache, as the kernel reads K and V as
``(Hkv, num_pages, page_size, D)``, a layout neither of the contract's is; a float32 or float16
cache is split into bfloat16 terms in that copy, since the kernel rounds pages to bfloat16
(``notes()`` gives the bytes). Ranking: :mod:`jaxattn_pallas.common`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxattn.backend import AttentionOutput, PagedCall, PagedProblem

from ..common import PallasPagedBase
from ..plugin import PALLAS_PAGE_ATTENTION
from .rules import paged_kernel_tiling

__all__ = ["PallasPagedDecode"]


class PallasPagedDecode(PallasPagedBase, declaration=PALLAS_PAGE_ATTENTION):
    """``page_attention``: decode steps (T == 1) on TPU (jax.experimental.pallas.ops.tpu.paged_attention)."""

    quantized_why: ClassVar[str] = (
        "JAX's paged_attention reads int8 only (no float8), as a QuantizedTensor whose scales it broadcasts to "
        "the head dim (float32: 4x the bytes of the int8 values, in the kernel's layout, which this backend "
        "already copies the whole cache into per call), so it would read more bytes than the float cache")

    def not_supported_reasons(self, problem: PagedProblem) -> list[str]:
        # What the ragged kernel runs on a TPU is declined here with that advice; the rest
        # (dtype, head dims, sinks, platform...) with the reference's.
        trimmed = dataclasses.replace(problem, queries_per_seq=1, sliding_window=None)
        reasons = super().not_supported_reasons(trimmed)
        ragged = (
            "instead: ragged_page_attention_v3 runs it on a TPU (impl='auto' picks it), but not in TPU interpret "
            "mode where this jax's interpreter cannot run it (0.10.2-0.12.1), where "
        )
        decode = ragged + self.instead().removeprefix("instead: ")
        if problem.queries_per_seq is None:
            reasons.append("ragged batches (per-sequence query counts) are not supported by page_attention: JAX's "
                           "paged_attention kernel takes one query per sequence; "
                           + ragged + self.instead().removeprefix("instead: "))
        elif problem.queries_per_seq != 1:
            reasons.append(f"{problem.queries_per_seq} queries per sequence are not supported by page_attention: "
                           f"JAX's paged_attention kernel takes one query per sequence; {decode}")
        if problem.sliding_window is not None:
            reasons.append(f"a sliding window is not supported by page_attention: JAX's paged_attention kernel has "
                           f"none; {decode}")
        return reasons

    def kernel_reasons(self, problem: PagedProblem) -> list[str]:
        gen = self.generation()
        if gen is not None and gen < 4:
            return [f"JAX's TPU paged_attention kernel needs TPU v4 or newer (upstream skips below v4); "
                    f"{self.instead()}"]
        return []

    def _tiling(self, problem: PagedProblem) -> Any:
        dtype = self.compute_dtype(problem)
        return paged_kernel_tiling(dtype=dtype if dtype in self.dtypes else "float32", num_kv_heads=problem.heads_kv,
                                 head_dim=problem.head_dim, v_head_dim=problem.head_dim_v,
                                 page_size=problem.page_size, num_pages=problem.num_pages,
                                 pages_per_seq=problem.pages_per_seq)

    def notes(self, problem: PagedProblem) -> list[str]:
        tiling = self._tiling(problem)
        return [tiling.describe_copy(self.compute_dtype(problem), problem.kv_layout),
                f"blocks of {tiling.pages_per_compute_block} pages"]

    def forward_tpu(self, call: PagedCall) -> AttentionOutput:
        from .kernel import paged_attention_decode

        # Declined otherwise: one query per sequence, so row s is sequence s (cu_q_lens is arange).
        assert call.queries_per_seq == 1
        assert call.sliding_window is None
        assert call.softmax_aux is None
        combined = call.kv_layout == "combined"
        k_pages = call.k_pages
        out = paged_attention_decode(
            call.q, None if combined else k_pages, None if combined else call.v_pages, call.page_table,
            call.kv_lengths, call.num_seqs, kv_pages=k_pages if combined else None,
            softmax_scale=call.softmax_scale, logits_soft_cap=call.logits_soft_cap,
            interpret=self.metadata.interpret,
        )
        return AttentionOutput(attention_outputs=out)
