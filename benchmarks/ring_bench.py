"""Ring attention on 1 and 2 GPUs: the longest sequence that fits and the time per training step.

Run on a machine with two GPUs and the jaxattn wheels installed (see CONTRIBUTING.md, "Working on a GPU"):

    python3 benchmarks/ring_bench.py --json ring_bench.json

For each configuration it finds the longest sequence that fits, doubling from
``--seq-start`` and compiling only (XLA's memory analysis of the training step against
the GPU's memory limit, so that lengths whose step would take minutes are still probed),
then times one training step of attention (forward + backward of ``sum(out * dout)``,
bf16, B=1) per length until a step exceeds ``--max-step-s``:

* ``1gpu:<kernel>``: the per-block kernel ring uses, called directly on one GPU (no ring);
* ``1gpu:cudnn``: cuDNN through jax.nn on one GPU, for reference (its lse is not
  differentiable, so ring does not use it per block);
* ``ring2:<kernel>``: ring over both GPUs (sequence sharded over the mesh axis "seq"),
  zigzag layout for causal attention.

Before timing, ``--check`` compares ring on 2 GPUs with the kernel on one GPU (output and
the three gradients) at ``--check-seq``, and the one-GPU kernel with a float32 reference.
Everything runs within ``--budget-s`` seconds so the command fits a 10-minute slot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# The longest sequence that fits is the point: let XLA use (nearly) all GPU memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn_ring import RingAttention


def log(*args: Any) -> None:
    print(*args, flush=True)


@dataclasses.dataclass
class Record:
    config: str
    gpus: int
    impl: str
    block_impl: str | None
    seq: int
    causal: bool
    status: str  # "ok", "oom", "slow" (over --max-step-s), "error"
    ms_per_step: float | None = None
    tflops: float | None = None
    detail: str = ""


def step_flops(seq: int, heads: int, dim: int, causal: bool) -> float:
    # 4 * B * H * T * S * D forward (halved for causal), forward + backward = 3.5 x forward.
    fwd = 4.0 * heads * seq * seq * dim * (0.5 if causal else 1.0)
    return 3.5 * fwd


def make_step(impl: str, md: jaxattn.AttentionMetadata, causal: bool) -> Callable[..., Any]:
    """One jitted training step of attention: returns the output and the gradients of q, k, v."""

    def loss(q: Any, k: Any, v: Any, dout: Any) -> Any:
        out = jaxattn.attention(q, k, v, impl=impl, causal=causal, metadata=md)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def inputs(seq: int, heads: int, kv_heads: int, dim: int, sharding: Any, seed: int = 0) -> tuple[Any, ...]:
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(1, seq, heads, dim), (1, seq, kv_heads, dim), (1, seq, kv_heads, dim), (1, seq, heads, dim)]
    arrays = [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes, strict=True)]
    return tuple(jax.device_put(a, sharding) for a in arrays)


def is_oom(err: BaseException) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def time_step(step: Callable[..., Any], args: tuple[Any, ...], reps: int) -> list[float]:
    jax.block_until_ready(step(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return times


def abstract_inputs(seq: int, args: argparse.Namespace, sharding: Any) -> tuple[Any, ...]:
    shapes = [(1, seq, args.heads, args.dim), (1, seq, args.kv_heads, args.dim), (1, seq, args.kv_heads, args.dim),
              (1, seq, args.heads, args.dim)]
    return tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes)


def peak_bytes(step: Callable[..., Any], seq: int, args: argparse.Namespace, sharding: Any) -> int:
    """Per-device bytes of the compiled step (arguments + outputs + temporaries), from XLA."""
    stats = step.lower(*abstract_inputs(seq, args, sharding)).compile().memory_analysis()  # type: ignore[attr-defined]
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
               - stats.alias_size_in_bytes)


def longest_fitting(config: str, step: Callable[..., Any], sharding: Any, limit: int | None,
                    args: argparse.Namespace, deadline: float) -> tuple[int | None, list[dict[str, Any]]]:
    """Double T (compiling only) until the step's memory passes ``limit``; the last T under it."""
    if limit is None:
        log(f"  {config}: the device reports no memory limit; lengths are probed by running only")
        return None, []
    probes: list[dict[str, Any]] = []
    best = None
    seq = args.seq_start
    while seq <= args.seq_max and time.monotonic() < deadline:
        try:
            need = peak_bytes(step, seq, args, sharding)
        except Exception as err:  # a compile-time OOM ends the probe
            probes.append({"seq": seq, "error": str(err).splitlines()[0][:200] if str(err) else type(err).__name__})
            break
        probes.append({"seq": seq, "bytes_per_device": need})
        log(f"  {config:<22} T={seq:>8} needs {need / 2**30:7.2f} GiB per device (limit {limit / 2**30:.1f})")
        if need > limit:
            break
        best = seq
        seq *= 2
    return best, probes


