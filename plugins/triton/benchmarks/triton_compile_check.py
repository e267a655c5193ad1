"""Compile the Triton attention kernels for sm_90 on a host without a GPU; report resources.

For each configuration: registers, spill stack, shared memory, and the matrix and atomic
instructions in the SASS (``HGMMA`` is Hopper's wgmma; ``HMMA`` the older mma.sync).
Spills (``stack`` > 0) or shared memory over 232448 bytes rule a configuration out
before any GPU time is spent. Use the triton release the GPU machine runs (3.6.0 there;
e.g. ``pip install --target /tmp/t36 --no-deps triton==3.6.0`` and
``PYTHONPATH=/tmp/t36``): register allocation differs between releases.

    python3 plugins/triton/benchmarks/triton_compile_check.py            # the tuning candidates
    python3 plugins/triton/benchmarks/triton_compile_check.py --d 256    # one head dim
    python3 plugins/triton/benchmarks/triton_compile_check.py --mod      # with a mask_mod's bits and tile lists
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "plugins" / "triton" / "src"))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from jaxattn_triton import tuning
from jaxattn_triton.flash import launch as L
from jaxattn_triton.spec import AttnSpec

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SMEM_LIMIT = 232448


def _pointer_types(kind: str, dtype: str) -> list[str]:
    dt = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}[dtype]
    # ... a mask_mod's bits, seen keys and tile lists (int32), masks.alibi's slopes, then the outputs.
    if kind == "fwd":
        return [dt, dt, dt, "*i8", "*fp32", "*i32", "*i32", "*fp32", "*i32", "*i32", "*i32", "*fp32", dt, "*fp32"]
    ins = [dt, dt, dt, "*i8", "*fp32", "*i32", "*i32", dt, "*fp32", "*fp32", "*i32", "*i32", "*i32", "*fp32"]
    # dQ: the lse cotangent's term too; it writes dq and the slopes' gradient.
    return ins + ([dt, dt, "*fp32", "*fp32"] if kind == "dkdv" else ["*fp32", dt, "*fp32"])


#: Triton's pointer type of each dtype name a launch's outputs use.
POINTERS = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "int32": "*i32"}


def output_types(lz: Any) -> list[str]:
    """The pointer types of a launch's outputs, in order."""
    return [POINTERS[dtype] for _, dtype in lz.outputs]


def compile_sm90(lz: Any, pointer_types: list[str]) -> tuple[Any, str, str]:
    """Compile one launch for sm_90 as jax_triton does (16-byte aligned pointers, typed in the
    order of its non-constexpr arguments); return the compiled kernel, cuobjdump's resource
    usage and its SASS. Any launch with ``kernel``, ``constexprs``, ``num_warps`` and
    ``num_stages`` (the paged kernels' too)."""
    fn = lz.kernel
    types = iter(pointer_types)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in lz.constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = next(types)
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=dict(lz.constexprs), attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": lz.num_warps, "num_stages": lz.num_stages}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", f.name], capture_output=True, text=True).stdout
    return compiled, usage, sass


def resources(lz: L.Launch, kind: str, dtype: str) -> dict[str, object]:
    """Compile one launch for sm_90 (as jax_triton does: 16-byte aligned pointers)."""
    compiled, usage, sass = compile_sm90(lz, _pointer_types(kind, dtype))
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    smem = compiled.metadata.shared
    return {
        "reg": int(m.group(1)) if m else None,
        "stack": int(m.group(2)) if m else None,
        "smem": smem,
        "fits": smem <= SMEM_LIMIT,
        "hgmma": sass.count("HGMMA"),
        "hmma": sass.count(" HMMA"),
        "red": len(re.findall(r"\bREDG?\.", sass)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, action="append", help="head dims (default 64, 128, 256)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--mod", action="store_true", help="a mask_mod's kernels (bits of every batch and head)")
    a = ap.parse_args()
    print(f"triton {triton.__version__}", flush=True)
    for d in a.d or (64, 128, 256):
        spec = AttnSpec(
            batch=4, seq_q=4096, seq_k=4096, heads_q=32, heads_kv=32, head_dim=d, head_dim_v=d,
            dtype="bfloat16", softmax_scale=d**-0.5, causal=a.causal and not a.mod,
            mod_shape=(4, 32) if a.mod else None,
        )  # fmt: skip
        for name, cands in tuning.candidates(spec).items():
            for t in cands:
                if name == "fwd":
                    launches = [("fwd", L.forward(spec, t))]
                elif name == "dq":
                    launches = [("dq", L.dq(spec, t))]
                elif name == "dkdv":
                    launches = [("dkdv", L.dkdv(spec, t))]
                elif name == "dkdv_atomic":
                    launches = [("dkdv", L.dkdv(spec, t, L.DQ_ATOMIC))]
                else:
                    launches = [("dkdv", L.dkdv(spec, t, part=p)) for p in (L.PART_DV, L.PART_DK)]
                for kind, lz in launches:
                    try:
                        info: object = resources(lz, kind, spec.dtype)
                    except Exception as err:  # a configuration that does not compile is data
                        info = f"error: {repr(err)[-200:]}"
                    part = lz.constexprs.get("PART", "")
                    print(f"D={d} {name:11s} {tuple(vars(t).values())} {part} {info}", flush=True)


if __name__ == "__main__":
    main()
