"""mosaic_flash's kernel beside cuDNN and tokamax's Mosaic GPU kernel, in one process (H100).

    PYTHONUNBUFFERED=1 python3 benchmarks/mosaic_bench.py [--check] [--bwd-check] [--bench] [--quick]
        [--fp16] [--sweep] [--bwd] [--bwd-sweep] [--head-dims 64,128] [--resources DIR]

It loads plugins/mosaic/src/jaxattn_mosaic/kernel.py and backward_kernel.py by path (tokamax
where installed); ``--bwd`` also needs jaxattn-mosaic and jaxattn-sdpa installed. ``--check``
compares the forward (output and LSE) with a float32 reference on odd, causal, T != S and GQA
shapes; ``--bwd-check`` the backward kernels' dq, dk, dv with jax's gradient of that reference
(a loss through the output and the lse) and two runs bit for bit; ``--bench`` prints a markdown
table of forward times (ms, TFLOP/s; causal counts half the FLOPs) and ratios; ``--bwd`` adds
forward+backward columns: mosaic's forward with cuDNN's backward ("mosaic"), with this
package's own backward ("own"), cuDNN's and tokamax's; ``--sweep`` also times other forward
tiles, ``--bwd-sweep`` other backward tiles (ablations); ``--resources DIR`` compiles the
forward configurations and the backward with Mosaic GPU's dumps and prints ptxas's report
(registers, spills, injected waits).

Timing: each function is jitted, warmed up, then run ``iters`` times back to back and blocked
on the last; the best of ``reps`` such runs is kept (milliseconds per call).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import pathlib
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_KERNEL = pathlib.Path(__file__).resolve().parents[1] / "plugins/mosaic/src/jaxattn_mosaic/kernel.py"
_spec = importlib.util.spec_from_file_location("mosaic_kernel", _KERNEL)
if _spec is None or _spec.loader is None:
    raise ImportError(_KERNEL)
K = importlib.util.module_from_spec(_spec)
sys.modules["mosaic_kernel"] = K
_spec.loader.exec_module(K)
_bspec = importlib.util.spec_from_file_location("mosaic_backward_kernel", _KERNEL.with_name("backward_kernel.py"))
if _bspec is None or _bspec.loader is None:
    raise ImportError(_KERNEL.with_name("backward_kernel.py"))
KB = importlib.util.module_from_spec(_bspec)
sys.modules["mosaic_backward_kernel"] = KB
_bspec.loader.exec_module(KB)

#: (block_q, block_kv, stages, pingpong[, overlap[, exp2_fma_cols]]) timed beside the default
#: with --sweep (an ablation).
SWEEP: dict[int, tuple[tuple[int, ...], ...]] = {
    128: ((64, 128, 2, False), (64, 64, 4, True), (128, 64, 2, True), (64, 128, 3, True), (64, 128, 2, True),
          (64, 192, 2, True), (64, 128, 2, True, True), (64, 128, 3, True, True), (64, 128, 2, True, False, 64),
          (64, 192, 2, True, False, 64)),
    64: ((64, 128, 2, True), (64, 256, 2, False), (64, 128, 2, True, True)),
    256: ((64, 64, 2, False),),
}
#: Backward tiles, ((dQ block_q, block_kv, stages), (dK/dV block_q, block_kv, stages)), timed
#: beside the default with --bwd --bwd-sweep.
BWD_SWEEP: tuple[tuple[tuple[int, int, int], tuple[int, int, int]], ...] = (
    ((64, 64, 3), (64, 64, 3)), ((64, 128, 2), (64, 64, 2)), ((64, 64, 4), (64, 64, 4)),
    ((64, 128, 3), (64, 64, 3)),
)


def bwd_config(tiles: tuple[tuple[int, int, int], tuple[int, int, int]]) -> Any:
    return KB.BackwardConfig(KB.Tiles(*tiles[0]), KB.Tiles(*tiles[1]))


def reference(q: Any, k: Any, v: Any, causal: bool, scale: float) -> tuple[Any, Any]:
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    qf = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(jnp.float32)) * scale
    if causal:
        keep = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t)
        logits = jnp.where(keep, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(logits - m)
    den = e.sum(-1, keepdims=True)
    safe = jnp.where(den == 0, 1.0, den)  # rows that see no key: zeros, lse -inf, no NaN gradient
    p = e / safe
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32)).reshape(b, t, hq, d)
    lse = jnp.where(den == 0, -jnp.inf, jnp.log(safe) + m)
    return out, lse[..., 0].reshape(b, hq, t)


CHECKS = [
    # (B, T, S, Hq, Hkv, D, causal, dtype)
    (2, 512, 512, 4, 4, 128, False, jnp.float16),
    (2, 512, 512, 4, 4, 128, True, jnp.bfloat16),
    (1, 384, 640, 8, 2, 64, True, jnp.bfloat16),
    (1, 640, 384, 4, 1, 128, True, jnp.float16),
    (1, 333, 517, 4, 2, 128, False, jnp.bfloat16),
    (1, 333, 517, 4, 2, 128, True, jnp.bfloat16),
    (1, 517, 129, 2, 2, 64, True, jnp.float16),
    (1, 256, 384, 2, 1, 256, False, jnp.bfloat16),
    (1, 300, 300, 2, 2, 256, True, jnp.float16),
    (1, 1, 77, 2, 2, 128, True, jnp.bfloat16),
]


def _checks(shapes: list[Any], quick: bool, configs: tuple[Any, ...]) -> list[tuple[Any, Any]]:
    """``(config, shape)``: each shape at the default configuration (the first three if quick),
    then each of ``configs`` at head dim 128."""
    return [(None, c) for c in (shapes[:3] if quick else shapes)] + [
        (cfg, c) for cfg in configs for c in shapes if c[5] == 128]


def _inputs(b: int, t: int, s: int, hq: int, hkv: int, d: int, dt: Any) -> tuple[Any, ...]:
    """q, k, v of the shape, and two more keys (for cotangents)."""
    ks = jax.random.split(jax.random.PRNGKey(t * 7 + s + d), 5)
    return (jax.random.normal(ks[0], (b, t, hq, d), dt), jax.random.normal(ks[1], (b, s, hkv, d), dt),
            jax.random.normal(ks[2], (b, s, hkv, d), dt), ks[3], ks[4])


def check(quick: bool, configs: tuple[Any, ...] = ()) -> int:
    """The default configuration, then each of ``configs`` (at head dim 128 only)."""
    bad = 0
    for cfg, (b, t, s, hq, hkv, d, causal, dt) in _checks(CHECKS, quick, configs):
        q, k, v, _, _ = _inputs(b, t, s, hq, hkv, d, dt)
        scale = 1.0 / math.sqrt(d)
        try:
            fn = jax.jit(functools.partial(K.mosaic_attention_forward, causal=causal, softmax_scale=scale,
                                           config=None if cfg is None else K.Config(*cfg)))
            out, lse = fn(q, k, v)
            ro, rl = reference(q, k, v, causal, scale)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ro)))
            fin = jnp.isfinite(rl)
            lerr = float(jnp.max(jnp.where(fin, jnp.abs(lse - rl), 0.0)))
            inf_ok = bool(jnp.all(jnp.where(fin, True, lse == -jnp.inf)))
            tol = 2e-2 if dt == jnp.bfloat16 else 4e-3
            ok = err < tol and lerr < 1e-2 and inf_ok and bool(jnp.all(jnp.isfinite(out)))
        except Exception as e:
            ok, err, lerr = False, float("nan"), float("nan")
            print("   ", type(e).__name__, str(e)[:2000])
        bad += not ok
        name = "default" if cfg is None else cfg
        print(f"check {name} B={b} T={t} S={s} H={hq}/{hkv} D={d} causal={causal} {jnp.dtype(dt).name}: "
              f"max|out-ref|={err:.2e} max|lse-ref|={lerr:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return bad


def bwd_check(quick: bool, configs: tuple[Any, ...] = ()) -> int:
    """The backward kernel's dq, dk, dv against jax's gradient of the float32 reference, with a
    loss through the output and the lse; and that two runs agree bit for bit."""
    bad = 0
    for cfg, (b, t, s, hq, hkv, d, causal, dt) in _checks([c for c in CHECKS if c[5] in KB.HEAD_DIMS], quick,
                                                          configs):
        q, k, v, k_out, k_lse = _inputs(b, t, s, hq, hkv, d, dt)
        d_out = jax.random.normal(k_out, (b, t, hq, d), jnp.float32)
        d_lse = 0.5 * jax.random.normal(k_lse, (b, hq, t), jnp.float32)
        scale = 1.0 / math.sqrt(d)
        try:
            out, lse = jax.jit(functools.partial(K.mosaic_attention_forward, causal=causal,
                                                 softmax_scale=scale))(q, k, v)
            back = jax.jit(functools.partial(KB.mosaic_attention_backward, causal=causal, softmax_scale=scale,
                                             config=None if cfg is None else bwd_config(cfg)))
            got = back(q, k, v, out, lse, d_out.astype(dt), d_lse)
            again = back(q, k, v, out, lse, d_out.astype(dt), d_lse)
            same = all(bool(jnp.array_equal(x, y)) for x, y in zip(got, again, strict=True))
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            (_, rl), vjp = jax.vjp(functools.partial(reference, causal=causal, scale=scale), *f32)
            want = vjp((d_out.astype(dt).astype(jnp.float32), jnp.where(jnp.isfinite(rl), d_lse, 0.0)))
            errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / (float(jnp.max(jnp.abs(w))) + 1e-6))
                    for g, w in zip(got, want, strict=True)]
            finite = all(bool(jnp.all(jnp.isfinite(g))) for g in got)
            tol = 3e-2 if dt == jnp.bfloat16 else 1e-2
            ok = finite and same and max(errs) < tol
        except Exception as e:
            ok, errs, same = False, [float("nan")] * 3, False
            print("   ", type(e).__name__, str(e)[:3000])
        bad += not ok
        name = "default" if cfg is None else cfg
        print(f"bwd check {name} B={b} T={t} S={s} H={hq}/{hkv} D={d} causal={causal} {jnp.dtype(dt).name}: "
              f"max|d-ref|/max|ref| dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} "
              f"deterministic={same} {'ok' if ok else 'FAIL'}", flush=True)
    return bad


def timeit(fn: Callable[..., Any], args: tuple[Any, ...], iters: int = 20, reps: int = 3) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e3


def import_tokamax() -> Any:
    try:
        try:
            import xprof.cli.tools  # noqa: F401
        except ImportError:
            # tokamax imports xprof for its own profiler only; a stub keeps its kernels importable.
            for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
                sys.modules[name] = types.ModuleType(name)
            sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None  # type: ignore[attr-defined]
        try:
            import qwix  # noqa: F401
        except ImportError:
            # qwix (which needs flax) serves tokamax's quantized operands only: its attention
            # names qwix.QArray in isinstance checks and annotations, which a stub class keeps.
            stub = types.ModuleType("qwix")
            stub.QArray = type("QArray", (), {})  # type: ignore[attr-defined]
            stub.quantize = stub.dequantize = None  # type: ignore[attr-defined]
            sys.modules["qwix"] = stub
        import tokamax
    except Exception as e:
        print("tokamax unavailable:", type(e).__name__, str(e)[:300])
        return None
    return tokamax


SHAPES = [
    # (B, S, Hq, Hkv, D)
    (4, 4096, 32, 32, 128),
    (1, 16384, 32, 8, 128),
    (1, 16384, 32, 32, 128),
    (2, 8192, 16, 16, 128),
    (8, 1024, 16, 16, 128),
    (4, 2048, 32, 8, 128),
    (4, 4096, 32, 8, 64),
    (4, 4096, 16, 16, 256),
]


def _fwd_fns(causal: bool, scale: float, tk: Any, sweep: bool, d: int) -> dict[str, Callable[..., Any]]:
    def mosaic(q: Any, k: Any, v: Any, config: Any = None) -> Any:
        return K.mosaic_attention_forward(q, k, v, causal=causal, softmax_scale=scale, config=config)[0]

    def cudnn(q: Any, k: Any, v: Any) -> Any:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale, implementation="cudnn")

    fns: dict[str, Callable[..., Any]] = {"mosaic": jax.jit(mosaic), "cudnn": jax.jit(cudnn)}
    if tk is not None:
        fns["tokamax"] = jax.jit(functools.partial(tk.dot_product_attention, is_causal=causal, scale=scale,
                                                   implementation="mosaic"))
    for cfg in SWEEP.get(d, ()) if sweep else ():
        fns[f"mosaic{cfg}"] = jax.jit(functools.partial(mosaic, config=K.Config(*cfg)))
    if tk is not None and sweep:
        # tokamax's kernel with its persistence switched (its heuristic: persistent for full
        # attention only), at its default tiles: what its own persistence is worth.
        from tokamax._src.ops.attention import pallas_mosaic_gpu as tkm

        op = tkm.PallasMosaicGpuFlashAttention(config=tkm.ConfigSM90(block_q=64, block_kv=128, num_stages=2,
                                                                     persistent=causal))
        fns["tokamax(persistent)" if causal else "tokamax(not persistent)"] = jax.jit(
            functools.partial(op, is_causal=causal, logits_scale=scale))
    return fns


def _mosaic_trained(causal: bool, scale: float, own: bool, config: Any = None) -> Callable[..., Any]:
    """mosaic_flash's forward with its own backward kernel (``config``: its tiles) or, ``own``
    False, cuDNN's backward fed its output and lse."""
    from jaxattn_mosaic.backward import differentiable, with_cudnn_backward

    def forward(q: Any, k: Any, v: Any) -> Any:
        return K.mosaic_attention_forward(q, k, v, causal=causal, softmax_scale=scale)

    def backward(q: Any, k: Any, v: Any, out: Any, lse: Any, d_out: Any, d_lse: Any) -> Any:
        return KB.mosaic_attention_backward(q, k, v, out, lse, d_out, d_lse, causal=causal, softmax_scale=scale,
                                            config=config)

    trained = (differentiable(forward, backward) if own
               else with_cudnn_backward(forward, causal=causal, softmax_scale=scale))
    return lambda q, k, v: trained(q, k, v)[0]


