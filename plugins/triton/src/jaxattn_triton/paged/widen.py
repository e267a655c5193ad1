# mypy: allow-untyped-defs, allow-incomplete-defs, disable-error-code="no-redef"
# (Triton reads a @triton.jit parameter's annotation as its kind: tl.constexpr, or nothing for
# pointers and runtime scalars, which have no Python type to write. An inline-asm string must
# be an annotated constexpr local, once per branch: mypy reads those as redefinitions.)
"""Narrow cache values (int8, float8_e4m3fn, float8_e5m2) widened to bf16 or fp16 in registers.

Formats are codes (``FMT``): 1 int8, 2 float8_e4m3fn, 3 float8_e5m2, 4 int8 offset (below). On a GPU (``ASM``) four
values at a time go through bit tricks in inline PTX, every instruction a full-rate integer or
packed 16-bit one, where Triton's own casts take e4m3 through f16 -> f32 -> bf16 (F2F, a
quarter-rate conversion unit):

* int8 -> bf16: each byte under 0x43 (128 + low 7 bits) minus 0x4300/0x4380 (its sign bit's
  weight), one packed subtraction per pair; int8 -> fp16: the sign flipped, under 0x64
  (1024 + byte), minus 1152.
* e4m3 -> bf16: the byte's sign, exponent and mantissa shifted into a bf16's fields give the
  value times 2^-120 (subnormals included: both formats' subnormals scale the same way), and
  one packed multiply by 2^120 restores it; e4m3 -> fp16: the hardware's e4m3x2 -> f16x2.
* e5m2 -> fp16: the byte is the high byte of an fp16; e5m2 -> bf16: shifted as e4m3, 2^112.
* int8 offset -> fp16 (``FMT`` 4): ``(v + 128) * 2^-24``, the sign flipped and the byte under
  0x00 (an fp16 subnormal, which the tensor cores multiply exactly), without the subtraction:
  three instructions for four values instead of five. A product's sum then carries 128 times
  the other operand's sum, which the kernel takes out once (``kernel.py``).

Every result is exact. Bytes holding NaN or inf come out finite: values inside a length are
numbers, and those past it are masked to zero before they are widened. The interpreter has
no inline PTX: there (``ASM`` False), and for float32 outputs, Triton's casts do the job.
"""

import triton
import triton.language as tl


def _float8_to_bf16(exponent_bits: int, mask: int, unbias: int) -> str:
    """A float8's sign, exponent and mantissa shifted into a bf16's fields (the byte moved to a
    16-bit lane's high half, exponent and mantissa down by bf16's 8 exponent bits less the
    format's, ``mask`` keeping them), then one packed multiply by ``unbias`` (a bf16 pair: 2^120
    for e4m3, 2^112 for e5m2) restores the exponent bias."""
    return f"""
        prmt.b32 a0, IN, 0, 0x1404;
        prmt.b32 a1, IN, 0, 0x3424;
        and.b32 s0, a0, 0x80008000;
        and.b32 s1, a1, 0x80008000;
        shr.b32 a0, a0, {8 - exponent_bits};
        shr.b32 a1, a1, {8 - exponent_bits};
        and.b32 a0, a0, {mask:#010x};
        and.b32 a1, a1, {mask:#010x};
        or.b32 a0, a0, s0;
        or.b32 a1, a1, s1;
        mov.b32 c, {unbias:#010x};
        mul.rn.bf16x2 r0, a0, c;
        mul.rn.bf16x2 r1, a1, c;"""


# PTX bodies: input word in IN (4 bytes, little-endian), outputs r0 (values 0, 1) and r1 (2, 3).
_BODIES = {
    (1, "bf16"): """
        mov.b32 c, 0x43434343;
        prmt.b32 a0, IN, c, 0x4140;
        prmt.b32 a1, IN, c, 0x4342;
        and.b32 s0, a0, 0x43804380;
        and.b32 a0, a0, 0x437f437f;
        and.b32 s1, a1, 0x43804380;
        and.b32 a1, a1, 0x437f437f;
        sub.rn.bf16x2 r0, a0, s0;
        sub.rn.bf16x2 r1, a1, s1;""",
    (1, "fp16"): """
        mov.b32 c, 0x64646464;
        xor.b32 a0, IN, 0x80808080;
        prmt.b32 a1, a0, c, 0x4342;
        prmt.b32 a0, a0, c, 0x4140;
        mov.b32 c, 0x64806480;
        sub.rn.f16x2 r0, a0, c;
        sub.rn.f16x2 r1, a1, c;""",
    (2, "bf16"): _float8_to_bf16(4, 0x07F007F0, 0x7B807B80),
    (2, "fp16"): """
        mov.b32 {l, h}, IN;
        cvt.rn.f16x2.e4m3x2 r0, l;
        cvt.rn.f16x2.e4m3x2 r1, h;""",
    (3, "bf16"): _float8_to_bf16(5, 0x0FE00FE0, 0x77807780),
    (3, "fp16"): """
        prmt.b32 r0, IN, 0, 0x1404;
        prmt.b32 r1, IN, 0, 0x3424;""",
    (4, "fp16"): """
        xor.b32 a0, IN, 0x80808080;
        prmt.b32 r1, a0, 0, 0x4342;
        prmt.b32 r0, a0, 0, 0x4140;""",
}
_REGS = ".reg .b32 c, a0, a1, s0, s1, r0, r1; .reg .b16 l, h;"


