"""``VanillaAttention``: the ``vanilla`` impl, an adapter over ``vanilla_attention``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from jaxattn.capabilities import ALL_FEATURES, Feature
from jaxattn.impl import AttentionImpl
from jaxattn.output import AttentionOutput
from jaxattn.problem import AttentionProblem

from .reference import vanilla_attention

__all__ = ["VanillaAttention"]


class VanillaAttention(AttentionImpl):
    """Pure-JAX attention: every feature, every platform; the reference and the fallback."""

    platforms: ClassVar[frozenset[str]] = frozenset({"cpu", "gpu", "tpu"})
    # float64 too: it is the only impl that can check a model at full precision.
    dtypes: ClassVar[frozenset[str]] = frozenset({"float16", "bfloat16", "float32", "float64"})
    head_dims: ClassVar[tuple[int, int] | frozenset[int]] = (1, 1 << 16)
    features: ClassVar[frozenset[Feature]] = ALL_FEATURES
    # Lowest rank: "auto" picks it only when no specialised kernel accepts the call.
    priority: ClassVar[int] = 0
    description: ClassVar[str] = "pure-JAX reference attention, every feature, O(T*S) memory"

    @classmethod
    def get_impl_name(cls) -> str:
        return "vanilla"

    def notes(self, problem: AttentionProblem) -> list[str]:
        if problem.kv_dtype is None:
            return []
        return [f"dequantizes the {problem.kv_dtype} cache into a full-size float32 copy, then attends (the reference)"]

    def forward_native(
        self,
        q: Any,
        k: Any,
        v: Any,
        mask: Any = None,
        bias: Any = None,
        init_bias: Callable[[], Any] | None = None,
        causal: bool = False,
        **features: Any,
    ) -> AttentionOutput:
        # The base class resolves init_bias before routing; honour it when called directly.
        if bias is None and init_bias is not None:
            bias = init_bias()
        k_scale, v_scale = features.pop("k_scale", None), features.pop("v_scale", None)
        out_dtype = q.dtype
        if k_scale is not None and v_scale is not None:  # a quantized cache: attend over its dequantized copy
            import jax.numpy as jnp

            from jaxattn.quantize import dequantize_visible

            wide = jnp.promote_types(q.dtype, jnp.float32)
            lengths = features.get("kv_lengths")
            q = q.astype(wide)
            k, v = dequantize_visible(k, k_scale, lengths, wide), dequantize_visible(v, v_scale, lengths, wide)
        res = vanilla_attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            causal=causal,
            softmax_dtype=self.metadata.softmax_dtype,
            **features,
        )
        return AttentionOutput(attention_outputs=res.output.astype(out_dtype), attention_weights=res.weights,
                               softmax_lse=res.lse)
