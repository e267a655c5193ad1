"""Ring attention on 1, 2 and 4 devices against the best single-device backend and all-gathered K/V.

The measurements of the issue "Context parallelism measured on 2 and 4 GPUs". On a machine with
4 GPUs and the jaxattn wheels installed (CONTRIBUTING.md, "Working on a GPU"):

    python3 benchmarks/ring_bench.py --devices 1,2,4 --seqs 32768,65536,131072,262144 \\
        --modes causal,full --passes fwd,fwdbwd --json ring_bench.json

For every sequence length S, mode (causal, load-balanced by ring's zigzag layout; or full) and
pass (``fwd``: the forward; ``fwdbwd``: forward and backward of ``sum(out * dout)``), with B=1,
``--heads`` query heads, ``--kv-heads`` K/V heads, head dim ``--dim``, bf16, it times:

* ``1dev:<baseline>``: the best single-device backend on the whole problem (``--baseline``,
  cuDNN on a GPU): the bar the issue's targets are set against (same total work);
* ``ring<n>:<block>``: ring over ``n`` devices (sequence sharded over the mesh axis "seq"), for
  each per-block kernel of ``--block-kernels`` ("auto" is ring's own choice; name others, such
  as ``flash_attn2`` and ``cudnn+blockwise``, to choose between them by measurement);
  ``ring<n>z:<block>`` with ``--ring-inputs natural,zigzag``: the same ring taking and returning
  the zigzag order (``ring_inputs="zigzag"``, as a training input pipeline that orders its tokens
  once arranges), which skips ring's relayout of q, k, v and the output;
  ``ring<n>ag:<block>`` (``ring<n>zag`` in zigzag order) with ``--ring-comms ppermute,all_gather``:
  the same blocks with K/V all-gathered in one collective and dK/dV reduce-scattered
  (``ring_comm="all_gather"``) instead of passed around the ring; ``ring<n>auto:<block>`` with
  ``auto`` in ``--ring-comms``: ring's own choice between the two (the default of the API);
* ``gather<n>:<gather-impl>``: plain ``shard_map`` of a backend (``--gather-impl``, default the
  baseline) with K/V all-gathered: device ``i`` keeps its ``S/n`` queries and attends to the
  whole gathered K/V (causal: bottom-right aligned to ``kv_lengths = (i+1) S/n``, so positions
  are global; contiguous shards, so the last device does the most work: what one gets without
  a ring). jaxattn's cuDNN path spells causal with ``kv_lengths`` as a ``(S/n) x S`` mask
  (jax.nn's causal is top-left, and no flag shifts it per device), so at long S the causal
  gather rows may run out of memory and say so; full attention needs no lengths.

It prints one table per (mode, pass): ms per step, TFLOP/s (whole problem), and the speed-up of
each row over ``1dev:<baseline>`` and of ring over ``gather<n>`` at the same n. Before timing,
``--check-seq`` checks every ring configuration against the baseline on one device (output and
the three gradients). Everything runs within ``--budget-s`` seconds; a row that runs out of memory
or past ``--max-step-s`` stops growing S for that row.

The same script runs on the CPU host mesh with tiny shapes (tests/sharding/multidevice/
check_benchmarks.py does), e.g.::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python3 benchmarks/ring_bench.py \\
        --devices 1,2,4 --seqs 64,128 --heads 2 --kv-heads 2 --dim 8 --dtype float32 --reps 1
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# Long sequences are the point: let XLA use (nearly) all GPU memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn.sharding.compat import shard_map
from jaxattn_bench.timing import seconds_per_call


def log(*args: Any) -> None:
    print(*args, flush=True)


@dataclasses.dataclass
class Record:
    config: str  # "1dev:cudnn", "ring2:auto", "gather4:cudnn"
    kind: str  # "single", "ring", "gather"
    devices: int
    block_impl: str | None  # ring's per-block kernel as chosen (None for the others)
    seq: int
    mode: str  # "causal" or "full"
    passes: str  # "fwd" or "fwdbwd"
    status: str  # "ok", "oom", "slow" (over --max-step-s), "error", "skipped"
    ms: float | None = None
    tflops: float | None = None
    detail: str = ""


def flops(seq: int, heads: int, dim: int, causal: bool, passes: str) -> float:
    """4 * B * H * T * S * D for the forward (halved for causal); forward + backward = 3.5 x forward."""
    fwd = 4.0 * heads * seq * seq * dim * (0.5 if causal else 1.0)
    return fwd * (3.5 if passes == "fwdbwd" else 1.0)


def gathered(baseline: str, mesh: Mesh, causal: bool) -> Callable[..., Any]:
    """Plain ``shard_map`` of ``baseline``: local queries, K/V all-gathered over "seq"."""

    def local(q: Any, k: Any, v: Any) -> Any:
        k, v = (jax.lax.all_gather(x, "seq", axis=1, tiled=True) for x in (k, v))
        extra: dict[str, Any] = {}
        if causal:  # bottom-right causal aligned to the keys up to this shard's last query
            t_local = q.shape[1]
            end = (jax.lax.axis_index("seq") + 1) * t_local
            extra["kv_lengths"] = jnp.full((q.shape[0],), end, jnp.int32)
        return jaxattn.attention(q, k, v, impl=baseline, causal=causal, **extra)

    spec = P(None, "seq")
    return shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)


def ring_metadata(mesh: Mesh | None, block: str, order: str, comm: str = "ppermute") -> jaxattn.AttentionMetadata:
    return jaxattn.AttentionMetadata(mesh=mesh, sequence_axis="seq",
                                     extra={"ring_block_impl": block, "ring_inputs": order, "ring_comm": comm})


def attention_fn(kind: str, impl: str, mesh: Mesh | None, causal: bool, block: str,
                 order: str = "natural", comm: str = "ppermute") -> Callable[..., Any]:
    if kind == "single":
        return functools.partial(jaxattn.attention, impl=impl, causal=causal)
    assert mesh is not None
    if kind == "gather":
        return gathered(impl, mesh, causal)
    return functools.partial(jaxattn.attention, impl="ring", causal=causal,
                             metadata=ring_metadata(mesh, block, order, comm))


def in_natural_order(attend: Callable[..., Any], seq: int, n: int) -> Callable[..., Any]:
    """``attend`` of a ring that takes and returns the zigzag order (``ring_inputs="zigzag"``), called
    on natural-order arrays (for the check: a training input pipeline orders its tokens once)."""
    from jaxattn_ring import zigzag_permutation

    perm = zigzag_permutation(seq, n)
    inverse = np.argsort(perm)
    return lambda q, k, v: jnp.take(attend(*(jnp.take(x, perm, axis=1) for x in (q, k, v))), inverse, axis=1)


def make_step(attend: Callable[..., Any], passes: str) -> Callable[..., Any]:
    """A jitted forward (returns the output) or training step (the loss and dq, dk, dv)."""
    if passes == "fwd":
        return jax.jit(lambda q, k, v, dout: attend(q, k, v))

    def loss(q: Any, k: Any, v: Any, dout: Any) -> Any:
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def inputs(seq: int, args: argparse.Namespace, sharding: Any, seed: int = 0) -> tuple[Any, ...]:
    keys = jax.random.split(jax.random.key(seed), 4)
    heads = (args.heads, args.kv_heads, args.kv_heads, args.heads)
    arrays = [jax.random.normal(key, (1, seq, h, args.dim), jnp.dtype(args.dtype))
              for key, h in zip(keys, heads, strict=True)]
    return tuple(jax.device_put(a, sharding) for a in arrays)


def is_oom(err: BaseException) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def relative_errors(got: Any, want: Any) -> dict[str, float]:
    """Max |got - want| / max |want| per output leaf (output, or loss and dq, dk, dv)."""
    names = ["out"] if not isinstance(want, tuple) else ["loss", "dq", "dk", "dv"]
    leaves_got, leaves_want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    errs = {}
    for name, a, b in zip(names, leaves_got, leaves_want, strict=True):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs[name] = float(np.abs(a64 - b64).max() / max(1e-6, float(np.abs(b64).max())))
    return errs


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    kind: str
    impl: str
    devices: int
    block: str  # requested per-block kernel (ring only)
    mesh: Mesh | None
    sharding: Any
    order: str = "natural"  # ring only: the order its inputs arrive in (ring_inputs)
    comm: str = "ppermute"  # ring only: how K/V travel (ring_comm)


def configs(args: argparse.Namespace) -> list[Config]:
    devices = jax.devices()
    one = SingleDeviceSharding(devices[0])
    out = [Config(f"1dev:{args.baseline}", "single", args.baseline, 1, "", None, one)]
    for n in args.devices:
        if n > len(devices):
            log(f"ring_bench: {n} devices asked, {len(devices)} here: the rows on {n} are skipped")
            continue
        mesh = Mesh(np.array(devices[:n]), ("seq",))
        sharded = NamedSharding(mesh, P(None, "seq"))
        out += [Config(f"ring{n}{'z' if order == 'zigzag' else ''}{COMM_TAGS[comm]}:{block}",
                       "ring", "ring", n, block, mesh, sharded, order, comm)
                for block in args.block_kernels for order in args.ring_inputs for comm in args.ring_comms]
        if n > 1 and args.gather:
            out.append(Config(f"gather{n}:{args.gather_impl}", "gather", args.gather_impl, n, "", mesh, sharded))
    return out


def block_name(cfg: Config, seq: int, args: argparse.Namespace, causal: bool) -> str | None:
    """The per-block kernel ring runs for this configuration (raises with every reason if none)."""
    if cfg.kind != "ring":
        return None
    md = ring_metadata(cfg.mesh, cfg.block, cfg.order, cfg.comm)
    q = jax.ShapeDtypeStruct((1, seq, args.heads, args.dim), jnp.dtype(args.dtype))
    kv = jax.ShapeDtypeStruct((1, seq, args.kv_heads, args.dim), jnp.dtype(args.dtype))
    return str(jaxattn.get_impl("ring", md).block_kernel(q, kv, kv, causal=causal).name())


def check(cfgs: list[Config], args: argparse.Namespace) -> dict[str, Any]:
    """Every ring and gather configuration against the baseline on one device, at ``--check-seq``."""
    report: dict[str, Any] = {}
    one = cfgs[0]
    for mode in args.modes:
        causal = mode == "causal"
        for passes in args.passes:
            data = inputs(args.check_seq, args, one.sharding, seed=1)
            want = make_step(attention_fn("single", one.impl, None, causal, ""), passes)(*data)
            for cfg in cfgs[1:]:
                key = f"{cfg.name}/{mode}/{passes}"
                try:
                    attend = attention_fn(cfg.kind, cfg.impl, cfg.mesh, causal, cfg.block, cfg.order, cfg.comm)
                    if cfg.order == "zigzag":
                        attend = in_natural_order(attend, args.check_seq, cfg.devices)
                    step = make_step(attend, passes)
                    got = step(*(jax.device_put(x, cfg.sharding) for x in data))
                    report[key] = relative_errors(got, want)
                except Exception as err:  # report and go on
                    report[key] = {"error": (str(err).splitlines() or [type(err).__name__])[0][:300]}
                log(f"  check {key:<40} vs {one.name}: {report[key]}")
    return report


def sweep(cfg: Config, mode: str, passes: str, args: argparse.Namespace, deadline: float) -> list[Record]:
    causal = mode == "causal"
    records: list[Record] = []
    stop = ""
    try:
        block = block_name(cfg, min(args.seqs), args, causal)
        step = make_step(attention_fn(cfg.kind, cfg.impl, cfg.mesh, causal, cfg.block, cfg.order, cfg.comm), passes)
    except Exception as err:  # no kernel for this configuration: every length says why
        block, step = None, None
        stop = (str(err).splitlines() or [type(err).__name__])[0][:300]
    for seq in args.seqs:
        rec = Record(cfg.name, cfg.kind, cfg.devices, block, seq, mode, passes, "ok")
        if stop or step is None or time.monotonic() > deadline:
            rec.status, rec.detail = "skipped", stop or "time budget spent"
            records.append(rec)
            continue
        data: tuple[Any, ...] | None = None
        try:
            data = inputs(seq, args, cfg.sharding)
            seconds = seconds_per_call(step, data, args.reps)
            rec.ms = 1e3 * seconds
            rec.tflops = flops(seq, args.heads, args.dim, causal, passes) / seconds / 1e12
            if seconds > args.max_step_s:
                rec.status, stop = "slow", f"a step at S={seq} took {seconds:.1f} s"
        except Exception as err:  # an OOM or a kernel failure ends this row, not the run
            rec.status = "oom" if is_oom(err) else "error"
            rec.detail = stop = (str(err).splitlines() or [type(err).__name__])[0][:300]
            if rec.status == "error":
                traceback.print_exc()
        finally:
            del data
        records.append(rec)
        shown = f"{rec.ms:10.2f} ms {rec.tflops:8.3f} TFLOP/s" if rec.ms is not None else rec.detail
        log(f"  {cfg.name:<24} {mode:<6} {passes:<6} S={seq:>8} {rec.status:<5} {shown}")
    return records


def table(records: list[Record], args: argparse.Namespace) -> str:
    """Per (mode, pass): a row per configuration, a column per S: ms, and x over the 1-device baseline."""
    lines = []
    base_name = f"1dev:{args.baseline}"
    for mode in args.modes:
        for passes in args.passes:
            rows = [r for r in records if r.mode == mode and r.passes == passes]
            ms = {(r.config, r.seq): r.ms for r in rows}
            lines.append(f"\n{mode}, {passes} (B=1 H={args.heads} Hkv={args.kv_heads} D={args.dim} {args.dtype}): "
                         f"ms per step [x speed-up over {base_name}; ring also / gather at the same n]")
            lines.append(f"{'config':<26}{'block':<28}" + "".join(f"{'S=' + str(s):>30}" for s in args.seqs))
            for name in dict.fromkeys(r.config for r in rows):
                first = next(r for r in rows if r.config == name)
                cells = []
                for seq in args.seqs:
                    t = ms.get((name, seq))
                    if t is None:
                        status = next((r.status for r in rows if r.config == name and r.seq == seq), "-")
                        cells.append(f"{status:>30}")
                        continue
                    base = ms.get((base_name, seq))
                    cell = f"{t:.2f}" + (f" [{base / t:.2f}x" if base else " [?") + "]"
                    gather = ms.get((f"gather{first.devices}:{args.gather_impl}", seq))
                    if first.kind == "ring" and gather:
                        cell += f" [{gather / t:.2f}x gather]"
                    cells.append(f"{cell:>30}")
                lines.append(f"{name:<26}{(first.block_impl or '-'):<28}" + "".join(cells))
    return "\n".join(lines)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


#: The row tag of each ``--ring-comms`` value (ppermute, ring's transfers, has none: the rows before).
COMM_TAGS = {"ppermute": "", "all_gather": "ag", "auto": "auto"}


def parse_names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=parse_ints, default=[1, 2, 4], help="ring sizes (default 1,2,4)")
    parser.add_argument("--seqs", type=parse_ints, default=[32768, 65536, 131072, 262144])
    parser.add_argument("--modes", type=parse_names, default=["causal", "full"])
    parser.add_argument("--passes", type=parse_names, default=["fwd", "fwdbwd"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--baseline", default=None,
                        help="the single-device backend (default: cudnn on a GPU, blockwise elsewhere)")
    parser.add_argument("--block-kernels", type=parse_names, default=["auto"],
                        help="ring's per-block kernels to measure, e.g. auto,flash_attn2,cudnn+blockwise")
    parser.add_argument("--ring-inputs", type=parse_names, default=["natural"],
                        help="the orders ring's inputs arrive in: natural (ring relayouts them), zigzag "
                             "(ring_inputs='zigzag', rows 'ring<n>z': an input pipeline that orders tokens once)")
    parser.add_argument("--ring-comms", type=parse_names, default=["ppermute"],
                        help="how ring's K/V travel: ppermute (around the ring), all_gather (ring_comm='all_gather', "
                             "rows 'ring<n>ag'), auto (ring's own choice, rows 'ring<n>auto')")
    parser.add_argument("--no-gather", dest="gather", action="store_false", help="skip the all-gather rows")
    parser.add_argument("--gather-impl", default=None, help="the backend of the all-gather rows (default: --baseline)")
    parser.add_argument("--reps", type=int, default=3, help="timed samples of back-to-back calls (median)")
    parser.add_argument("--max-step-s", type=float, default=8.0, help="stop growing S for a row past this")
    parser.add_argument("--budget-s", type=float, default=540.0, help="start nothing new after this")
    parser.add_argument("--check-seq", type=int, default=8192)
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--json", help="write every record here")
    args = parser.parse_args(argv)
    unknown = [c for c in args.ring_comms if c not in COMM_TAGS]
    if unknown:
        parser.error(f"--ring-comms: {', '.join(unknown)} not among {', '.join(COMM_TAGS)}")
    if args.baseline is None:
        args.baseline = "cudnn" if jax.devices()[0].platform == "gpu" else "blockwise"
    args.gather_impl = args.gather_impl or args.baseline
    for mode in args.modes:
        if mode not in ("causal", "full"):
            parser.error(f"--modes: {mode!r} is not causal or full")
    for passes in args.passes:
        if passes not in ("fwd", "fwdbwd"):
            parser.error(f"--passes: {passes!r} is not fwd or fwdbwd")
    deadline = time.monotonic() + args.budget_s
    devices = jax.devices()
    log(f"jax {jax.__version__}; {len(devices)} devices: {sorted({d.device_kind for d in devices})}")
    cfgs = configs(args)
    out: dict[str, Any] = {"devices": [d.device_kind for d in devices], "jax": jax.__version__,
                           "args": dict(vars(args)), "records": []}
    if args.check:
        out["check"] = check(cfgs, args)
    records: list[Record] = []
    for mode in args.modes:
        for passes in args.passes:
            for cfg in cfgs:
                records += sweep(cfg, mode, passes, args, deadline)
            jax.clear_caches()
    out["records"] = [dataclasses.asdict(r) for r in records]
    log(table(records, args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
        log(f"wrote {args.json}")
    failed = [r for r in records if r.status == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
