"""The paged mechanisms on CUDA GPUs (op kind "paged"), over this package's split-K paged kernel.

* ``ragged_page_attention_v3`` (alias ``ragged_page_attention_v2``): any ragged batch, prefill
  chunks and decode steps mixed (``paged.ops.ragged_paged``: a program's sequence is found by a
  binary search over ``cu_q_lens``);
* ``page_attention``: T queries per sequence (decode, speculative decoding), no ragged batches.

A ``mask_mod(seq, h, q_pos, kv_pos)`` (tree masks over a speculative step's draft tokens, any
other mask over positions within each sequence; ``Feature.MASK_MOD``, ragged calls) is evaluated
in JAX into packed visibility bits and key bounds per query token (``paged.visibility``), which
``ragged_paged``'s kernel reads.

A uniform call (``queries_per_seq`` = T, which ``paged_attention`` makes) runs
``paged.ops.paged_decode`` in both: sequence s owns query rows ``s*T ... s*T + T - 1``, so no
search is needed and a program takes the whole GQA group of a sequence's T queries. Rows of
sequences past ``num_seqs`` get length 0 there (zeros, no key read). Both cache layouts are
read in place (the combined ``kv_pages`` through strides, no copy); page-table entries and
lengths are clamped inside the kernel, so a traced bad value never reads outside the cache.

Quantized caches (int8, float8_e4m3fn, float8_e5m2 with float32 ``k_scale``/``v_scale``, per
tensor, head or token; ``Feature.QUANTIZED_KV``): the kernel loads the narrow values and the
scales and dequantizes in registers; no full-size copy is ever made.

Forward only (serving): the core refuses to differentiate paged calls. float32 is declined:
the kernels' ``tl.dot`` multiplies float32 in TF32 on the tensor cores, which does not honour
float32 precision (nor JAX's matmul-precision setting).

This module imports neither triton nor jax_triton: ``paged.ops`` (and the kernels) load on the
first call.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from jaxattn.backend import AttentionOutput, PagedAttentionImpl, PagedCall, PagedProblem
from jaxattn_triton.flash import impl as flash_impl
from jaxattn_triton.plugin import PAGE_ATTENTION, RAGGED_PAGE_ATTENTION

__all__ = ["TritonPagedDecode", "TritonRaggedPagedAttention"]

_REFERENCE = "impl='vanilla_paged' (jaxattn-vanilla's pure-JAX reference) runs it, and impl='auto' picks it"


class _TritonPaged(PagedAttentionImpl):
    """What both paged backends share: declines and the forward."""

    #: Run the kernels in the Triton interpreter through a host callback (tests only).
    interpret: ClassVar[bool] = False
    window_pair = True  # the forward reads the call's (left, 0) pair

    def instead(self) -> str:
        return "instead: " + _REFERENCE

    def not_supported_reasons(self, problem: PagedProblem) -> list[str]:
        declared = self.declared_reasons(problem)
        # The base class adds the op kind's own rules (the mesh) after the declarations.
        rest = super().not_supported_reasons(problem)[len(declared):]
        grad = []
        if problem.needs_grad:  # no paged backend differentiates: the reference is no way out
            declared = self.declared_reasons(dataclasses.replace(problem, needs_grad=False))
            grad = [f"gradients are not supported by {self.name()}: the Triton paged kernel is forward only "
                    "(serving); differentiate a dense call over the gathered cache instead"]
        if any(r.startswith("dtype float32 ") for r in declared):
            declared = [r for r in declared if not r.startswith("dtype float32 ")]
            declared.append("dtype float32 is not supported: the Triton paged kernel multiplies float32 in TF32 on "
                            "the tensor cores, which does not honour float32 precision; cast to bfloat16 or float16")
        own = []
        if problem.kv_layout == "combined" and problem.head_dim_v != problem.head_dim:
            own.append("the combined kv_pages layout holds K and V heads of one size (D == Dv); pass k_pages and "
                       "v_pages separately")
        if self.metadata.softmax_dtype != "float32":
            own.append(f"the Triton paged kernel computes the softmax in float32; "
                       f"softmax_dtype={self.metadata.softmax_dtype!r} cannot be honoured")
        if not self.interpret:
            own += flash_impl.kernel_library_reasons(self.device)
        return [f"{r}; {self.instead()}" for r in declared + own] + grad + rest

    def notes(self, problem: PagedProblem) -> list[str]:
        if problem.queries_per_seq is not None and not problem.mask_mod:
            kernel = (f"paged_decode kernel: {problem.queries_per_seq} queries per sequence, the GQA group of a "
                      "sequence's queries in one program, split-K over its pages")
        else:
            kernel = ("ragged_paged kernel: each program finds its sequence by a binary search over cu_q_lens, "
                      "split-K over its pages")
        layout = "kv_pages read in place through strides" if problem.kv_layout == "combined" else \
            "k_pages and v_pages read in place"
        if problem.kv_dtype is not None:
            layout += (f" as {problem.kv_dtype}, dequantized in registers (k_scale, v_scale read in place; no "
                       "full-size copy)")
        if problem.mask_mod:
            kernel += ("; the mask_mod evaluated in JAX into packed visibility bits and key bounds per query token "
                       "(tiles outside the keys a block sees skipped, fully seen ones without mask arithmetic)")
        return [kernel, layout, *_tiles_note(problem)]

    def forward_cuda(self, call: PagedCall) -> AttentionOutput:
        """Runs the call (``jaxattn.backend.paged_impl``) through paged_decode when every sequence has
        ``queries_per_seq`` queries, else through ragged_paged."""
        import jax.numpy as jnp

        from jaxattn.backend import split_absorbing_sinks, zero_absorbed_heads
        from jaxattn_triton.paged.ops import paged_decode, ragged_paged

        # A +inf sink: the kernel gets a finite one and the heads it absorbs are zeroed (jaxattn.backend.sinks).
        sinks, absorbed = split_absorbing_sinks(call.softmax_aux)
        page_table, kv_lengths = call.page_table, call.kv_lengths
        num_seqs, queries_per_seq = call.num_seqs, call.queries_per_seq
        if call.kv_layout == "combined":
            k, v, cache = None, None, {"kv_pages": call.k_pages}
        else:
            k, v, cache = call.k_pages, call.v_pages, {}
        kw: dict[str, Any] = {
            "softmax_scale": call.softmax_scale, "logits_soft_cap": call.logits_soft_cap,
            "window_left": None if call.sliding_window is None else call.sliding_window[0], "sinks": sinks,
            "interpret": self.interpret, "k_scale": call.k_scale, "v_scale": call.v_scale,
            **cache,
        }  # fmt: skip
        if queries_per_seq is not None and call.mask_mod is None:
            # Uniform: sequence s owns rows s*T ... s*T + T - 1 (cu_q_lens = arange * T). Rows of
            # sequences past num_seqs see no key: length 0 gives their zeros. paged_attention's
            # count is every row, known before tracing: the mask would be a launch of its own
            # (3 µs of an 80 µs decode, docs/bench.md), so it is left out there.
            n, t = int(page_table.shape[0]), int(queries_per_seq)
            _, hq, d = call.q.shape
            lengths = kv_lengths
            if call.static_num_seqs != n:
                lengths = jnp.where(jnp.arange(n) < jnp.reshape(num_seqs, (-1,))[0], kv_lengths, 0)
            out = paged_decode(call.q.reshape(n, t, hq, d), k, v, page_table, lengths, **kw)
            assert not isinstance(out, tuple)
            rows = jnp.reshape(out, (n * t, hq, -1))
            return AttentionOutput(attention_outputs=zero_absorbed_heads(rows, absorbed, 1))
        out = ragged_paged(call.q, k, v, page_table, kv_lengths, call.cu_q_lens, num_seqs, mask_mod=call.mask_mod,
                           **kw)
        assert not isinstance(out, tuple)
        return AttentionOutput(attention_outputs=zero_absorbed_heads(out, absorbed, 1))


def _tiles_note(problem: PagedProblem) -> list[str]:
    """How the kernel tiles the call on this GPU: ``paged.launch.default_tiles`` of the spec
    ``paged.ops`` builds for it (none where the kernels cannot take the call)."""
    from jaxattn_triton.paged import launch as LP
    from jaxattn_triton.paged.ops import _num_sms

    t = problem.queries_per_seq
    try:
        spec = LP.PagedSpec(
            num_tokens=problem.num_seqs * t if t is not None else problem.num_tokens, max_seqs=problem.num_seqs,
            q_len=t, heads_q=problem.heads_q, heads_kv=problem.heads_kv, head_dim=problem.head_dim,
            head_dim_v=problem.head_dim_v, dtype=problem.dtype, num_pages=problem.num_pages,
            page_size=problem.page_size, pages_per_seq=problem.pages_per_seq,
            layout=LP.COMBINED if problem.kv_layout == "combined" else LP.SEPARATE, cache_dtype=problem.kv_dtype,
        )  # fmt: skip
    except ValueError:
        return []
    sms = _num_sms()
    tiles = LP.default_tiles(spec, sms)
    programs = math.prod(LP.launch_grid(spec, tiles))
    heads = f"{tiles.kv_heads} KV heads" if tiles.kv_heads > 1 else "1 KV head"
    if tiles.num_splits > 1:
        splits = f"{tiles.num_splits} key splits merged in the launch"
    else:
        splits = "unsplit"
    note = (f"tiles: {tiles.block_q} query token(s) x {heads} a program, {tiles.block_n} keys a step, "
            f"{tiles.num_warps} warps; {splits}; {programs} programs on {sms} SMs")
    if tiles.decode_q:
        note += (f"; sequences of at most {tiles.decode_q} queries in decode programs of their own "
                 f"({tiles.decode_m} rows, {tiles.decode_block_n} keys a step)")
    how = []
    if LP.qk_f16(spec):
        how.append("Q K^T in fp16 (each query row moved there by a power of two of its own)")
    if LP.INT8_OFFSET in (LP.k_widen(spec), LP.v_words(spec)):
        how.append("int8 widened to fp16 as (v + 128) 2^-24, the offset taken out of the sums")
    if LP.v_words(spec):
        how.append("V read as 32-bit words, P V one dot per byte lane")
    return [note] + ([f"{problem.kv_dtype} cache: " + "; ".join(how)] if how else [])


class TritonRaggedPagedAttention(_TritonPaged, declaration=RAGGED_PAGE_ATTENTION):
    """``ragged_page_attention_v3`` / ``_v2`` on CUDA GPUs: ragged batches (uniform ones through paged_decode)."""


class TritonPagedDecode(_TritonPaged, declaration=PAGE_ATTENTION):
    """``page_attention`` on CUDA GPUs: T queries per sequence (decode, speculative decoding)."""

    def not_supported_reasons(self, problem: PagedProblem) -> list[str]:
        if problem.queries_per_seq is not None:
            return super().not_supported_reasons(problem)
        # A ragged batch: the reference of this name takes none either, so the advice differs.
        # The other reasons are those of the same call with one query per sequence.
        reasons = super().not_supported_reasons(dataclasses.replace(problem, queries_per_seq=1))
        reasons.append("ragged batches (per-sequence query counts, cu_q_lens) are not supported by page_attention, "
                       "which takes T queries per sequence; ragged_page_attention_v3 runs them on this GPU with the "
                       "same kernel (impl='auto' picks it)")
        return reasons