def _asm(fmt: int, out: str, words: bool) -> tl.constexpr:
    # words: four 16-bit outputs ($0..$3) of one int32 input ($4); else Triton's pack=4 form,
    # two 32-bit outputs of 16-bit pairs ($0, $1) of one register of 4 bytes ($2).
    body = _BODIES[(fmt, out)].replace("IN", "$4" if words else "$2")
    tail = "mov.b32 {$0, $1}, r0; mov.b32 {$2, $3}, r1;" if words else "mov.b32 $0, r0; mov.b32 $1, r1;"
    return tl.constexpr("{" + _REGS + body + "\n" + tail + "}")


_W1B, _W1H, _P1B, _P1H = _asm(1, "bf16", True), _asm(1, "fp16", True), _asm(1, "bf16", False), _asm(1, "fp16", False)
_W2B, _W2H, _P2B, _P2H = _asm(2, "bf16", True), _asm(2, "fp16", True), _asm(2, "bf16", False), _asm(2, "fp16", False)
_W3B, _W3H, _P3B, _P3H = _asm(3, "bf16", True), _asm(3, "fp16", True), _asm(3, "bf16", False), _asm(3, "fp16", False)
_W4H, _P4H = _asm(4, "fp16", True), _asm(4, "fp16", False)  # fp16 only: the kernel's sums take the offset out


@triton.jit
def _word_lanes_asm(w, FMT: tl.constexpr, out_dtype: tl.constexpr):
    if out_dtype == tl.bfloat16:
        if FMT == 1:
            asm: tl.constexpr = _W1B
        elif FMT == 2:
            asm: tl.constexpr = _W2B
        else:
            asm: tl.constexpr = _W3B
        lanes = tl.inline_asm_elementwise(asm, "=h,=h,=h,=h,r", [w], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1)
    else:
        if FMT == 1:
            asm: tl.constexpr = _W1H
        elif FMT == 2:
            asm: tl.constexpr = _W2H
        elif FMT == 3:
            asm: tl.constexpr = _W3H
        else:
            asm: tl.constexpr = _W4H
        lanes = tl.inline_asm_elementwise(asm, "=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    return lanes


@triton.jit
def _word_lane(w, i: tl.constexpr, FMT: tl.constexpr, out_dtype: tl.constexpr):
    # Lane i (little-endian) of each word through Triton's casts.
    return widen(((w >> (8 * i)) & 0xFF).to(tl.uint8), FMT, out_dtype, False)


@triton.jit
def widen(x, FMT: tl.constexpr, out_dtype: tl.constexpr, ASM: tl.constexpr):
    """Values ``x`` (of the format's dtype, or their bytes as uint8) as ``out_dtype``, elementwise.

    Any layout: the compiler may move it into an MMA operand's layout, after the load."""
    if ASM and (out_dtype == tl.bfloat16 or out_dtype == tl.float16):
        b = x.to(tl.uint8, bitcast=True)
        if out_dtype == tl.bfloat16:
            if FMT == 1:
                asm: tl.constexpr = _P1B
            elif FMT == 2:
                asm: tl.constexpr = _P2B
            else:
                asm: tl.constexpr = _P3B
            y = tl.inline_asm_elementwise(asm, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            if FMT == 1:
                asm: tl.constexpr = _P1H
            elif FMT == 2:
                asm: tl.constexpr = _P2H
            elif FMT == 3:
                asm: tl.constexpr = _P3H
            else:
                asm: tl.constexpr = _P4H
            y = tl.inline_asm_elementwise(asm, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    elif FMT == 1:
        y = x.to(tl.int8, bitcast=True).to(out_dtype)
    elif FMT == 2:
        y = x.to(tl.float8e4nv, bitcast=True).to(out_dtype)
    elif FMT == 3:
        y = x.to(tl.float8e5, bitcast=True).to(out_dtype)
    else:
        # (v + 128) * 2^-24: exact in fp16 (a subnormal) and in float32.
        y = ((x.to(tl.int8, bitcast=True).to(tl.int32) + 128).to(tl.float32) * 5.9604644775390625e-08).to(out_dtype)
    return y


@triton.jit
def word_lanes(w, FMT: tl.constexpr, out_dtype: tl.constexpr, ASM: tl.constexpr):
    """The four lanes of int32 words of 4 narrow values each (little-endian), each as
    ``out_dtype`` in the words' shape: lane ``i`` holds value ``4 * word + i``."""
    if ASM and (out_dtype == tl.bfloat16 or out_dtype == tl.float16):
        e0, e1, e2, e3 = _word_lanes_asm(w, FMT, out_dtype)
    else:
        e0 = _word_lane(w, 0, FMT, out_dtype)
        e1 = _word_lane(w, 1, FMT, out_dtype)
        e2 = _word_lane(w, 2, FMT, out_dtype)
        e3 = _word_lane(w, 3, FMT, out_dtype)
    return e0, e1, e2, e3


@triton.jit
def join_lanes(e0, e1, e2, e3, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The ``(ROWS, COLS)`` tile whose column ``4 w + i`` is column ``w`` of lane ``i``
    (``word_lanes``' order); ``split_lanes`` undoes it."""
    # join stacks on a new last axis: (row, word, pair, lane in pair) -> column 4 word + 2 pair + lane.
    return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (ROWS, COLS))


@triton.jit
def split_lanes(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``x (ROWS, COLS)`` as its four lanes, ``join_lanes`` undone: lane ``i`` holds columns
    ``4 w + i``."""
    a02, a13 = tl.split(tl.reshape(x, (ROWS, COLS // 4, 2, 2)))
    a0, a2 = tl.split(a02)
    a1, a3 = tl.split(a13)
    return a0, a1, a2, a3