def _grad_of(fn: Callable[..., Any]) -> Callable[..., Any]:
    def loss(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(fn(q, k, v).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def ab(rounds: int, only: set[int] | None, seqs: set[int] | None) -> None:
    """The default forward, each ``--config`` (SWEEP's), cuDNN and tokamax timed in turn,
    ``rounds`` times over, in one process: medians and minima of 20-call means. Where the
    default cuts a short last round (``Config.split_tail``), "no merge" is its kernel without
    the merge after it (its tail tiles wrong): what the merge costs."""
    tk = import_tokamax()
    print(f"\nbfloat16, ms per call, {rounds} rounds in turn: median (min); ratio: the default's median over it")
    for b, s, hq, hkv, d in SHAPES:
        if (only and d not in only) or (seqs and s not in seqs):
            continue
        for causal in (False, True):
            ks = jax.random.split(jax.random.PRNGKey(0), 3)
            q = jax.random.normal(ks[0], (b, s, hq, d), jnp.bfloat16)
            k, v = (jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16) for kk in ks[1:])
            fns = _fwd_fns(causal, 1.0 / math.sqrt(d), tk, True, d)
            merge = K.merge_pieces
            setattr(K, "merge_pieces", lambda out, lse, *_, **__: (out, lse))  # noqa: B010 (a module loaded by path)
            try:
                fns["mosaic(no merge)"] = jax.jit(fns["mosaic"]).lower(q, k, v).compile()
            finally:
                setattr(K, "merge_pieces", merge)  # noqa: B010
            times: dict[str, list[float]] = {key: [] for key in fns}
            for _ in range(rounds):
                for key, fn in fns.items():
                    times[key].append(timeit(fn, (q, k, v), reps=1))
            mid = {key: float(np.median(t)) for key, t in times.items()}
            print(f"{b}, {s}, {hq}/{hkv}, {d} {'causal' if causal else 'full'}:")
            for key, t in times.items():
                print(f"   {key:70s} {mid[key]:.4f} ({min(t):.4f})  {mid['mosaic'] / mid[key]:.3f}")


def bench(quick: bool, dtype: Any, sweep: bool, bwd: bool, only: set[int] | None = None,
          bwd_sweep: bool = False, seqs: set[int] | None = None) -> None:
    tk = import_tokamax()
    name = jnp.dtype(dtype).name
    print(f"\n{name}, BTHD, ms per call (TFLOP/s; causal counts half the FLOPs)")
    head = "| B, S, Hq/Hkv, D | mask | mosaic fwd | cuDNN fwd | tokamax fwd | mosaic/cuDNN | mosaic/tokamax |"
    if bwd:
        head += (" mosaic fwd+bwd | own fwd+bwd | cuDNN fwd+bwd | tokamax fwd+bwd | fwd+bwd cuDNN/mosaic |"
                 " cuDNN/own |")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for b, s, hq, hkv, d in SHAPES[:2] if quick else SHAPES:
        if (only and d not in only) or (seqs and s not in seqs):
            continue
        for causal in (False, True):
            ks = jax.random.split(jax.random.PRNGKey(0), 3)
            q = jax.random.normal(ks[0], (b, s, hq, d), dtype)
            k = jax.random.normal(ks[1], (b, s, hkv, d), dtype)
            v = jax.random.normal(ks[2], (b, s, hkv, d), dtype)
            flops = 4.0 * b * hq * s * s * d * (0.5 if causal else 1.0)
            fns = _fwd_fns(causal, 1.0 / math.sqrt(d), tk, sweep, d)
            if bwd:
                fns["mosaic_bwd"] = _grad_of(_mosaic_trained(causal, 1.0 / math.sqrt(d), own=False))
                fns["own_bwd"] = _grad_of(_mosaic_trained(causal, 1.0 / math.sqrt(d), own=True))
                for tiles in BWD_SWEEP if bwd_sweep else ():
                    fns[f"own{tiles}"] = _grad_of(_mosaic_trained(causal, 1.0 / math.sqrt(d), True, bwd_config(tiles)))
                fns["cudnn_bwd"] = _grad_of(fns["cudnn"])
                if "tokamax" in fns:
                    fns["tokamax_bwd"] = _grad_of(fns["tokamax"])
            ms: dict[str, float] = {}
            for key, fn in fns.items():
                try:
                    ms[key] = timeit(fn, (q, k, v))
                except Exception as e:
                    print(f"   {key} failed: {type(e).__name__} {str(e)[:300]}")
                    ms[key] = float("nan")
            nan = float("nan")

            def cell(key: str, mult: float = 1.0, ms: dict[str, float] = ms, flops: float = flops) -> str:
                t = ms.get(key, float("nan"))
                return f"{t:.3f} ({mult * flops / t / 1e9:.0f})"

            for key in ms:
                if key.startswith("tokamax("):
                    print(f"   ablation {key}: {ms[key]:.3f} ms, tokamax's default/it {ms['tokamax'] / ms[key]:.3f}")
                if key.startswith("mosaic("):
                    print(f"   ablation {key} (Config fields in order): {ms[key]:.3f} ms, "
                          f"cuDNN/it {ms['cudnn'] / ms[key]:.3f}")
                if key.startswith("own("):
                    print(f"   ablation {key} (dQ, dK/dV: block_q, block_kv, stages): fwd+bwd {ms[key]:.3f} ms, "
                          f"cuDNN/it {ms['cudnn_bwd'] / ms[key]:.3f}")
            row = (f"| {b}, {s}, {hq}/{hkv}, {d} | {'causal' if causal else 'full'} | {cell('mosaic')} | "
                   f"{cell('cudnn')} | {cell('tokamax')} | {ms['cudnn'] / ms['mosaic']:.3f} | "
                   f"{ms.get('tokamax', nan) / ms['mosaic']:.3f} |")
            if bwd:
                row += (f" {cell('mosaic_bwd', 3.5)} | {cell('own_bwd', 3.5)} | {cell('cudnn_bwd', 3.5)} | "
                        f"{cell('tokamax_bwd', 3.5)} | {ms['cudnn_bwd'] / ms['mosaic_bwd']:.3f} | "
                        f"{ms['cudnn_bwd'] / ms['own_bwd']:.3f} |")
            print(row, flush=True)


#: --resources: forward configurations compiled with ptxas's report (name, Config fields).
RESOURCE_CONFIGS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("64x128 (default below 16k keys)", (64, 128, 2, True)),
    ("64x192 (default, full, >= 16k keys)", (64, 192, 2, True)),
    ("64x128, 3 stages", (64, 128, 3, True)),
    ("64x128, ping-pong off", (64, 128, 2, False)),
    ("64x128, overlap", (64, 128, 2, True, True)),
    ("64x128, exp2 of 64 columns on the FMA units", (64, 128, 2, True, False, 64)),
)


