"""A small Llama-style decoder in Flax NNX whose attention runs through jaxattn.

RMSNorm, rotary embeddings, grouped-query attention and a SwiGLU MLP. Three ways to run it:

* training (``model(tokens, positions, segment_ids)``): causal attention through
  ``jaxattn.attention`` (``impl="auto"`` by default), with packed documents as segment ids;
  ``attention="jax.nn"`` or ``"cudnn"`` runs ``jax.nn.dot_product_attention`` instead, for
  comparison (``examples/llama/bench.py``);
* decoding over a dense cache (``model.step_dense``): ``jaxattn.attention`` with ``kv_lengths``;
* decoding over a paged int8 cache (``model.step_paged``): keys and values quantized per token
  by ``jaxattn.quantize_kv``, written into pages, prefill through
  ``jaxattn.ragged_paged_attention`` and decode steps through ``jaxattn.paged_attention``.

``generate`` drives either cache greedily. ``tests/examples/test_llama.py`` trains and generates
at a tiny size; ``python3 examples/llama/bench.py`` times training and decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxattn

__all__ = ["Config", "DenseCache", "Llama", "PagedCache", "generate", "loss_fn", "packed_positions", "sgd_step"]


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 64
    rope_theta: float = 10_000.0
    eps: float = 1e-6
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# -- caches ------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseCache:
    """Per layer ``(B, L, Hkv, D)`` keys and values; ``length`` tokens written (every sequence alike)."""

    k: tuple[Any, ...]
    v: tuple[Any, ...]
    length: Any  # int32 scalar

    @classmethod
    def empty(cls, cfg: Config, batch: int, max_length: int) -> DenseCache:
        shape = (batch, max_length, cfg.kv_heads, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.layers))
        return cls(zeros, zeros, jnp.zeros((), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """Per layer int8 pages ``(num_pages, page_size, Hkv, D)`` with float32 per-token scales
    ``(num_pages, page_size, Hkv)``; ``page_table (B, pages_per_seq)``; ``length`` as above."""

    k: tuple[Any, ...]
    v: tuple[Any, ...]
    k_scale: tuple[Any, ...]
    v_scale: tuple[Any, ...]
    page_table: Any
    length: Any

    @classmethod
    def empty(cls, cfg: Config, batch: int, max_length: int, page_size: int = 4, seed: int = 0) -> PagedCache:
        per_seq = -(-max_length // page_size)
        num_pages = batch * per_seq + 1  # one spare page no sequence lists
        # pages in any order: each sequence gets a shuffled set of the pool's pages
        table = jax.random.permutation(jax.random.key(seed), num_pages)[:batch * per_seq].reshape(batch, per_seq)
        pages = tuple(jnp.zeros((num_pages, page_size, cfg.kv_heads, cfg.head_dim), jnp.int8)
                      for _ in range(cfg.layers))
        scales = tuple(jnp.ones((num_pages, page_size, cfg.kv_heads), jnp.float32) for _ in range(cfg.layers))
        return cls(pages, pages, scales, scales, table.astype(jnp.int32), jnp.zeros((), jnp.int32))


# -- layers ------------------------------------------------------------------------------------
class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float) -> None:
        self.weight = nnx.Param(jnp.ones((dim,)))
        self.eps = eps

    def __call__(self, x: Any) -> Any:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight[...]).astype(x.dtype)


def rope(x: Any, positions: Any, theta: float) -> Any:
    """Rotary embedding of ``x (B, T, H, D)`` at ``positions (B, T)`` (rotate-half form)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * freqs  # (B, T, D/2)
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: Config, attention: str, impl: str, rngs: nnx.Rngs) -> None:
        d, dt = cfg.head_dim, jnp.dtype(cfg.dtype)
        self.cfg, self.attention, self.impl = cfg, attention, impl
        self.wq = nnx.Linear(cfg.dim, cfg.heads * d, use_bias=False, dtype=dt, rngs=rngs)
        self.wk = nnx.Linear(cfg.dim, cfg.kv_heads * d, use_bias=False, dtype=dt, rngs=rngs)
        self.wv = nnx.Linear(cfg.dim, cfg.kv_heads * d, use_bias=False, dtype=dt, rngs=rngs)
        self.wo = nnx.Linear(cfg.heads * d, cfg.dim, use_bias=False, dtype=dt, rngs=rngs)

    def qkv(self, x: Any, positions: Any) -> tuple[Any, Any, Any]:
        b, t, _ = x.shape
        c = self.cfg
        q = self.wq(x).reshape(b, t, c.heads, c.head_dim)
        k = self.wk(x).reshape(b, t, c.kv_heads, c.head_dim)
        v = self.wv(x).reshape(b, t, c.kv_heads, c.head_dim)
        return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v

    def out(self, o: Any) -> Any:
        return self.wo(o.reshape(*o.shape[:2], -1))

    def __call__(self, x: Any, positions: Any, segment_ids: Any = None) -> Any:
        q, k, v = self.qkv(x, positions)
        if self.attention == "jaxattn":
            o = jaxattn.attention(q, k, v, impl=self.impl, causal=True, q_segment_ids=segment_ids,
                                  kv_segment_ids=segment_ids)
        else:  # "jax.nn" (its default implementation) or "cudnn": the baselines of bench.py
            mask = None if segment_ids is None else segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
            o = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                             implementation="cudnn" if self.attention == "cudnn" else None)
        return self.out(o)

    def step_dense(self, x: Any, positions: Any, k_cache: Any, v_cache: Any, length: Any) -> tuple[Any, Any, Any]:
        """T new tokens written at ``length``, attending over the cache (``kv_lengths``)."""
        q, k, v = self.qkv(x, positions)
        start = (0, length, 0, 0)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), start)
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), start)
        lengths = jnp.full((x.shape[0],), length + x.shape[1], jnp.int32)
        o = jaxattn.attention(q, k_cache, v_cache, kv_lengths=lengths, causal=True, impl=self.impl)
        return self.out(o), k_cache, v_cache

    def step_paged(self, x: Any, positions: Any, layer: tuple[Any, Any, Any, Any], page_table: Any,
                   length: Any) -> tuple[Any, tuple[Any, Any, Any, Any]]:
        """T new tokens quantized into their pages; prefill (T > 1) through the ragged op, decode
        steps (T = 1) through ``paged_attention``."""
        k_pages, v_pages, k_scale, v_scale = layer
        b, t = x.shape[:2]
        q, k, v = self.qkv(x, positions)
        kq, ks = jaxattn.quantize_kv(k, jnp.int8, granularity="token")  # (B, T, Hkv, D), (B, T, Hkv)
        vq, vs = jaxattn.quantize_kv(v, jnp.int8, granularity="token")
        page_size = k_pages.shape[1]
        pos = length + jnp.arange(t)
        page = page_table[:, pos // page_size]  # (B, T)
        slot = jnp.broadcast_to(pos % page_size, (b, t))
        k_pages, v_pages = k_pages.at[page, slot].set(kq), v_pages.at[page, slot].set(vq)
        k_scale, v_scale = k_scale.at[page, slot].set(ks), v_scale.at[page, slot].set(vs)
        lengths = jnp.full((b,), length + t, jnp.int32)
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        if t == 1:
            o = jaxattn.paged_attention(q, k_pages, v_pages, page_table, lengths, **scales)
        else:  # a ragged batch of B prefill chunks of T tokens each
            cu = jnp.arange(b + 1, dtype=jnp.int32) * t
            o = jaxattn.ragged_paged_attention(q.reshape(b * t, *q.shape[2:]), k_pages, v_pages, page_table,
                                               lengths, cu, b, **scales).reshape(b, t, *q.shape[2:])
        return self.out(o), (k_pages, v_pages, k_scale, v_scale)


class MLP(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs) -> None:
        dt = jnp.dtype(cfg.dtype)
        self.gate = nnx.Linear(cfg.dim, cfg.hidden, use_bias=False, dtype=dt, rngs=rngs)
        self.up = nnx.Linear(cfg.dim, cfg.hidden, use_bias=False, dtype=dt, rngs=rngs)
        self.down = nnx.Linear(cfg.hidden, cfg.dim, use_bias=False, dtype=dt, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: Config, attention: str, impl: str, rngs: nnx.Rngs) -> None:
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg, attention, impl, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: Any, positions: Any, segment_ids: Any = None) -> Any:
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """``attention``: "jaxattn" (through ``jaxattn.attention`` with ``impl``), "jax.nn" or "cudnn"
    (``jax.nn.dot_product_attention``'s default or cuDNN implementation); ``remat``
    rematerialises each block in the backward."""

    def __init__(self, cfg: Config, *, attention: str = "jaxattn", impl: str = "auto", remat: bool = False,
                 rngs: nnx.Rngs) -> None:
        if attention not in ("jaxattn", "jax.nn", "cudnn"):
            raise ValueError(f"attention must be 'jaxattn', 'jax.nn' or 'cudnn', got {attention!r}")
        self.cfg, self.remat = cfg, remat
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, attention, impl, rngs) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.dim, cfg.eps)

    def logits(self, x: Any) -> Any:
        return self.embed.attend(self.norm(x)).astype(jnp.float32)  # tied embeddings

    def __call__(self, tokens: Any, positions: Any, segment_ids: Any = None) -> Any:
        x = self.embed(tokens)
        for block in self.blocks:
            if self.remat:
                x = nnx.remat(lambda blk, x: blk(x, positions, segment_ids))(block, x)
            else:
                x = block(x, positions, segment_ids)
        return self.logits(x)

    def step_dense(self, tokens: Any, cache: DenseCache) -> tuple[Any, DenseCache]:
        positions = jnp.broadcast_to(cache.length + jnp.arange(tokens.shape[1]), tokens.shape)
        x, ks, vs = self.embed(tokens), [], []
        for block, k, v in zip(self.blocks, cache.k, cache.v, strict=True):
            h, k, v = block.attn.step_dense(block.attn_norm(x), positions, k, v, cache.length)
            x = x + h
            x = x + block.mlp(block.mlp_norm(x))
            ks.append(k)
            vs.append(v)
        return self.logits(x), DenseCache(tuple(ks), tuple(vs), cache.length + tokens.shape[1])

    def step_paged(self, tokens: Any, cache: PagedCache) -> tuple[Any, PagedCache]:
        positions = jnp.broadcast_to(cache.length + jnp.arange(tokens.shape[1]), tokens.shape)
        x, layers = self.embed(tokens), []
        for i, block in enumerate(self.blocks):
            layer = (cache.k[i], cache.v[i], cache.k_scale[i], cache.v_scale[i])
            h, layer = block.attn.step_paged(block.attn_norm(x), positions, layer, cache.page_table, cache.length)
            x = x + h
            x = x + block.mlp(block.mlp_norm(x))
            layers.append(layer)
        k, v, ks, vs = (tuple(parts) for parts in zip(*layers, strict=True))
        return self.logits(x), PagedCache(k, v, ks, vs, cache.page_table, cache.length + tokens.shape[1])


