"""GPU check of the Triton flash attention: correctness, cuDNN comparison, tile sweep.

Run on a CUDA machine with jax-triton importable and ``plugins/triton/src`` on the path:

    python3 plugins/triton/benchmarks/triton_gpu_check.py [--check] [--bench] [--sweep] [--tune] \
        [--bench-d256] [--json OUT.json]

``--check`` compares forward and gradients with a float32 JAX reference on the same
inputs; ``--bench`` times forward and forward+backward against cuDNN
(``jax.nn.dot_product_attention(implementation="cudnn")``) side by side in this process
(bf16, B*S = 16k tokens, H = 32, D = 128, S in {4k, 8k}, causal and full); ``--sweep``
times each kernel's tile candidates (``tuning.candidates``) on the S = 4k shapes.
``--tune`` first tunes D = 128/256/64 at S = 4k (atomic-dQ and split dK/dV included)
into the tuning cache, so that ``--bench`` and ``--bench-d256`` time the winners;
``--check-dq-mode N`` runs ``--check`` with the backward ``launch.DQ_*`` = N.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "plugins" / "triton" / "src"))

import jax
import jax.numpy as jnp
import numpy as np
import triton_measure as bu  # beside this script

from jaxattn_triton import tuning
from jaxattn_triton.flash import launch as L
from jaxattn_triton.flash.ops import flash_attention, make_spec
from jaxattn_triton.spec import AttnSpec

RESULTS: dict[str, Any] = {}


def log(*args: Any) -> None:
    print(*args, flush=True)


def reference(
    q,
    k,
    v,
    *,
    causal=False,
    sliding_window=None,
    logits_soft_cap=None,
    mask=None,
    bias=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_aux=None,
):  # type: ignore[no-untyped-def]
    """Float32 attention with docs/contract.md's semantics (materialised logits)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    k = jnp.repeat(k, hq // hkv, 2)
    v = jnp.repeat(v, hq // hkv, 2)
    x = jnp.einsum("bthd,bshd->bhts", q, k) * d**-0.5
    if logits_soft_cap:
        x = logits_soft_cap * jnp.tanh(x / logits_soft_cap)
    if bias is not None:
        x = x + bias.astype(jnp.float32)
    i = jnp.arange(t)[:, None] + s - t
    j = jnp.arange(s)[None, :]
    keep = jnp.ones((t, s), bool)
    left, right = (None, None) if sliding_window is None else sliding_window
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        keep &= j >= i - left
    if right is not None:
        keep &= j <= i + right
    keep = jnp.broadcast_to(keep, (b, hq, t, s))
    if mask is not None:
        keep &= mask
    if q_segment_ids is not None:
        keep &= q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
    x = jnp.where(keep, x, -jnp.inf)
    m = jnp.max(x, -1, keepdims=True)
    if softmax_aux is not None:
        m = jnp.maximum(m, softmax_aux[None, :, None, None])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(x - m)
    den = jnp.sum(p, -1, keepdims=True)
    if softmax_aux is not None:
        den = den + jnp.exp(softmax_aux[None, :, None, None] - m)
    p = p / jnp.where(den == 0, 1.0, den)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def rel(a: jax.Array, b: jax.Array) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# --check-dq-mode: run --check with this backward (launch.DQ_*) instead of the tuned one.
CHECK_DQ_MODE: int | None = None


def check() -> None:
    rng = np.random.default_rng(0)
    cases: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("mha d128 full", {"B": 2, "T": 256, "S": 256, "H": 4, "G": 1, "D": 128}, {}),
        ("mha d128 causal", {"B": 2, "T": 256, "S": 256, "H": 4, "G": 1, "D": 128}, {"causal": True}),
        ("gqa4 cross tails causal", {"B": 2, "T": 200, "S": 333, "H": 8, "G": 4, "D": 128}, {"causal": True}),
        ("d64 causal", {"B": 2, "T": 384, "S": 384, "H": 4, "G": 1, "D": 64}, {"causal": True}),
        ("d256 full", {"B": 1, "T": 256, "S": 256, "H": 4, "G": 2, "D": 256}, {}),
        ("d96 padded", {"B": 1, "T": 160, "S": 224, "H": 4, "G": 1, "D": 96}, {"causal": True}),
        ("window", {"B": 1, "T": 512, "S": 512, "H": 4, "G": 2, "D": 128}, {"sliding_window": (64, 16)}),
        (
            "softcap+sinks",
            {"B": 1, "T": 256, "S": 256, "H": 4, "G": 1, "D": 128},
            {"causal": True, "logits_soft_cap": 5.0, "softmax_aux": True},
        ),
        ("segments", {"B": 2, "T": 256, "S": 256, "H": 4, "G": 1, "D": 128}, {"segments": True}),
        ("mask+bias", {"B": 2, "T": 128, "S": 192, "H": 4, "G": 2, "D": 64}, {"mask": True, "bias": True}),
        ("T>S causal (empty rows)", {"B": 1, "T": 192, "S": 64, "H": 2, "G": 1, "D": 64}, {"causal": True}),
        (
            "fp16 gqa causal",
            {"B": 2, "T": 256, "S": 256, "H": 8, "G": 2, "D": 128, "dtype": "float16"},
            {"causal": True},
        ),
    ]
    rows = []
    for name, shp, feats in cases:
        try:
            dt = jnp.dtype(shp.get("dtype", "bfloat16"))
            b, t, s, h, g, d = (shp[x] for x in ("B", "T", "S", "H", "G", "D"))
            q = jnp.asarray(rng.standard_normal((b, t, h, d)), dt)
            k = jnp.asarray(rng.standard_normal((b, s, h // g, d)), dt)
            v = jnp.asarray(rng.standard_normal((b, s, h // g, d)), dt)
            kw: dict[str, Any] = {x: feats[x] for x in ("causal", "sliding_window", "logits_soft_cap") if x in feats}
            if feats.get("softmax_aux"):
                kw["softmax_aux"] = jnp.asarray(rng.standard_normal(h), jnp.float32)
            if feats.get("segments"):
                qs = np.sort(rng.integers(0, 3, (b, t)), axis=1)
                kw["q_segment_ids"] = jnp.asarray(qs, jnp.int32)
                kw["kv_segment_ids"] = jnp.asarray(qs, jnp.int32)
            if feats.get("mask"):
                kw["mask"] = jnp.asarray(rng.random((b, 1, t, s)) > 0.3)
            if feats.get("bias"):
                kw["bias"] = jnp.asarray(rng.standard_normal((1, h, t, s)), jnp.float32)
            do = jnp.asarray(rng.standard_normal((b, t, h, d)), dt)
            argnums = (0, 1, 2, 3) if "bias" in kw else (0, 1, 2)

            tiles = None
            if CHECK_DQ_MODE is not None:
                spec = make_spec(
                    q, k, v, mask=kw.get("mask"), bias=kw.get("bias"), causal=kw.get("causal", False),
                    sliding_window=kw.get("sliding_window"), segments="q_segment_ids" in kw,
                    logits_soft_cap=kw.get("logits_soft_cap"), sinks="softmax_aux" in kw,
                )  # fmt: skip
                tiles = dataclasses.replace(tuning.tiles_for(spec), dq_mode=CHECK_DQ_MODE)

            def ours(q, k, v, bias=None, kw=kw, tiles=tiles):  # type: ignore[no-untyped-def]
                kw2 = dict(kw, bias=bias) if bias is not None else kw
                return flash_attention(q, k, v, tiles=tiles, **kw2)[0]

            def ref(q, k, v, bias=None, kw=kw):  # type: ignore[no-untyped-def]
                kw2 = dict(kw, bias=bias) if bias is not None else kw
                return reference(q, k, v, **kw2)

            args = (q, k, v, kw.get("bias")) if "bias" in kw else (q, k, v)
            o, vjp = jax.vjp(jax.jit(ours), *args)
            grads = vjp(do)
            args32 = tuple(x.astype(jnp.float32) for x in args)
            ro, rvjp = jax.vjp(ref, *args32)
            rgrads = rvjp(do.astype(jnp.float32))
            nan = bool(np.isnan(np.asarray(o, np.float32)).any()) or any(
                bool(np.isnan(np.asarray(x, np.float32)).any()) for x in grads
            )
            errs = [rel(o, ro)] + [rel(a, r) for a, r in zip(grads, rgrads, strict=False)]
            ok = not nan and max(errs) < 2e-2
            rows.append({"case": name, "dq_mode": CHECK_DQ_MODE, "errors": errs, "nan": nan, "ok": ok})
            log(
                f"check {name:28s} {'OK ' if ok else 'BAD'} nan={nan} rel(out,dq,dk,dv[,db])="
                + " ".join(f"{e:.2e}" for e in errs)
            )
            del argnums
        except Exception as err:
            rows.append({"case": name, "error": repr(err)})
            log(f"check {name}: ERROR {err!r}")
            traceback.print_exc()
    RESULTS["check"] = rows


def bench() -> None:
    rows = []
    for s in (4096, 8192):
        b = 16384 // s
        for causal in (False, True):
            key = jax.random.split(jax.random.PRNGKey(s + causal), 3)
            q, k, v = (jax.random.normal(kk, (b, s, 32, 128), jnp.bfloat16) for kk in key)
            fl_f = bu.attention_flops(b, 32, s, s, 128, causal=causal, backward=False)
            fl_b = bu.attention_flops(b, 32, s, s, 128, causal=causal, backward=True)
            impls = {
                "cudnn": lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                    q, k, v, is_causal=c, implementation="cudnn"
                ),
                "triton": lambda q, k, v, c=causal: flash_attention(q, k, v, causal=c)[0],
            }
            res: dict[str, Any] = {"S": s, "B": b, "causal": causal}
            for name, fn in impls.items():
                try:
                    t0 = time.perf_counter()
                    tf, tb = bu.time_attention(fn, q, k, v)
                    res[name] = {
                        "fwd_ms": tf * 1e3,
                        "fwdbwd_ms": tb * 1e3,
                        "fwd_tflops": fl_f / tf / 1e12,
                        "fwdbwd_tflops": fl_b / tb / 1e12,
                        "wall_s": time.perf_counter() - t0,
                    }
                except Exception as err:
                    res[name] = {"error": repr(err)}
                    traceback.print_exc()
            rows.append(res)
            log(json.dumps(res))
    RESULTS["bench"] = rows
    log("\n  S  causal | cuDNN fwd  ours fwd  ratio | cuDNN f+b  ours f+b  ratio   (TFLOP/s)")
    for r in rows:
        c, o = r.get("cudnn", {}), r.get("triton", {})
        if "fwd_tflops" in c and "fwd_tflops" in o:
            log(
                f"{r['S']:5d} {r['causal']!s:6} | {c['fwd_tflops']:8.1f} {o['fwd_tflops']:8.1f} "
                f"{o['fwd_tflops'] / c['fwd_tflops']:6.2f} | {c['fwdbwd_tflops']:8.1f} "
                f"{o['fwdbwd_tflops']:8.1f} "
                f"{o['fwdbwd_tflops'] / c['fwdbwd_tflops']:6.2f}"
            )


# Matrix products of T x S x D per kernel, for a rate comparable between kernels.
GEMMS = {"fwd": 2, "dkdv": 4, "dq": 3}
# Forward tiles beyond tuning.candidates, timed by --sweep-fwd.
EXTRA_FWD = [(256, 64, 8, 3), (256, 64, 8, 4), (256, 32, 8, 3), (256, 64, 16, 3), (256, 128, 16, 2), (128, 128, 8, 3)]


def _record(rows: list[dict[str, Any]], spec: AttnSpec, name: str, tile: L.KernelTiles, sec: float) -> None:
    fl = bu.attention_flops(
        spec.batch, spec.heads_q, spec.seq_q, spec.seq_k, spec.head_dim, causal=spec.causal, backward=False
    )
    rows.append(
        {
            "causal": spec.causal,
            "kernel": name,
            "tiles": [tile.block_m, tile.block_n, tile.num_warps, tile.num_stages],
            "ms": sec * 1e3,
            "tflops": fl / 2 * GEMMS[name] / sec / 1e12,
        }
    )


def _specs(seq: int) -> list[AttnSpec]:
    shape = jax.ShapeDtypeStruct((16384 // seq, seq, 32, 128), jnp.bfloat16)
    return [make_spec(shape, shape, shape, causal=c) for c in (False, True)]


def sweep(seq: int = 4096) -> None:
    """Run the tuner on the S = 4k shapes: every candidate's time is logged, the winner cached."""
    rows: list[dict[str, Any]] = []
    for spec in _specs(seq):

        def measure(t: L.Tiles, name: str, spec: AttnSpec = spec) -> float:
            sec = bu.measure_kernels(spec, t, (name,))[name]
            _record(rows, spec, name, getattr(t, name), sec)
            return sec

        best = tuning.tune(spec, measure, log=lambda m, c=spec.causal: log(f"tune causal={c} {m}"))
        log(f"tuned causal={spec.causal}: {best}")
    RESULTS["sweep"] = rows


def sweep_fwd(seq: int = 4096) -> None:
    """Time EXTRA_FWD forward tiles (no caching)."""
    rows: list[dict[str, Any]] = []
    for spec in _specs(seq):
        base = tuning.tiles_for(spec)
        for cand in EXTRA_FWD:
            tile = L.KernelTiles(*cand)
            try:
                sec = bu.measure_kernels(spec, L.Tiles(tile, base.dkdv, base.dq), ("fwd",))["fwd"]
            except Exception as err:  # report and go on: one bad config is data
                log(f"fwd causal={spec.causal} {cand}: ERROR {repr(err)[:200]}")
                continue
            _record(rows, spec, "fwd", tile, sec)
            log(f"fwd causal={spec.causal} {cand}: {sec * 1e3:.3f} ms {rows[-1]['tflops']:.0f} TFLOP/s")
    RESULTS["sweep_fwd"] = rows


TUNE_DEADLINE_S = 250.0  # --tune stops timing candidates after this many seconds
TUNE_SHAPES = ((4, 4096, 32, 128), (4, 4096, 16, 256), (4, 4096, 32, 64))  # B, S, H, D


def _prepared_measure(spec: AttnSpec, rows: list[dict[str, Any]], t0: float) -> Any:
    """A ``tuning.tune`` measure whose inputs (and backward residuals) are made once.

    Each atomic-dQ candidate's dQ is also compared with the two-kernel backward's on the
    same inputs (relative error), which catches a race at full size.
    """
    from jaxattn_triton.flash.ops import _execute

    q, k, v = bu.random_inputs(spec)
    dummies = (
        jnp.zeros((1,), jnp.int8),
        jnp.zeros((1,), jnp.float32),
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((1,), jnp.int32),
    )
    sinks = jnp.zeros((1,), jnp.float32)
    # A mask_mod's bits, seen keys, tile lists and masks.alibi's slopes: none.
    no_mod = (*(jnp.zeros((1,), jnp.int32),) * 3, jnp.zeros((1,), jnp.float32))
    base = tuning.default_tiles(spec, "9.0")
    out, lse = jax.jit(lambda *a: _execute(L.forward(spec, base.fwd), a, False))(q, k, v, *dummies, sinks, *no_mod)
    dout = jax.random.normal(jax.random.PRNGKey(1), out.shape, out.dtype)
    delta, lse_b, _, _ = jax.jit(lambda *a: _execute(L.preprocess(spec), a, False))(
        out, dout, lse, jnp.zeros_like(lse), sinks
    )
    common = (q, k, v, *dummies, dout, lse_b, delta, *no_mod)
    ref: dict[str, Any] = {}

    def measure(t: L.Tiles, name: str) -> float:
        if time.perf_counter() - t0 > TUNE_DEADLINE_S:
            raise RuntimeError("skipped: --tune time budget spent")
        err = None
        if name == "fwd":
            fn = jax.jit(lambda *a: _execute(L.forward(spec, t.fwd), a, False)[0])
            sec = bu.time_jax(fn, q, k, v, *dummies, sinks, *no_mod, reps=10)
        elif name == "dkdv":
            fn = jax.jit(lambda *a: _execute(L.dkdv(spec, t.dkdv), a, False)[:2])
            sec = bu.time_jax(fn, *common, reps=10)
            if "dkdv" not in ref:
                ref["dkdv"] = [np.asarray(x, np.float32) for x in fn(*common)]
        elif name == "dq":
            fn = jax.jit(lambda *a: _execute(L.dq(spec, t.dq), [*a, no_mod[-1]], False)[0])  # no alibi
            sec = bu.time_jax(fn, *common, reps=10)
            if "dq" not in ref:
                ref["dq"] = np.asarray(fn(*common), np.float32)
        elif name == "dkdv_split":

            def split(*a: jax.Array) -> list[jax.Array]:
                dv = _execute(L.dkdv(spec, t.dkdv, part=L.PART_DV), a, False)[1]
                dk = _execute(L.dkdv(spec, t.dkdv, part=L.PART_DK), a, False)[0]
                return [dk, dv]

            fn = jax.jit(split)
            sec = bu.time_jax(fn, *common, reps=10)
            if "dkdv" in ref:
                dk, dv = fn(*common)
                err = max(rel(dk, ref["dkdv"][0]), rel(dv, ref["dkdv"][1]))
        else:

            def atomic(*a: jax.Array) -> jax.Array:
                _, _, _, acc = _execute(L.dkdv(spec, t.dkdv, L.DQ_ATOMIC), a, False)
                return (acc * spec.softmax_scale).astype(q.dtype)

            fn = jax.jit(atomic)
            sec = bu.time_jax(fn, *common, reps=10)
            if "dq" in ref:
                err = rel(fn(*common), ref["dq"])
        tile = t.dkdv if name.startswith("dkdv") else getattr(t, name)
        fl = bu.attention_flops(
            spec.batch, spec.heads_q, spec.seq_q, spec.seq_k, spec.head_dim, causal=spec.causal, backward=False
        )
        gemms = {"fwd": 2, "dkdv": 4, "dq": 3, "dkdv_atomic": 5, "dkdv_split": 5}[name]
        rows.append(
            {
                "D": spec.head_dim, "S": spec.seq_k, "causal": spec.causal, "kernel": name,
                "dq_mode": t.dq_mode, "tiles": list(dataclasses.astuple(tile)), "ms": sec * 1e3,
                "tflops_gemm": fl / 2 * gemms / sec / 1e12, "rel_err_vs_kernel": err,
            }
        )  # fmt: skip
        log(
            f"  D={spec.head_dim} causal={spec.causal} {name:11s} {tuple(dataclasses.astuple(tile))} "
            f"mode={t.dq_mode}: {sec * 1e3:.3f} ms" + (f" rel err vs kernel {err:.2e}" if err is not None else "")
        )
        return sec

    return measure


def _tiles_json(t: L.Tiles) -> dict[str, Any]:
    return {
        "fwd": list(dataclasses.astuple(t.fwd)),
        "dkdv": list(dataclasses.astuple(t.dkdv)),
        "dq": list(dataclasses.astuple(t.dq)),
        "dq_mode": t.dq_mode,
        "dkdv_split": t.dkdv_split,
    }


def tune_all() -> None:
    """Tune TUNE_SHAPES (D = 128, 256, 64; --tune-dims picks) at S = 4k, full and causal.

    Winners (the atomic-dQ and split dK/dV backwards included) go to the tuning cache,
    and the D = 128 winners are stored for S = 8k too, so --bench runs what was chosen.
    Each atomic or split candidate's dQ or dK/dV is compared with the plain kernels'.
    """
    rows: list[dict[str, Any]] = []
    chosen = {}
    t0 = time.perf_counter()
    kind = str(jax.devices()[0].device_kind)
    for b, s, h, d in TUNE_SHAPES:
        for causal in (False, True):
            shape = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
            spec = make_spec(shape, shape, shape, causal=causal)
            measure = _prepared_measure(spec, rows, t0)
            best = tuning.tune(spec, measure, log=lambda m: None)
            log(f"tuned D={d} causal={causal}: {best}")
            chosen[f"d{d}-causal{causal}"] = _tiles_json(best)
            if d == 128:
                shape8 = jax.ShapeDtypeStruct((b // 2, 2 * s, h, d), jnp.bfloat16)
                tuning.store(kind, make_spec(shape8, shape8, shape8, causal=causal), best)
            log(f"[tune D={d} causal={causal} done at {time.perf_counter() - t0:.0f}s]")
            RESULTS["tune"] = {"rows": rows, "chosen": chosen}


def bench_d256() -> None:
    """D = 256 (B=4, S=4k, H=16) forward and forward+backward against cuDNN."""
    rows = []
    key = jax.random.split(jax.random.PRNGKey(11), 3)
    q, k, v = (jax.random.normal(kk, (4, 4096, 16, 256), jnp.bfloat16) for kk in key)
    for c in (False, True):
        fl = bu.attention_flops(4, 16, 4096, 4096, 256, causal=c, backward=False)
        impls = {
            "cudnn": lambda q, k, v, c=c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="cudnn"),
            "triton": lambda q, k, v, c=c: flash_attention(q, k, v, causal=c)[0],
        }
        rows.append(_time_row(f"D=256 H=16 S=4k causal={c}", impls, q, k, v, fl))
    RESULTS["bench_d256"] = rows


def memory(seq: int = 32768) -> None:
    """Compiled temporary memory of forward+backward at S = 32k: O(S), no S x S buffer."""
    shape = jax.ShapeDtypeStruct((1, seq, 32, 128), jnp.bfloat16)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(flash_attention(q, k, v, causal=True)[0].astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    stats = compiled.memory_analysis()
    temp = int(getattr(stats, "temp_size_in_bytes", -1))
    one_sxs = seq * seq * 2
    RESULTS["memory"] = {"S": seq, "temp_bytes": temp, "one_SxS_bf16_bytes": one_sxs}
    log(
        f"memory S={seq}: compiled temp {temp / 2**20:.1f} MiB; one S x S bf16 buffer would be "
        f"{one_sxs / 2**20:.0f} MiB"
    )


def _time_row(
    label: str, impls: dict[str, Any], q: jax.Array, k: jax.Array, v: jax.Array, flops_fwd: float
) -> dict[str, Any]:
    row: dict[str, Any] = {"case": label}
    for name, fn in impls.items():
        try:
            tf, tb = bu.time_attention(fn, q, k, v)
            row[name] = {
                "fwd_ms": tf * 1e3,
                "fwdbwd_ms": tb * 1e3,
                "fwd_tflops": flops_fwd / tf / 1e12,
                "fwdbwd_tflops": 3.5 * flops_fwd / tb / 1e12,
            }
        except Exception as err:  # an impl that cannot take the shape is reported, not fatal
            row[name] = {"error": repr(err)[:200]}
    parts = [
        f"{n}: " + (f"{r['fwd_tflops']:.0f}/{r['fwdbwd_tflops']:.0f}" if "fwd_tflops" in r else "n/a")
        for n, r in row.items()
        if n != "case"
    ]
    log(f"{label:34s} fwd/fwd+bwd TFLOP/s  " + "  ".join(parts))
    return row


def extra() -> None:
    """Head dims 64/256, GQA 4:1, JAX's Pallas-Triton mha, and a sliding window's saving."""
    rows = []
    key = jax.random.PRNGKey(7)

    def qkv(b: int, s: int, hq: int, hkv: int, d: int) -> tuple[jax.Array, ...]:
        kq, kk, kv = jax.random.split(key, 3)
        return (
            jax.random.normal(kq, (b, s, hq, d), jnp.bfloat16),
            jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16),
            jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16),
        )

    def cudnn(c: bool) -> Any:
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="cudnn")

    def ours(c: bool, **kw: Any) -> Any:
        return lambda q, k, v: flash_attention(q, k, v, causal=c, **kw)[0]

    for d, h in ((64, 32), (256, 16)):
        for c in (False, True):
            q, k, v = qkv(4, 4096, h, h, d)
            fl = bu.attention_flops(4, h, 4096, 4096, d, causal=c, backward=False)
            rows.append(_time_row(f"D={d} H={h} S=4k causal={c}", {"cudnn": cudnn(c), "triton": ours(c)}, q, k, v, fl))
    q, k, v = qkv(4, 4096, 32, 8, 128)
    fl = bu.attention_flops(4, 32, 4096, 4096, 128, causal=True, backward=False)
    rows.append(_time_row("GQA 32:8 D=128 S=4k causal", {"cudnn": cudnn(True), "triton": ours(True)}, q, k, v, fl))
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

        for c in (False, True):
            q, k, v = qkv(4, 4096, 32, 32, 128)
            fl = bu.attention_flops(4, 32, 4096, 4096, 128, causal=c, backward=False)

            def mha(q: jax.Array, k: jax.Array, v: jax.Array, c: bool = c) -> jax.Array:
                return pallas_gpu.mha(q, k, v, segment_ids=None, causal=c, sm_scale=128**-0.5)

            rows.append(
                _time_row(f"vs Pallas mha S=4k causal={c}", {"pallas_mha": mha, "triton": ours(c)}, q, k, v, fl)
            )
    except ImportError as err:
        log(f"pallas mha unavailable: {err}")
    q, k, v = qkv(2, 8192, 32, 32, 128)
    for left in (None, 1024, 256):
        kw = {} if left is None else {"sliding_window": (left, 0)}
        frac = make_spec(q, k, v, causal=True, sliding_window=kw.get("sliding_window")).band_fraction()
        fl = bu.attention_flops(2, 32, 8192, 8192, 128, causal=False, backward=False) * frac
        rows.append(_time_row(f"S=8k causal window left={left}", {"triton": ours(True, **kw)}, q, k, v, fl))
    RESULTS["extra"] = rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-fwd", action="store_true")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--extra", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--bench-d256", action="store_true")
    ap.add_argument("--check-dq-mode", type=int, default=None)
    ap.add_argument("--tune-dims", default="128,256", help="head dims --tune tunes")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    global CHECK_DQ_MODE, TUNE_SHAPES
    CHECK_DQ_MODE = a.check_dq_mode
    dims = {int(x) for x in a.tune_dims.split(",")}
    TUNE_SHAPES = tuple(sh for sh in TUNE_SHAPES if sh[3] in dims)
    log("devices:", jax.devices())
    t0 = time.perf_counter()
    steps = (
        ("tune", tune_all),
        ("check", check),
        ("sweep", sweep),
        ("sweep_fwd", sweep_fwd),
        ("bench", bench),
        ("bench_d256", bench_d256),
        ("memory", memory),
        ("extra", extra),
    )
    for flag, fn in steps:
        if getattr(a, flag):
            fn()
            log(f"[{flag} done at {time.perf_counter() - t0:.0f}s]")
            if a.json:
                Path(a.json).write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
