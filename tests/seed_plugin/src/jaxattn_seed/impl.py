"""The seed-style backend: dense softmax attention, written as EasyDeL writes its operators.

Its forward takes the arrays themselves, ``forward_native(self, q, k, v, mask=None, bias=None,
init_bias=None, causal=False, **ignore)``, and reads the softmax scale from ``self.metadata``;
its names come from ``get_impl_name()`` and what it runs from ``features``. The core adapts it:
it validates each call, passes the declared features' arguments by name, and declines the rest
(windows, segment ids, soft cap, sinks, dropout) with a reason.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxattn.backend import AttentionImpl, AttentionOutput, Feature


class SeedAttention(AttentionImpl):
    """Dense softmax attention; GQA by repeating K and V per query head group."""

    features: ClassVar = {Feature.CAUSAL, Feature.MASK, Feature.BIAS, Feature.GQA, Feature.CROSS,
                          Feature.DECODE, Feature.VALUE_DIM, Feature.GRAD}
    # Below every real backend (and above jaxattn-example-plugin's -100): auto never prefers it.
    priority: ClassVar[int] = -50

    @classmethod
    def get_impl_name(cls) -> tuple[str, ...]:
        return ("seed_example", "seed_dense")

    def forward_native(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                       init_bias: Any = None, causal: bool = False, **ignore: Any) -> AttentionOutput:
        if bias is None and init_bias is not None:
            bias = init_bias()
        t, s, groups = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scale = self.metadata.softmax_scale or q.shape[-1] ** -0.5
        logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
        # The scale waits until the row's max is subtracted: a fused `logits * scale - max`
        # overflows exp() for logits of a large magnitude (NaN from finite inputs). A bias adds
        # to scaled logits, so with one the scale comes first.
        factor = jnp.asarray(scale, jnp.float32)
        if bias is not None:
            logits = logits * factor + bias.astype(jnp.float32)
            factor = jnp.asarray(1.0, jnp.float32)
        keep = jnp.ones((1, 1, t, s), bool)
        if mask is not None:
            keep = keep & mask
        if causal:  # bottom-right aligned: query i is the (i + s - t)-th position of the keys
            keep = keep & (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t))[None, None]  # rank 4
        # Hidden logits take the lowest finite value, never -inf (jax.debug_infs flags every -inf
        # an operation makes), and weigh exactly 0 by a select; a row with nothing to attend to
        # (or only -inf biases) gets a max of 0, so exp() gives zeros, not NaN.
        lowest = jnp.asarray(jnp.finfo(jnp.float32).min, jnp.float32)
        row_max = jax.lax.stop_gradient(jnp.max(jnp.where(keep, logits, lowest), axis=-1, keepdims=True))
        row_max = jnp.where(jnp.isfinite(row_max) & (row_max > lowest), row_max, 0.0)  # -inf biases too
        weights = jnp.where(keep, jnp.exp(jnp.where(keep, logits - row_max, 0.0) * factor), 0.0)
        total = jnp.sum(weights, axis=-1, keepdims=True)
        probs = weights / jnp.where(total == 0.0, 1.0, total)
        out = jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return AttentionOutput(attention_outputs=out.astype(q.dtype))

    def forward_cpu(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        # The seed's per-platform forwards pass their arguments on, as EasyDeL's do.
        return self.forward_native(*args, **kwargs)