def sweep(config: str, impl: str, md: jaxattn.AttentionMetadata, sharding: Any, gpus: int, block: str | None,
          args: argparse.Namespace, deadline: float, upto: int | None) -> list[Record]:
    records: list[Record] = []
    seq = args.seq_start
    step = make_step(impl, md, args.causal)
    while seq <= min(args.seq_max, upto or args.seq_max):
        if time.monotonic() > deadline:
            log(f"  {config}: time budget spent, stopping before T={seq}")
            break
        rec = Record(config, gpus, impl, block, seq, args.causal, "ok")
        data: tuple[Any, ...] | None = None
        try:
            data = inputs(seq, args.heads, args.kv_heads, args.dim, sharding)
            times = time_step(step, data, args.reps)
            med = statistics.median(times)
            rec.ms_per_step = 1e3 * med
            rec.tflops = step_flops(seq, args.heads, args.dim, args.causal) / med / 1e12
            if med > args.max_step_s:
                rec.status = "slow"
        except Exception as err:  # an OOM or a kernel failure ends this sweep, not the run
            rec.status = "oom" if is_oom(err) else "error"
            rec.detail = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
            if rec.status == "error":
                traceback.print_exc()
        finally:
            del data  # release the inputs before the next (larger) length
        records.append(rec)
        shown = f"{rec.ms_per_step:9.1f} ms/step {rec.tflops:7.1f} TFLOP/s" if rec.ms_per_step else rec.detail
        log(f"  {config:<22} T={seq:>8} {rec.status:<5} {shown}")
        if rec.status != "ok":
            break
        seq *= 2
    return records


