"""``PagedAttentionImpl``: the contract of backends that attend over a paged KV cache (serving).

One op kind covers the seed's cached mechanisms: a decode step (``page_attention``, T queries
per sequence) and a ragged batch mixing prefill chunks and decode steps
(``ragged_page_attention_v3`` / ``_v2``). Every call reaches a backend in the ragged form:

    forward_<platform>(q (num_tokens, Hq, D), k_pages, v_pages, *, page_table, kv_lengths,
                       cu_q_lens, num_seqs, kv_layout, queries_per_seq, softmax_scale,
                       logits_soft_cap, sliding_window, softmax_aux[, k_scale, v_scale]) -> AttentionOutput

``k_pages``/``v_pages`` are ``(num_pages, page_size, Hkv, D|Dv)`` with ``kv_layout="separate"``;
with ``kv_layout="combined"`` ``k_pages`` is JAX's TPU layout ``(num_pages, page_size, 2*Hkv, D)``
(K head h at 2h, V head h at 2h + 1) and ``v_pages`` is None. A quantized cache (int8/float8,
``Feature.QUANTIZED_KV``) arrives as it is, with ``k_scale`` and ``v_scale`` float32 of rank 3
broadcastable against ``(num_pages, page_size, Hkv)`` (``jaxattn.quantize``); other calls have no
such keywords. ``num_seqs`` is an int32 array of
shape (1,); ``queries_per_seq`` is T when every sequence has T queries (cu_q_lens = arange * T),
None for a ragged batch. The output is ``(num_tokens, Hq, Dv)``; rows past
``cu_q_lens[num_seqs]`` and rows that see no key are zeros. Semantics: docs/contract.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .backend import Backend, Call
from .paged_validation import PagedSpec, resolve_paged_call
from .problem import PagedProblem

if TYPE_CHECKING:
    from .output import AttentionOutput

__all__ = ["PagedAttentionImpl"]


class PagedAttentionImpl(Backend[PagedProblem]):
    """Base class of backends over a paged KV cache. Subclass it, declare capabilities, override forwards."""

    kind = "paged"

    def not_supported_reasons(self, problem: PagedProblem) -> list[str]:
        reasons = self.declared_reasons(problem)
        md = self.metadata
        if md.mesh is not None or md.batch_axis or md.head_axis or md.sequence_axis:
            reasons.append(
                "paged attention runs on the arrays it is given: shard the cache yourself and call it inside your "
                "own shard_map, with no mesh or axes in the metadata"
            )
        return reasons

    def problem(self, spec: PagedSpec, q: Any, softmax_aux: Any = None, needs_grad: bool = False) -> PagedProblem:
        from ._dtypes import dtype_name

        return PagedProblem(
            num_seqs=spec.num_seqs_max, num_tokens=spec.num_tokens, queries_per_seq=spec.queries_per_seq,
            heads_q=spec.heads_q, heads_kv=spec.heads_kv, head_dim=spec.head_dim, head_dim_v=spec.head_dim_v,
            dtype=dtype_name(self.metadata.runtime_dtype or q.dtype), page_size=spec.page_size,
            num_pages=spec.num_pages, pages_per_seq=spec.pages_per_seq, kv_layout=spec.kv_layout,
            sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap,
            sinks=softmax_aux is not None, needs_grad=needs_grad, kv_dtype=spec.kv_dtype,
        )

    def _resolve(self, q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lengths: Any,
                 features: dict[str, Any]) -> PagedSpec:
        return resolve_paged_call(q, k_pages, v_pages, page_table, kv_lengths, metadata=self.metadata, **features)

    def supports(self, q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lengths: Any, *,
                 needs_grad: bool = False, **features: Any) -> list[str]:
        """Every reason this backend cannot run the call (arrays or ShapeDtypeStructs); [] if it can.

        Takes the ragged form's keywords: ``cu_q_lens``, ``num_seqs`` (required), ``kv_pages``,
        ``queries_per_seq``, ``sliding_window``, ``softmax_scale``, ``logits_soft_cap``,
        ``softmax_aux``, ``k_scale``, ``v_scale``.
        """
        spec = self._resolve(q, k_pages, v_pages, page_table, kv_lengths, features)
        problem = self.problem(spec, q, features.get("softmax_aux"), needs_grad)
        return self.reasons_to_decline(problem) + self.runner.reasons(self, problem)

    # -- running ----------------------------------------------------------------------------
    def __call__(self, q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lengths: Any,
                 **features: Any) -> AttentionOutput:
        """Validate, check support (one error with every reason), then run on this device."""
        spec = self._resolve(q, k_pages, v_pages, page_table, kv_lengths, features)
        problem = self.problem(spec, q, features.get("softmax_aux"))
        self.decline(problem)
        return self.runner.run(self, problem, self.prepare(spec, q, k_pages, v_pages, page_table, kv_lengths,
                                                           features))

    def prepare(self, spec: PagedSpec, q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lengths: Any,
                features: dict[str, Any]) -> Call:
        """The normalised call: q and the cache in ``metadata.runtime_dtype``, ``num_seqs`` of shape (1,)."""
        import jax.numpy as jnp

        if spec.kv_layout == "combined":
            k_pages, v_pages = features["kv_pages"], None
        if self.metadata.runtime_dtype is not None:
            dtype = jnp.dtype(self.metadata.runtime_dtype)
            q = q.astype(dtype)
            if spec.kv_dtype is None:  # a quantized cache is read as it is
                k_pages = k_pages.astype(dtype)
                v_pages = None if v_pages is None else v_pages.astype(dtype)
        scales = {}
        if spec.kv_dtype is not None:
            from .quantize import scale_rank3

            scales = {"k_scale": scale_rank3(features["k_scale"]), "v_scale": scale_rank3(features["v_scale"])}
        return Call((q, k_pages, v_pages), {**scales,
            "page_table": page_table, "kv_lengths": kv_lengths, "cu_q_lens": features["cu_q_lens"],
            "num_seqs": jnp.reshape(features["num_seqs"], (1,)).astype(jnp.int32), "kv_layout": spec.kv_layout,
            "queries_per_seq": spec.queries_per_seq, "softmax_scale": spec.softmax_scale,
            "logits_soft_cap": spec.logits_soft_cap, "sliding_window": spec.sliding_window,
            "softmax_aux": features.get("softmax_aux"),
        })

    def output_shape(self, call: Call) -> tuple[int, ...]:
        q, k_pages, v_pages = call.args
        dv = k_pages.shape[-1] if v_pages is None else v_pages.shape[-1]
        return (q.shape[0], q.shape[1], dv)

    # -- per-platform forwards (override the ones you have) ---------------------------------
    def forward_native(self, q: Any, k_pages: Any, v_pages: Any, **features: Any) -> AttentionOutput:
        """Portable path; the default target of every other forward."""
        raise NotImplementedError(
            f"impl {self.name()!r} has no forward for platform {self.platform!r} and no forward_native"
        )

    def forward_cpu(self, q: Any, k_pages: Any, v_pages: Any, **features: Any) -> AttentionOutput:
        return self.forward_native(q, k_pages, v_pages, **features)

    def forward_tpu(self, q: Any, k_pages: Any, v_pages: Any, **features: Any) -> AttentionOutput:
        return self.forward_native(q, k_pages, v_pages, **features)

    def forward_gpu(self, q: Any, k_pages: Any, v_pages: Any, **features: Any) -> AttentionOutput:
        return self.forward_native(q, k_pages, v_pages, **features)

    def forward_cuda(self, q: Any, k_pages: Any, v_pages: Any, **features: Any) -> AttentionOutput:
        return self.forward_gpu(q, k_pages, v_pages, **features)

    def forward_rocm(self, q: Any, k_pages: Any, v_pages: Any, **features: Any) -> AttentionOutput:
        return self.forward_gpu(q, k_pages, v_pages, **features)
