"""The example backend: dense softmax attention written with ``jax.numpy`` only.

Its declaration (``plugin.EXAMPLE``) states exactly what it runs (causal, mask, bias, GQA,
T != S, decode, gradients) and leaves everything else (windows, segment ids, soft cap, sinks,
dropout) to the core, which declines such calls with a reason instead of letting them be
ignored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn.backend import AttentionCall, AttentionImpl, AttentionOutput

from .plugin import EXAMPLE


class ExampleAttention(AttentionImpl, declaration=EXAMPLE):
    """Dense softmax attention; GQA by grouping query heads, never by repeating K/V.

    Its names, platforms, priority and capabilities are those ``EXAMPLE`` declares.
    """

    def forward(self, call: AttentionCall) -> AttentionOutput:
        # The core has validated the call, resolved softmax_scale, made mask/bias rank 4 and
        # declined every feature not in `features`: the call's other options are all unset.
        q, k, v, mask, bias = call.q, call.k, call.v, call.mask, call.bias
        b, t, hq, d = q.shape
        s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
        groups = hq // hkv
        scale = call.softmax_scale
        softmax_dtype = jnp.dtype(self.metadata.softmax_dtype)

        # Query head h uses key/value head h // groups: group the query heads instead of
        # materialising K and V `groups` times.
        qg = q.reshape(b, t, hkv, groups, d)
        logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=softmax_dtype)
        logits = logits.reshape(b, hq, t, s)
        # The scale waits until the row's max is subtracted: XLA may fuse `logits * scale - max`
        # into one multiply-add, whose exact product overflows exp() past ~2^32, NaN out of
        # finite inputs (docs/contract.md, "Logits of any finite size"). A bias adds to scaled
        # logits, so with one the scale comes first.
        factor = jnp.asarray(scale, softmax_dtype)
        if bias is not None:
            logits = logits * factor + bias.astype(softmax_dtype)
            factor = jnp.asarray(1.0, softmax_dtype)

        keep = jnp.ones((1, 1, t, s), dtype=bool)
        if mask is not None:
            keep = keep & mask
        if call.causal:
            # Bottom-right alignment: query i is the (i + s - t)-th position of the keys.
            rows = jnp.arange(t)[:, None] + (s - t)
            keep = keep & (jnp.arange(s)[None, :] <= rows)[None, None]  # rank 4: no implicit rank promotion

        # Hidden logits take the lowest finite value, never -inf (jax.debug_infs flags every -inf
        # an operation makes), and weigh exactly 0 by a select. A row with nothing to attend to
        # (or only -inf biases) gets a max of 0 so that exp() gives zeros, not NaN.
        lowest = jnp.asarray(jnp.finfo(softmax_dtype).min, softmax_dtype)
        row_max = jax.lax.stop_gradient(jnp.max(jnp.where(keep, logits, lowest), axis=-1, keepdims=True))
        row_max = jnp.where(jnp.isfinite(row_max) & (row_max > lowest), row_max, 0.0)  # -inf biases too
        weights = jnp.where(keep, jnp.exp(jnp.where(keep, logits - row_max, 0.0) * factor), 0.0)
        total = jnp.sum(weights, axis=-1, keepdims=True)
        probs = weights / jnp.where(total == 0.0, 1.0, total)

        out = jnp.einsum(
            "bkgts,bskd->btkgd",
            probs.reshape(b, hkv, groups, t, s).astype(v.dtype),
            v,
            preferred_element_type=softmax_dtype,
        )
        return AttentionOutput(attention_outputs=out.reshape(b, t, hq, dv).astype(q.dtype))
