"""``FlexibleAttentionModule``: jaxattn behind a Flax NNX module (the seed's model-facing layer).

The module attends over query/key/value states that the model has projected (it holds no
weights: projections, rotary embeddings and the like belong to the model). It resolves its
implementation once, at construction (``jaxattn.get_impl``); with ``"auto"`` that object
picks the backend per call signature at trace time, memoised, so every call after the first
of a shape is a dictionary lookup away from the kernel.

Three kinds of call, chosen by ``mode`` or inferred:

* ``"train"``: self-attention over the given states (dropout when ``deterministic=False``);
* ``"prefill"``: writes the states into a KV cache and attends over everything cached;
* ``"decode"``: the same with one new position (T = 1).

The cache is passed in (``cache=KVCache(...)``; the call then returns ``(output, new_cache)``)
or held by the module after ``init_cache(...)`` (updated in place, NNX style).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

import jax
import jax.numpy as jnp
from flax import nnx

import jaxattn
from jaxattn import AttentionMetadata, AttentionOutput, Feature, InvalidInputError
from jaxattn.backend import window_pair

from .cache import KVCache, valid_mask

if TYPE_CHECKING:
    from jaxattn_bench import BenchReport

__all__ = ["FlexibleAttentionModule", "Mode"]

Mode = Literal["train", "prefill", "decode"]


def _get(var: Any) -> Any:
    # flax >= 0.12 deprecates .value in favour of get_value(); 0.10 has only .value
    return var.get_value() if hasattr(var, "get_value") else var.value


def _does_dropout(name: str, metadata: AttentionMetadata) -> bool:
    try:
        return Feature.DROPOUT in jaxattn.get_impl(name, metadata).features
    except jaxattn.JaxattnError:  # not usable with this metadata: not a way out
        return False


def _set(var: Any, value: Any) -> None:
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:
        var.value = value


class FlexibleAttentionModule(nnx.Module):
    """Attention over BTHD states through jaxattn's registry (``attention_mechanism="auto"`` by default).

    Args:
        num_q_heads, head_dims: query heads and head dim the module expects.
        num_kv_heads: key/value heads (GQA/MQA); defaults to ``num_q_heads``.
        attention_mechanism: an impl name ("auto", "vanilla", "cudnn", "flash_attn2", ...) or
            an ``AttentionMechanisms`` member.
        dtype: compute dtype (inputs are cast to it; the output has it). None keeps the inputs'.
        cache_dtype: a floating dtype for a held KV cache (default: ``dtype``, else float32);
            keys and values are stored in it and read back in the compute dtype.
        causal, sliding_window, logits_soft_cap, softmax_scale, dropout_prob: the call's
            features, fixed for the module (see ``jaxattn.attention``).
        metadata: an ``AttentionMetadata`` (its ``runtime_dtype`` is replaced by ``dtype`` if given).
        rngs: ``nnx.Rngs`` with a ``dropout`` stream, needed for dropout unless a call passes
            ``dropout_rng``.
    """

    # Set by init_cache() only (the docstring must come first: a string after these
    # annotations would be a bare expression, and __doc__ None).
    cached_key: nnx.Cache[Any]
    cached_value: nnx.Cache[Any]
    cache_index: nnx.Cache[Any]
    cache_overflowed: nnx.Cache[Any]

    def __init__(
        self,
        num_q_heads: int,
        head_dims: int,
        num_kv_heads: int | None = None,
        *,
        attention_mechanism: str | jaxattn.AttentionMechanisms = "auto",
        dtype: Any = None,
        cache_dtype: Any = None,
        causal: bool = True,
        sliding_window: int | tuple[int, int] | None = None,
        logits_soft_cap: float | None = None,
        softmax_scale: float | None = None,
        dropout_prob: float = 0.0,
        metadata: AttentionMetadata | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        kv_heads = num_kv_heads or num_q_heads
        if num_q_heads % kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {kv_heads}")
        md = metadata or AttentionMetadata()
        if dtype is not None:
            md = md.replace(runtime_dtype=jnp.dtype(dtype).name)
        self.num_q_heads, self.num_kv_heads, self.head_dims = num_q_heads, kv_heads, head_dims
        self.attention_mechanism = str(getattr(attention_mechanism, "value", attention_mechanism)).lower()
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.cache_dtype = jnp.dtype(cache_dtype or dtype or jnp.float32)
        if not jnp.issubdtype(self.cache_dtype, jnp.floating):
            raise InvalidInputError("cache_dtype", f"must be a floating dtype, got {self.cache_dtype}",
                                    "for an int8 / float8 cache quantize it with jaxattn.quantize_kv and call "
                                    "jaxattn.attention or paged_attention with k_scale / v_scale")
        self.causal, self.sliding_window, self.logits_soft_cap = causal, sliding_window, logits_soft_cap
        self.softmax_scale, self.dropout_prob = softmax_scale, dropout_prob
        self.metadata = md
        self.rngs = rngs
        # Resolved once: an unknown or unusable name fails here, not at the first forward pass.
        impl = jaxattn.get_impl(self.attention_mechanism, md)
        if not isinstance(impl, jaxattn.AttentionImpl):
            raise InvalidInputError("attention_mechanism", f"{self.attention_mechanism!r} is a paged impl; the module "
                                    "attends over dense query/key/value states",
                                    "name a dense impl ('auto', 'vanilla', ...), or call jaxattn.paged_attention / "
                                    "ragged_paged_attention with a paged cache")
        if dropout_prob > 0 and Feature.DROPOUT not in impl.features:
            dropping = sorted({i.name for i in jaxattn.list_impls()
                               if i.kind == "dense" and i.usable_here and _does_dropout(i.name, md)})
            raise InvalidInputError("dropout_prob", f"impl {impl.name()!r} does no dropout",
                                    f"use one that does ({', '.join(['auto', *dropping])}), or dropout_prob=0")
        self.impl: jaxattn.AttentionImpl = impl
        # cached_key / cached_value / cache_index exist only after init_cache(): NNX fixes an
        # attribute's kind (static or data) at its first assignment, so no None placeholders.

    # -- the KV cache held by the module ---------------------------------------------------------
    def init_cache(self, batch_size: int, max_length: int) -> None:
        """Hold a fixed-size KV cache of ``max_length`` positions (prefill and decode then use it)."""
        empty = KVCache.empty(batch_size, max_length, self.num_kv_heads, self.head_dims, self.cache_dtype)
        self.cached_key, self.cached_value = nnx.Cache(empty.key), nnx.Cache(empty.value)
        self.cache_index = nnx.Cache(empty.index)
        self.cache_overflowed = nnx.Cache(empty.overflowed)

    @property
    def held_cache(self) -> KVCache | None:
        if not hasattr(self, "cache_index"):
            return None
        return KVCache(_get(self.cached_key), _get(self.cached_value), _get(self.cache_index),
                       _get(self.cache_overflowed))

    @property
    def cache_overflowed_flag(self) -> Any:
        """The held cache's flag (a bool scalar): a write did not fit under jit and was dropped,
        that call's outputs NaN. None without a held cache."""
        return _get(self.cache_overflowed) if hasattr(self, "cache_overflowed") else None

    def _store(self, cache: KVCache) -> None:
        _set(self.cached_key, cache.key)
        _set(self.cached_value, cache.value)
        _set(self.cache_index, cache.index)
        _set(self.cache_overflowed, cache.overflowed)

    # -- calls ---------------------------------------------------------------------------------
    @overload
    def __call__(self, query_states: Any, key_states: Any, value_states: Any, *, cache: None = None,
                 mode: Mode | None = None, attention_mask: Any = None, bias: Any = None,
                 segment_ids: Any = None, deterministic: bool = True, dropout_rng: Any = None) -> AttentionOutput: ...

    @overload
    def __call__(self, query_states: Any, key_states: Any, value_states: Any, *, cache: KVCache,
                 mode: Mode | None = None, attention_mask: Any = None, bias: Any = None,
                 segment_ids: Any = None, deterministic: bool = True,
                 dropout_rng: Any = None) -> tuple[AttentionOutput, KVCache]: ...

    def __call__(self, query_states: Any, key_states: Any, value_states: Any, *, cache: KVCache | None = None,
                 mode: Mode | None = None, attention_mask: Any = None, bias: Any = None,
                 segment_ids: Any = None, deterministic: bool = True,
                 dropout_rng: Any = None) -> AttentionOutput | tuple[AttentionOutput, KVCache]:
        """Attend. ``attention_mask`` is boolean, broadcastable to ``(B, Hq, T, S)`` (True = attend);
        ``segment_ids`` ``(B, T)`` marks packed sequences in training calls."""
        self._check_heads(query_states, key_states, value_states)
        # the compute dtype: the states are cast to it, and so is what the cache gives back
        compute = self.dtype or jnp.result_type(query_states, key_states, value_states)
        query_states, key_states, value_states = (jnp.asarray(x).astype(compute)
                                                  for x in (query_states, key_states, value_states))
        cache_in = cache if cache is not None else self.held_cache
        mode = mode or ("train" if cache_in is None else "decode" if query_states.shape[1] == 1 else "prefill")
        features = self._features(deterministic, dropout_rng)
        if mode == "train":
            if cache is not None:
                raise ValueError("mode='train' takes no cache; use mode='prefill' or 'decode'")
            ids = {} if segment_ids is None else {"q_segment_ids": segment_ids, "kv_segment_ids": segment_ids}
            return self.impl(query_states, key_states, value_states, attention_mask, bias, None, self.causal,
                             **ids, **features)
        if cache_in is None:
            raise ValueError(f"mode={mode!r} needs a KV cache: pass cache=KVCache(...) or call init_cache() first")
        if mode == "decode" and query_states.shape[1] != 1:
            raise ValueError(f"mode='decode' takes one new position (T=1), got T={query_states.shape[1]}")
        if segment_ids is not None:
            raise ValueError("segment_ids are for packed training calls, not for cached prefill/decode")
        new_cache, keys, values, lengths, fits = cache_in.update(key_states, value_states)
        keys, values = keys.astype(compute), values.astype(compute)
        if lengths is None:  # growing cache: causal bottom-right alignment does the masking
            out = self.impl(query_states, keys, values, attention_mask, bias, None, self.causal, **features)
        else:
            out = self._attend_fixed(query_states, keys, values, lengths, attention_mask, bias, features)
            # a traced write that did not fit was dropped: NaN, never outputs that look right
            out = jax.tree.map(lambda x: jnp.where(fits, x, jnp.nan).astype(x.dtype), out)
        if cache is not None:
            return out, new_cache
        self._store(new_cache)
        return out

    def _attend_fixed(self, q: Any, keys: Any, values: Any, lengths: Any, attention_mask: Any, bias: Any,
                      features: dict[str, Any]) -> AttentionOutput:
        """Attention over a fixed cache holding ``lengths`` valid positions per sequence.

        ``kv_lengths`` aligns causal masking and the window to the last written token (the
        buffer's end is only its capacity). An impl that cannot take ``kv_lengths`` gets the same
        visibility as a mask, the window folded in.
        """
        with_lengths = {**features, "kv_lengths": lengths}
        if not self.impl.supports(q, keys, values, attention_mask, bias, None, self.causal, **with_lengths):
            return self.impl(q, keys, values, attention_mask, bias, None, self.causal, **with_lengths)
        window = window_pair(self.sliding_window, keys.shape[1])  # clamped: int32 position arithmetic below
        mask = valid_mask(lengths, q.shape[1], keys.shape[1], self.causal, window)
        if attention_mask is not None:
            mask = jnp.logical_and(attention_mask, mask)
        return self.impl(q, keys, values, mask, bias, None, False, **{**features, "sliding_window": None})

    def _features(self, deterministic: bool, dropout_rng: Any) -> dict[str, Any]:
        features: dict[str, Any] = {"sliding_window": self.sliding_window, "logits_soft_cap": self.logits_soft_cap,
                                    "softmax_scale": self.softmax_scale}
        if self.dropout_prob > 0 and not deterministic:
            if dropout_rng is None:
                if self.rngs is None:
                    raise ValueError("dropout needs rngs=nnx.Rngs(dropout=...) at construction or dropout_rng=")
                dropout_rng = self.rngs.dropout()
            features.update(dropout_prob=self.dropout_prob, dropout_rng=dropout_rng)
        return features

    def _check_heads(self, q: Any, k: Any, v: Any) -> None:
        want = {"query_states": (q, self.num_q_heads), "key_states": (k, self.num_kv_heads),
                "value_states": (v, self.num_kv_heads)}
        for name, (x, heads) in want.items():
            if x.ndim != 4 or x.shape[2] != heads or (name != "value_states" and x.shape[3] != self.head_dims):
                raise ValueError(f"{name}: expected (batch, seq, {heads}, {self.head_dims}) (BTHD), got {x.shape}")

    # -- introspection and benchmarks -------------------------------------------------------------
    def explain(self, batch_size: int = 1, seq_len: int = 2048, kv_len: int | None = None,
                dtype: Any = None) -> jaxattn.Explanation:
        """What "auto" (or the named impl) does for a call of this module's shape."""
        q, k, v = self._structs(batch_size, seq_len, kv_len or seq_len, dtype)
        return jaxattn.explain(q, k, v, impl=self.attention_mechanism, metadata=self.metadata, causal=self.causal,
                               sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap)

    def _structs(self, b: int, t: int, s: int, dtype: Any) -> tuple[Any, Any, Any]:
        dt = jnp.dtype(dtype or self.dtype or jnp.float32)
        return (jax.ShapeDtypeStruct((b, t, self.num_q_heads, self.head_dims), dt),
                jax.ShapeDtypeStruct((b, s, self.num_kv_heads, self.head_dims), dt),
                jax.ShapeDtypeStruct((b, s, self.num_kv_heads, self.head_dims), dt))

    def run_attention_benchmarks(
        self,
        batch_sizes: tuple[int, ...] = (1, 2),
        sequence_lengths: tuple[int, ...] = (512, 1024),
        impls: list[str] | None = None,
        modes: tuple[str, ...] = ("fwd", "fwdbwd"),
        warmup: int = 2,
        repeats: int = 10,
        progress: str = "none",
    ) -> BenchReport:
        """Time every registered impl usable here (and "auto") on this module's shapes.

        Shapes: each batch size x sequence length, with the module's heads, head dim, causal
        flag and dtype. Backends that decline a shape get "declined" results, never an error.
        ``jaxattn_bench.report`` turns the report into tables or JSON (``report_dict``), and
        ``jaxattn_bench.plot.write_plot`` that JSON into a PNG.
        """
        from jaxattn_bench import BenchConfig, BenchShape, run_bench
        from jaxattn_bench.backends import available_backends
        from jaxattn_bench.progress import Progress

        dtype = jnp.dtype(self.dtype or jnp.float32).name
        shapes = [BenchShape(b, s, s, self.num_q_heads, self.num_kv_heads, self.head_dims, self.causal, dtype)
                  for s in sequence_lengths for b in batch_sizes]
        names = [n for n in (impls or available_backends(self.metadata)) if n != "auto"] + ["auto"]
        reference = next((n for n in ("cudnn", "vanilla") if n in names), names[0])
        config = BenchConfig(shapes=shapes, backends=names, reference=reference, modes=modes, warmup=warmup,
                             repeats=repeats, metadata=self.metadata)
        return run_bench(config, Progress.choose(progress))