# -- training ----------------------------------------------------------------------------------
def packed_positions(segment_ids: Any) -> Any:
    """Each token's position inside its own document (positions restart where the id changes)."""
    t = jnp.arange(segment_ids.shape[1])
    starts = jnp.where(jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                                        segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1), t, 0)
    return t - jax.lax.cummax(starts, axis=1)


def loss_fn(model: Llama, tokens: Any, segment_ids: Any = None) -> Any:
    """Next-token cross entropy; with packed documents no target crosses into the next one."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seg = None if segment_ids is None else segment_ids[:, :-1]
    positions = (jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape) if seg is None
                 else packed_positions(seg))
    logits = model(inputs, positions, seg)
    nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    weight = jnp.ones_like(nll) if segment_ids is None else (segment_ids[:, 1:] == segment_ids[:, :-1])
    return jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1)


@nnx.jit(static_argnames="lr")
def sgd_step(model: Llama, tokens: Any, segment_ids: Any = None, lr: float = 0.5) -> Any:
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, segment_ids)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))
    return loss


# -- generation --------------------------------------------------------------------------------
@nnx.jit
def _dense_step(model: Llama, tokens: Any, cache: DenseCache) -> tuple[Any, DenseCache]:
    return model.step_dense(tokens, cache)


@nnx.jit
def _paged_step(model: Llama, tokens: Any, cache: PagedCache) -> tuple[Any, PagedCache]:
    return model.step_paged(tokens, cache)


def generate(model: Llama, prompt: Any, steps: int, cache: DenseCache | PagedCache,
             forced: Any = None) -> tuple[Any, Any]:
    """Greedy decoding: the prompt as one prefill, then ``steps`` decode steps. ``forced (B, steps)``
    feeds those tokens instead of the greedy ones (to compare two caches on one sequence).
    Returns the tokens ``(B, steps)`` and every step's logits ``(B, steps, vocab)``."""
    step = _dense_step if isinstance(cache, DenseCache) else _paged_step
    logits, cache = step(model, prompt, cache)
    last, tokens, all_logits = logits[:, -1], [], []
    for i in range(steps):
        all_logits.append(last)
        token = jnp.argmax(last, axis=-1) if forced is None else forced[:, i]
        tokens.append(token)
        logits, cache = step(model, token[:, None], cache)
        last = logits[:, -1]
    return jnp.stack(tokens, axis=1), jnp.stack(all_logits, axis=1)
