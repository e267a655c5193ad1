"""Compile the quantized paged decode kernel for sm_90 on a host without a GPU and count its
SASS instructions by opcode: what a widening path costs, before any GPU time is spent.

The kernel is built as ``launch_paged`` builds it for the format and scales. Counts are static
(each of the kernel's three key sweeps is one copy); the triton release matters (the GPU
machine runs 3.6).

    python3 plugins/triton/benchmarks/paged_sass.py float8_e4m3fn head
    python3 plugins/triton/benchmarks/paged_sass.py int8 head --driver   # on a GPU: the driver's count too
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "plugins" / "triton" / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton
from triton_compile_check import compile_sm90, output_types

from jaxattn_triton.paged import launch as LP

OPCODES = ("F2FP", "F2F", "HMUL2", "HADD2", "PRMT", "LOP3", "SHF", "IMAD", "HMMA", "LDS", "LDSM", "LDGSTS")
SMS = 132  # an H100 SXM's SMs
SMEM_PER_SM = 228 * 1024
CACHE_TYPES = {"int8": "*i8", "float8_e4m3fn": "*fp8e4nv", "float8_e5m2": "*fp8e5"}


def programs_per_sm(regs: int, warps: int, shared: int) -> int:
    """Resident programs per sm_90 SM. The register file is allotted per quarter: each of the
    4 schedulers holds 16K registers, a warp takes a thread's count rounded up to 8, times 32
    (as CUDA's occupancy calculator counts): 2-warp programs fit 6 a SM at 168 registers a
    thread, 4 at 169-255. Shared memory: 228 KiB less 1 KiB reserved per block."""
    per_warp = -(-regs // 8) * 8 * 32
    by_regs = (16384 // per_warp) * 4 // warps
    by_smem = SMEM_PER_SM // (shared + 1024) if shared else by_regs
    return max(0, min(by_regs, by_smem, 64 // warps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fmt", choices=sorted(CACHE_TYPES))
    ap.add_argument("granularity", choices=("tensor", "head", "token"))
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--driver", action="store_true",
                    help="on a machine with a GPU, also ask the CUDA driver how many programs fit a SM")
    ap.add_argument("--tiles", default="", metavar="BN,W,ST,SPLITS,KVH",
                    help="these tiles instead of the default (an empty field keeps the default's)")
    a = ap.parse_args()
    page, hkv = a.page_size, 8
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
    if a.tiles:
        bn, w, st, sp, kvh = (int(x) if x else None for x in a.tiles.split(","))
        tiles = dataclasses.replace(tiles, block_n=bn or tiles.block_n, num_warps=w or tiles.num_warps,
                                    num_stages=st or tiles.num_stages, num_splits=sp or tiles.num_splits,
                                    kv_heads=kvh or tiles.kv_heads)  # fmt: skip
    lz = LP.attention(spec, tiles)
    cache = CACHE_TYPES[a.fmt]
    types = ["*bf16", cache, cache, "*i32", "*i32", "*i32", "*i32", "*fp32", "*fp32", "*fp32", "*i32", "*i32",
             *output_types(lz)]
    compiled, usage, sass = compile_sm90(lz, types)
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    ops = [re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0] for line in lines]
    count = Counter(ops)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    c = lz.constexprs
    print(f"triton {triton.__version__}, {a.fmt} per {a.granularity}, {a.seqs} x {a.context}: "
          f"PV_F16={c['PV_F16']} QK_F16={c['QK_F16']} K_WIDEN={c['K_WIDEN']} V_WORDS={c['V_WORDS']}; "
          f"block_n={tiles.block_n} warps={tiles.num_warps} stages={tiles.num_stages} splits={tiles.num_splits} "
          f"kv_heads={tiles.kv_heads}")
    print(f"registers {regs.group(1) if regs else '?'}, stack {regs.group(2) if regs else '?'}, "
          f"shared {compiled.metadata.shared} B, {len(ops)} instructions")
    if regs:
        per_sm = programs_per_sm(int(regs.group(1)), tiles.num_warps, compiled.metadata.shared)
        programs = math.prod(lz.grid)
        print(f"{per_sm} programs per SM (registers and shared memory); {programs} programs: "
              f"{programs / (per_sm * SMS):.2f} waves on {SMS} SMs")
    if a.driver:
        md = compiled.metadata
        print("the driver: " + driver_occupancy(compiled.asm["cubin"], md.name, 32 * tiles.num_warps, md.shared))
    print("  " + ", ".join(f"{op} {count[op]}" for op in OPCODES))
    for start, end in loops(sass):
        body = Counter(ops[start:end + 1])
        print(f"loop of {end + 1 - start} instructions: " + ", ".join(f"{op} {body[op]}" for op in OPCODES))


def driver_occupancy(cubin: bytes, name: str, threads: int, shared: int) -> str:
    """Registers and resident programs per SM of the kernel in ``cubin`` as the CUDA driver
    counts them (``cuFuncGetAttribute``, ``cuOccupancyMaxActiveBlocksPerMultiprocessor``):
    the check of ``programs_per_sm`` on a machine with a GPU."""
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")

    def check(status: int, what: str) -> None:
        if status:
            raise RuntimeError(f"{what}: CUDA error {status}")

    dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check(cu.cuInit(0), "cuInit")
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    check(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(cubin)), "cuModuleLoadData")
    check(cu.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
    if shared > 48 * 1024:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, as a launch sets it
        check(cu.cuFuncSetAttribute(fn, 8, ctypes.c_int(shared)), "cuFuncSetAttribute")
    regs, per_sm = ctypes.c_int(), ctypes.c_int()
    check(cu.cuFuncGetAttribute(ctypes.byref(regs), 4, fn), "cuFuncGetAttribute")  # NUM_REGS
    check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(per_sm), fn, threads, ctypes.c_size_t(shared)),
          "cuOccupancyMaxActiveBlocksPerMultiprocessor")  # fmt: skip
    return f"{regs.value} registers, {per_sm.value} programs per SM"


def loops(sass: str) -> list[tuple[int, int]]:
    """``(first, last)`` instruction indices of each loop with a dot in it (a branch back to an
    address above it): the key sweeps' loops."""
    at: dict[int, int] = {}  # address -> instruction index
    back: list[tuple[int, int]] = []  # (index of the branch, target address)
    dots: list[int] = []
    for line in sass.splitlines():
        addr = re.match(r"\s+/\*([0-9a-f]{4,})\*/", line)
        if not addr:
            continue
        index = len(at)
        here = int(addr.group(1), 16)
        at[here] = index
        target = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if target and int(target.group(1), 16) < here:
            back.append((index, int(target.group(1), 16)))
        if "HMMA" in line:
            dots.append(index)
    return [(at[t], i) for i, t in back if t in at and any(at[t] <= d <= i for d in dots)]


if __name__ == "__main__":
    main()