def check(block: str, md_ring: jaxattn.AttentionMetadata, sharding_ring: Any,
          args: argparse.Namespace) -> dict[str, Any]:
    """ring on 2 GPUs vs the kernel on 1 GPU (same bf16 inputs), and the kernel vs float32 XLA."""
    seq = args.check_seq
    one = SingleDeviceSharding(jax.devices()[0])
    data = inputs(seq, args.heads, args.kv_heads, args.dim, one, seed=1)
    single = make_step(block, jaxattn.AttentionMetadata(), args.causal)(*data)
    ringed = make_step("ring", md_ring, args.causal)(*(jax.device_put(x, sharding_ring) for x in data))

    def as_f32(q: Any, k: Any, v: Any, dout: Any) -> Any:
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        out = jaxattn.attention(q, k, v, impl="vanilla", causal=args.causal)
        return jnp.sum(out * dout.astype(jnp.float32))

    reference = jax.jit(jax.value_and_grad(as_f32, argnums=(0, 1, 2)))(*data) if seq <= 8192 else None
    report: dict[str, Any] = {"seq": seq, "block_impl": block}
    names = ("dq", "dk", "dv")
    for label, other in (("ring2_vs_1gpu", single), ("1gpu_vs_f32", reference)):
        if other is None:
            continue
        base = ringed if label.startswith("ring") else single
        errs = {}
        for name, a, b in zip(names, base[1], other[1], strict=True):
            a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
            errs[name] = float(np.abs(a64 - b64).max() / max(1e-6, np.abs(b64).max()))
        errs["loss"] = float(abs(float(base[0]) - float(other[0])) / max(1e-6, abs(float(other[0]))))
        report[label] = errs
        log(f"  check {label}: relative max errors {errs}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--full", dest="causal", action="store_false", help="full attention (default: causal)")
    parser.add_argument("--seq-start", type=int, default=8192)
    parser.add_argument("--seq-max", type=int, default=1 << 21)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-step-s", type=float, default=8.0, help="stop doubling past this step time")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting new lengths after this")
    parser.add_argument("--block-impl", default="auto", help="ring's per-block kernel (default: auto)")
    parser.add_argument("--check-seq", type=int, default=8192)
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--no-cudnn", dest="cudnn", action="store_false")
    parser.add_argument("--json", help="write every record here")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget_s

    devices = jax.devices()
    log(f"jax {jax.__version__}; devices: {[d.device_kind for d in devices]}")
    if len(devices) < 2:
        log("ring_bench: needs 2 devices for the ring rows; only the 1-GPU rows will run")
    n = min(2, len(devices))
    mesh = Mesh(np.array(devices[:n]), ("seq",))
    md_ring = jaxattn.AttentionMetadata(mesh=mesh, sequence_axis="seq", extra={"ring_block_impl": args.block_impl})
    seq_sharded = NamedSharding(mesh, P(None, "seq"))
    probe = jax.ShapeDtypeStruct((1, args.seq_start, args.heads, args.dim), jnp.bfloat16)
    probe_kv = jax.ShapeDtypeStruct((1, args.seq_start, args.kv_heads, args.dim), jnp.bfloat16)
    ring_impl = jaxattn.get_impl("ring", md_ring)
    assert isinstance(ring_impl, RingAttention), "jaxattn-ring is not installed"
    block = ring_impl.block_kernel(probe, probe_kv, probe_kv, causal=args.causal).name()
    log(f"ring per-block kernel: {block} (ring on {n} GPU{'s' if n > 1 else ''})")

    out: dict[str, Any] = {"devices": [d.device_kind for d in devices], "jax": jax.__version__, "args": vars(args),
                           "block_impl": block, "records": []}
    if args.check and n == 2:
        try:
            out["check"] = check(block, md_ring, seq_sharded, args)
        except Exception as err:  # report and go on to the timings
            traceback.print_exc()
            out["check"] = {"error": str(err)[:500]}

    one = SingleDeviceSharding(jax.devices()[0])
    configs: list[tuple[str, str, jaxattn.AttentionMetadata, Any, int]] = [
        (f"1gpu:{block}", block, jaxattn.AttentionMetadata(), one, 1)]
    if n == 2:
        configs.append((f"ring2:{block}", "ring", md_ring, seq_sharded, 2))
    if args.cudnn and devices[0].platform == "gpu":
        configs.append(("1gpu:cudnn", "cudnn", jaxattn.AttentionMetadata(), one, 1))
    limit = (devices[0].memory_stats() or {}).get("bytes_limit") if devices[0].platform == "gpu" else None
    records: list[Record] = []
    fits: dict[str, Any] = {}
    for config, impl, md, sharding, gpus in configs:
        log(f"{config}: B=1 H={args.heads} Hkv={args.kv_heads} D={args.dim} bf16 "
            f"{'causal' if args.causal else 'full'}, fwd+bwd per step")
        step = make_step(impl, md, args.causal)
        best, probes = longest_fitting(config, step, sharding, limit, args, deadline)
        fits[config] = {"longest_fitting_seq": best, "probes": probes}
        records += sweep(config, impl, md, sharding, gpus, block if impl == "ring" else None, args, deadline, best)
        jax.clear_caches()

    out["fits"] = fits
    out["records"] = [dataclasses.asdict(r) for r in records]
    log("\nsummary: longest sequence that fits (memory), longest timed, and its time per step")
    for config, *_ in configs:
        timed = [r for r in records if r.config == config and r.ms_per_step is not None]
        fit = fits[config]["longest_fitting_seq"]
        line = f"  {config:<22} fits T={fit if fit else '?':>8}"
        if timed:
            last = timed[-1]
            line += f"  timed T={last.seq:>8} {last.ms_per_step:9.1f} ms/step {last.tflops:7.1f} TFLOP/s"
        log(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
