"""``BlockwiseAttention``: the ``blockwise`` impl, an adapter over ``blockwise_attention``."""

from __future__ import annotations

from typing import Any

from jaxattn.backend import AttentionCall, AttentionImpl, AttentionOutput, AttentionProblem

from ..plugin import BLOCKWISE
from .kernel import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    block_tiling,
    blockwise_attention,
    blockwise_backward,
    default_block,
)

__all__ = ["BlockwiseAttention"]


class BlockwiseAttention(AttentionImpl, declaration=BLOCKWISE):
    """Chunked attention in plain XLA with a blockwise custom VJP: O(T) memory on any platform.

    Block sizes follow ``metadata.block_q`` / ``block_k`` (and ``block_q_bwd`` /
    ``block_k_bwd`` for the backward) where set; see ``jaxattn_vanilla.blockwise.kernel``.
    """

    def _blocks(self, problem: AttentionProblem) -> tuple[int, int, int, int]:
        md = self.metadata
        bq = md.block_q or default_block(problem.seq_q, DEFAULT_BLOCK_Q)
        bk = md.block_k or default_block(problem.seq_k, DEFAULT_BLOCK_K)
        return bq, bk, md.block_q_bwd or bq, md.block_k_bwd or bk

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        bq, bk, bq_bwd, bk_bwd = self._blocks(problem)
        if problem.dropout_prob > 0 and (min(bq, problem.seq_q), min(bk, problem.seq_k)) != (
            min(bq_bwd, problem.seq_q), min(bk_bwd, problem.seq_k)
        ):
            reasons.append(
                f"dropout needs the backward's blocks ({bq_bwd}, {bk_bwd}) to equal the forward's ({bq}, {bk}): "
                "the keep-mask is drawn per tile; unset block_q_bwd / block_k_bwd"
            )
        return reasons

    def notes(self, problem: AttentionProblem) -> list[str]:
        bq, bk, bq_bwd, bk_bwd = self._blocks(problem)
        tiling = block_tiling(problem.seq_q, problem.seq_k, bq, bk, causal=problem.causal,
                           window=problem.sliding_window, kv_lengths=problem.kv_lengths)
        grid = tiling.num_q * tiling.num_k
        skipped = "" if tiling.tiles_visited == grid else " (the rest are hidden by causal/window)"
        at_most = "at most " if problem.kv_lengths else ""
        tiles = f"{at_most}{tiling.tiles_visited} of {grid} tiles computed{skipped}"
        notes = [f"blocks {tiling.block_q}x{tiling.block_k}: {tiles}"]
        if problem.kv_lengths:
            notes.append("kv_lengths: tiles past the batch's longest sequence (or left of its shortest's "
                         "window) are skipped at run time")
        if problem.mask_mod or problem.score_mod:
            notes.append("mask_mod / score_mod evaluated per tile; tiles the mask_mod's block mask leaves empty for "
                         "every batch and head are skipped (its block_mask's blocks are the blocks; the backward's "
                         "are the forward's)")
        elif (bq_bwd, bk_bwd) != (bq, bk):
            notes.append(f"backward blocks {min(bq_bwd, problem.seq_q)}x{min(bk_bwd, problem.seq_k)}")
        return notes

    def forward_native(self, call: AttentionCall) -> AttentionOutput:
        md = self.metadata
        res = blockwise_attention(
            call.q,
            call.k,
            call.v,
            mask=call.mask,
            bias=call.bias,
            causal=call.causal,
            softmax_dtype=md.softmax_dtype,
            block_q=md.block_q,
            block_k=md.block_k,
            block_q_bwd=md.block_q_bwd,
            block_k_bwd=md.block_k_bwd,
            **call.options(),
        )
        return AttentionOutput(attention_outputs=res.output, softmax_lse=res.lse)

    def backward_from_residuals(self, q: Any, k: Any, v: Any, out: Any, lse: Any, d_out: Any, d_lse: Any,
                                **features: Any) -> tuple[Any, Any, Any]:
        """``(dq, dk, dv)`` at cotangents ``(d_out, d_lse)`` from another forward's ``out`` and ``lse``
        (ring attention hands it the whole ring's, so no block's forward runs again); the
        features are ``blockwise_backward``'s (mask, causal, segment ids, scale, soft cap)."""
        md = self.metadata
        return blockwise_backward(q, k, v, out, lse, d_out, d_lse, softmax_dtype=md.softmax_dtype,
                                  block_q=md.block_q_bwd or md.block_q, block_k=md.block_k_bwd or md.block_k,
                                  **features)
