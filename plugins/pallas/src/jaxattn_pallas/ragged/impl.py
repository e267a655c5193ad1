"""``ragged_page_attention_v3`` (alias ``_v2``, op kind "paged") on the Pallas TPU ragged
paged-attention kernel (:mod:`jaxattn_pallas.ragged.kernel`).

What it copies per call, and why: the combined layout ``(num_pages, page_size, 2 * Hkv, D)``
is the kernel's own and is read in place when D is a multiple of 128 and ``2 * Hkv`` tiles the
dtype's layout; otherwise (the separate layout, or padding of heads or head dims) the whole
cache is copied once per call into that layout. q is padded (small). ``notes()`` says which,
per call. Ranking: :mod:`jaxattn_pallas.common`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from jaxattn.backend import AttentionOutput, PagedCall, PagedProblem

from ..common import PallasPagedBase
from ..plugin import PALLAS_RAGGED_PAGE_ATTENTION
from . import rules as ragged_rules

__all__ = ["PallasRaggedPagedAttention"]

_INTERPRET = (
    "in TPU interpret mode use 'page_attention' for decode steps (JAX's paged_attention kernel, which interprets; "
    "impl='auto' picks it), or drop the TPU override: on a CPU this name runs jaxattn-vanilla's pure-JAX reference"
)


def _left(window: tuple[int, int] | None) -> int | None:
    """The kernel's ``window_left`` of the ``(left, 0)`` pair a call and its problem hold."""
    return None if window is None else window[0]


class PallasRaggedPagedAttention(PallasPagedBase, declaration=PALLAS_RAGGED_PAGE_ATTENTION):
    """Ragged paged attention on TPU (jax.experimental.pallas.ops.tpu.ragged_paged_attention)."""

    quantized_why: ClassVar[str] = (
        "JAX's ragged_paged_attention takes k_scale and v_scale as Python floats (one static scale per tensor), "
        "never an array of scales per head or token, nor one traced under jit")
    window_pair = True  # the reasons and the forward read the (left, 0) pair of the problem and the call

    def _facts(self, problem: PagedProblem) -> dict[str, Any]:
        # An unsupported dtype is the declarations' to decline; the kernel's other rules do not
        # depend on it, so they are asked with a dtype it takes (one reason, not three).
        dtype = self.compute_dtype(problem)
        dtype = dtype if dtype in ragged_rules.SUPPORTED_DTYPES else "float32"
        return {
            "q_dtype": dtype, "kv_dtype": dtype, "num_q_heads": problem.heads_q, "num_kv_heads": problem.heads_kv,
            "head_dim": problem.head_dim, "v_head_dim": problem.head_dim_v, "layout": problem.kv_layout,
            "page_size": problem.page_size,
        }

    def kernel_reasons(self, problem: PagedProblem) -> list[str]:
        # Sinks are declined by the declarations (no Feature.SINKS), so not asked again here.
        asked = {**self._facts(problem), "window_left": _left(problem.sliding_window),
                 "logits_soft_cap": problem.logits_soft_cap, "tpu_generation": self.generation()}
        reasons = ragged_rules.ragged_reasons(**asked)
        interpret = self.platform == "tpu" and self.metadata.interpret
        broken = [r for r in ragged_rules.ragged_reasons(**asked, interpret=interpret) if r not in reasons]
        return [f"{r}; {self.instead()}" for r in reasons] + [f"{r}; {_INTERPRET}" for r in broken]

    def notes(self, problem: PagedProblem) -> list[str]:
        facts = self._facts(problem)
        tiling = ragged_rules.ragged_tiling(**facts, pages_per_seq=problem.pages_per_seq, num_tokens=problem.num_tokens,
                                       window_left=_left(problem.sliding_window))
        copy = (f"copies the whole KV cache per call ({tiling.cache_copy})" if tiling.cache_copy
                else "reads the combined KV cache in place")
        return [copy, f"blocks: {tiling.num_queries_per_block} query rows x {tiling.num_kv_pages_per_block} pages"]

    def forward_tpu(self, call: PagedCall) -> AttentionOutput:
        import jax.numpy as jnp

        from jaxattn.backend import traced_under, x64_off

        from .kernel import ragged_paged_attention

        combined = call.kv_layout == "combined"
        kv = call.k_pages if combined else None
        k, v = (None, None) if combined else (call.k_pages, call.v_pages)

        def run(q: Any, k: Any, v: Any, kv: Any, table: Any, lengths: Any, cu: Any, n: Any) -> Any:
            return ragged_paged_attention(
                q, k, v, table, lengths, cu, n, kv_pages=kv, softmax_scale=call.softmax_scale,
                logits_soft_cap=call.logits_soft_cap,
                window_left=_left(call.sliding_window),
                sinks=call.softmax_aux, interpret=self.metadata.interpret,
            )

        # The kernel and the wrapper's index arithmetic run in int32 with x64 off (Pallas TPU
        # kernels break under jax_enable_x64); the indices are cast before, under the caller's mode.
        ints = [jnp.asarray(x).astype(jnp.int32) for x in (call.page_table, call.kv_lengths, call.cu_q_lens,
                                                           call.num_seqs)]
        out = traced_under(run, x64_off)(call.q, k, v, kv, *ints)
        return AttentionOutput(attention_outputs=out)