def resources(dump: pathlib.Path, configs: tuple[tuple[int, ...], ...] = ()) -> None:
    """Compile each of RESOURCE_CONFIGS (or the default and ``configs``; full and causal) and the
    causal backward at B1 S4k H32/8 D128 with Mosaic GPU's dumps into ``dump``, and print
    ptxas's report of each kernel:
    registers, spills, and its notes (such as a ``warpgroup.arrive`` it had to inject, which
    makes a wgmma wait for registers in use). ``MOSAIC_GPU_DUMP_TO`` turns on every dump (the
    MLIR passes run to a gigabyte); only the ``.ptxas`` files are kept. The SASS dump needs
    ``nvdisasm``, which the GPU machine lacks."""
    import os

    dump.mkdir(parents=True, exist_ok=True)
    os.environ["MOSAIC_GPU_DUMP_TO"] = str(dump)
    q, k, v, _, _ = _inputs(1, 4096, 4096, 32, 8, 128, jnp.bfloat16)
    jobs: list[tuple[str, Callable[[], Any]]] = [
        (f"{name}, {'causal' if causal else 'full'}", functools.partial(
            jax.jit(functools.partial(K.mosaic_attention_forward, causal=causal, softmax_scale=0.088,
                                      config=K.Config(*cfg))), q, k, v))
        for name, cfg in (RESOURCE_CONFIGS[:1] + tuple((str(c), c) for c in configs) if configs
                          else RESOURCE_CONFIGS)
        for causal in (False, True)]
    out, lse = jax.block_until_ready(K.mosaic_attention_forward(q, k, v, causal=True, softmax_scale=0.088))
    for f in dump.iterdir():  # that forward feeds the backward's job: its report is the causal default's
        f.unlink()
    jobs.append(("backward, causal (kernels in the order traced: dQ, then dK/dV)", functools.partial(
        jax.jit(functools.partial(KB.mosaic_attention_backward, causal=True, softmax_scale=0.088)),
        q, k, v, out, lse, q, lse)))
    print("\nresources: B1 S4096 H32/8 D128 bf16; ptxas's report per kernel")
    for name, run in jobs:
        try:
            jax.block_until_ready(run())
        except Exception as e:
            print(f"   {name}: {type(e).__name__} {str(e)[:300]}")
            continue
        print(f"== {name}")
        for f in sorted(dump.iterdir()):
            if f.suffix != ".ptxas":
                f.unlink()
            elif not f.name.startswith("seen-"):
                for line in f.read_text(errors="replace").splitlines():
                    if "ptxas" in line or "spill" in line:
                        print(f"   {line.strip()[:200]}")
                f.rename(f.with_name("seen-" + f.name))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS",
                    help="time the default, each --config, cuDNN and tokamax in turn, ROUNDS times (medians)")
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--bwd-check", action="store_true", help="check the backward kernel against jax's gradient")
    ap.add_argument("--bwd-sweep", action="store_true", help="with --bwd: time BWD_SWEEP's backward tiles too")
    ap.add_argument("--resources", type=pathlib.Path, default=None, metavar="DIR",
                    help="compile the forward configurations and the backward with Mosaic GPU's dumps into DIR "
                         "and print ptxas's report (registers, spills, injected waits)")
    ap.add_argument("--head-dims", default="", help="only these head dims, e.g. 64,256")
    ap.add_argument("--seqs", default="", help="only these sequence lengths, e.g. 4096,16384")
    ap.add_argument("--shape", action="append", default=[], metavar="B,S,HQ,HKV,D",
                    help="time these shapes (T = S) instead of SHAPES (repeatable)")
    ap.add_argument("--config", action="append", default=[],
                    help="BQ,BKV,STAGES,PINGPONG(0/1)[,OVERLAP(0/1)[,EXP2_FMA_COLS[,LEAN_BARRIERS(0/1)"
                         "[,PASS_TURNS(0/1)[,NAMED_BARRIERS(0/1)[,STORE_READ_WAIT(0/1)[,PERSISTENT(0/1)[,CTAS"
                         "[,Q_GROUP[,Q_DOUBLE(0/1)[,SPLIT_TAIL(0/1)[,SCHEDULED(0/1)]]]]]]]]]]]] "
                         "(kernel.Config's fields in order) "
                         "timed with --sweep instead of SWEEP, and checked "
                         "at head dim 128 with --check (repeatable)")
    a = ap.parse_args()
    mine = tuple(tuple(int(x) for x in c.split(",")) for c in a.config)
    if a.shape:
        SHAPES[:] = [(b, s, hq, hkv, d) for b, s, hq, hkv, d in (map(int, c.split(",")) for c in a.shape)]
    if mine:
        for d in SWEEP:
            SWEEP[d] = mine
    print(jax.__version__, jax.devices(), flush=True)
    if a.resources:
        resources(a.resources, mine)
    bad = check(a.quick, mine) if a.check else 0
    bad += bwd_check(a.quick, tuple(BWD_SWEEP) if a.bwd_sweep else ()) if a.bwd_check else 0
    only = {int(d) for d in a.head_dims.split(",") if d}
    seqs = {int(x) for x in a.seqs.split(",") if x}
    if a.ab:
        ab(a.ab, only, seqs)
    if a.bench:
        bench(a.quick, jnp.bfloat16, a.sweep, a.bwd, only, a.bwd_sweep, seqs)
        if a.fp16:
            bench(a.quick, jnp.float16, a.sweep, a.bwd, only, a.bwd_sweep, seqs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
