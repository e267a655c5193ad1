"""Timing helpers for the Triton kernels: the benchmark scripts' (``triton_gpu_check.py``,
``triton_paged_check.py``) and the tile tuner's measure (``jaxattn_triton.tuning.tune``).

A helper of this folder, not of the plugin's wheel: it times kernels through the plugin's
internals (``ops._execute``, the launch specs) and samples as ``jaxattn bench`` does
(``jaxattn_bench.timing``, from jaxattn-bench).

FLOPs follow CONTRIBUTING.md ("Measuring"): ``4 * B * H * T * S * D`` forward (times the fraction of the score
matrix inside the causal/window band), forward + backward = 3.5 x forward.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxattn_triton.flash import launch as L
from jaxattn_triton.spec import AttnSpec


def attention_flops(
    batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, *, causal: bool, backward: bool
) -> float:
    """The count of CONTRIBUTING.md: causal halves the forward; forward + backward is 3.5 x forward."""
    flops = 4.0 * batch * heads * seq_q * seq_k * head_dim
    if causal:
        flops /= 2
    return flops * 3.5 if backward else flops


def time_jax(fn: Callable[..., Any], *args: Any, reps: int = 20, min_sample_ms: float = 10.0,
             preroll_ms: float = 100.0) -> float:
    """Median seconds of one call of ``fn(*args)`` (already jitted), timed as ``jaxattn bench`` does.

    After a warm-up call and ``preroll_ms`` of untimed calls (the GPU's clocks settle to this
    kernel's power draw), ``reps`` samples of back-to-back calls lasting ``min_sample_ms``
    each (host dispatch overlaps device work, as in a training step); see
    :mod:`jaxattn_bench.timing`.
    """
    from jaxattn_bench.timing import Program, preroll, run_once, run_sample, size_samples

    program = Program(fn, None, 0.0)
    run_once(program, args)
    number, warm = size_samples(program, args, run_once(program, args), min_sample_ms, preroll_ms)
    preroll(program, args, warm)
    return statistics.median(run_sample(program, args, number) for _ in range(reps)) / 1e3


def random_inputs(spec: AttnSpec, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    dt = jnp.dtype(spec.dtype)
    q = jax.random.normal(kq, (spec.batch, spec.seq_q, spec.heads_q, spec.head_dim), dt)
    k = jax.random.normal(kk, (spec.batch, spec.seq_k, spec.heads_kv, spec.head_dim), dt)
    v = jax.random.normal(kv, (spec.batch, spec.seq_k, spec.heads_kv, spec.head_dim_v), dt)
    return q, k, v


def measure_kernels(
    spec: AttnSpec, tiles: L.Tiles, kernels: tuple[str, ...] = ("fwd", "dkdv", "dq"), reps: int = 10
) -> dict[str, float]:
    """Seconds per launch of the named kernels (``fwd``, ``dkdv``, ``dq``) of a plain call.

    ``dkdv_atomic`` times the atomic-dQ backward instead: the dK/dV kernel with
    ``tiles.dkdv`` summing dQ in float32, the accumulator's zeroing and its
    scale-and-cast to the input dtype; ``dkdv_split`` the dV and dK launches of
    ``tiles.dkdv`` (``Tiles.dkdv_split``).
    The backward kernels are timed on the real forward's outputs, so their inputs are
    realistic (no zeros, no overflow). Used by ``tuning.tune`` on a GPU.
    """
    from jaxattn_triton.flash.ops import _execute

    if spec.mask_shape or spec.bias_shape or spec.segments or spec.sinks:
        raise ValueError("measure_kernels times plain calls (causal/window/soft cap only)")
    q, k, v = random_inputs(spec)
    dummies = (
        jnp.zeros((1,), jnp.int8),
        jnp.zeros((1,), jnp.float32),
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((1,), jnp.int32),
    )
    sinks = jnp.zeros((1,), jnp.float32)
    # A mask_mod's bits, seen keys, tile lists and masks.alibi's slopes: none.
    no_mod = (*(jnp.zeros((1,), jnp.int32),) * 3, jnp.zeros((1,), jnp.float32))
    fwd = jax.jit(lambda *a: _execute(L.forward(spec, tiles.fwd), a, False))
    result = {}
    if "fwd" in kernels:
        result["fwd"] = time_jax(fwd, q, k, v, *dummies, sinks, *no_mod, reps=reps)
    if not {"dkdv", "dq", "dkdv_atomic", "dkdv_split"} & set(kernels):
        return result
    out, lse = fwd(q, k, v, *dummies, sinks, *no_mod)
    dout = jax.random.normal(jax.random.PRNGKey(1), out.shape, out.dtype)
    pre = jax.jit(lambda *a: _execute(L.preprocess(spec), a, False))
    delta, lse_b, _, _ = pre(out, dout, lse, jnp.zeros_like(lse), sinks)
    common = (q, k, v, *dummies, dout, lse_b, delta, *no_mod)
    if "dkdv" in kernels:
        dkdv = jax.jit(lambda *a: _execute(L.dkdv(spec, tiles.dkdv), a, False))
        result["dkdv"] = time_jax(dkdv, *common, reps=reps)
    if "dkdv_atomic" in kernels:

        def atomic(*a: jax.Array) -> list[jax.Array]:
            dk, dv, _, dq_acc = _execute(L.dkdv(spec, tiles.dkdv, L.DQ_ATOMIC), a, False)
            return [dk, dv, (dq_acc * spec.softmax_scale).astype(q.dtype)]

        result["dkdv_atomic"] = time_jax(jax.jit(atomic), *common, reps=reps)
    if "dkdv_split" in kernels:

        def split(*a: jax.Array) -> list[jax.Array]:
            dv = _execute(L.dkdv(spec, tiles.dkdv, part=L.PART_DV), a, False)[1]
            dk = _execute(L.dkdv(spec, tiles.dkdv, part=L.PART_DK), a, False)[0]
            return [dk, dv]

        result["dkdv_split"] = time_jax(jax.jit(split), *common, reps=reps)
    if "dq" in kernels:
        dq = jax.jit(lambda *a: _execute(L.dq(spec, tiles.dq), [*a, no_mod[-1]], False))  # no lse_term: no alibi
        result["dq"] = time_jax(dq, *common, reps=reps)
    return result


def time_attention(
    attn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    reps: int = 20,
) -> tuple[float, float]:
    """Median seconds of the forward and of forward + backward (a VJP with a fixed dO)."""
    fwd = jax.jit(attn)
    dout = jax.random.normal(jax.random.PRNGKey(2), fwd(q, k, v).shape, q.dtype)

    def fwd_bwd(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array) -> Any:
        _, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)

    both = jax.jit(fwd_bwd)
    return time_jax(fwd, q, k, v, reps=reps), time_jax(both, q, k, v, dout, reps=reps)
