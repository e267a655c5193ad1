"""Compile the quantized paged decode kernel for sm_90 on a host without a GPU and count its
SASS instructions by opcode: what a widening path costs, before any GPU time is spent.

The switches of ``launch_paged`` (``JAXATTN_TRITON_PV_F16``, ``JAXATTN_TRITON_K_WIDEN``,
``JAXATTN_TRITON_V_WORDS``) apply as when a launch is built. Counts are static (each of the
kernel's three key sweeps is one copy); the triton release matters (the GPU machine runs 3.6).

    python3 benchmarks/paged_sass.py float8_e4m3fn head
    JAXATTN_TRITON_PV_F16=0 python3 benchmarks/paged_sass.py float8_e4m3fn head --seqs 64
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton
from triton_compile_check import compile_sm90

from jaxattn_triton import launch_paged as LP

OPCODES = ("F2FP", "F2F", "HMUL2", "HADD2", "PRMT", "LOP3", "SHF", "IMAD", "HMMA", "LDS", "LDSM", "LDGSTS")
CACHE_TYPES = {"int8": "*i8", "float8_e4m3fn": "*fp8e4nv", "float8_e5m2": "*fp8e5"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fmt", choices=sorted(CACHE_TYPES))
    ap.add_argument("granularity", choices=("tensor", "head", "token"))
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    a = ap.parse_args()
    page, hkv = 16, 8
    pool = a.seqs * a.context // page
    lead = (pool, page, hkv)
    shape = {"head": (hkv,), "token": lead, "tensor": ()}[a.granularity]
    spec = LP.PagedSpec(
        num_tokens=a.seqs, max_seqs=a.seqs, q_len=1, heads_q=32, heads_kv=hkv, head_dim=128, head_dim_v=128,
        dtype="bfloat16", num_pages=pool, page_size=page, pages_per_seq=a.context // page,
        softmax_scale=128**-0.5, cache_dtype=a.fmt, k_scale=LP.scale_strides(shape, lead),
        v_scale=LP.scale_strides(shape, lead),
    )  # fmt: skip
    tiles = LP.default_tiles(spec)
    lz = LP.attention(spec, tiles)
    cache = CACHE_TYPES[a.fmt]
    outs = ["*fp32"] * 3 if tiles.num_splits > 1 else ["*bf16", "*fp32", "*fp32"]
    types = ["*bf16", cache, cache, "*i32", "*i32", "*i32", "*i32", "*fp32", "*fp32", "*fp32", *outs]
    compiled, usage, sass = compile_sm90(lz, types)
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    ops = [re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0] for line in lines]
    count = Counter(ops)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    c = lz.constexprs
    print(f"triton {triton.__version__}, {a.fmt} per {a.granularity}, {a.seqs} x {a.context}: PV_F16={c['PV_F16']} "
          f"K_WIDEN={c['K_WIDEN']} V_WORDS={c['V_WORDS']}; block_n={tiles.block_n} warps={tiles.num_warps} "
          f"stages={tiles.num_stages} splits={tiles.num_splits} kv_heads={tiles.kv_heads}")
    print(f"registers {regs.group(1) if regs else '?'}, stack {regs.group(2) if regs else '?'}, "
          f"shared {compiled.metadata.shared} B, {len(ops)} instructions")
    print("  " + ", ".join(f"{op} {count[op]}" for op in OPCODES))


if __name__ == "__main__":
    main()
