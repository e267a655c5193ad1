"""Test environment of jaxattn-triton: the Triton interpreter on hosts without a CUDA GPU.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` kernel is defined (triton
picks the interpreter at decoration time; this package's kernels are imported lazily, on
first launch). It is set only when no CUDA device is visible, so a GPU run of the same
tests launches real kernels.

Triton's interpreter (3.9) stores bfloat16 as raw uint16 and multiplies those integers in
``tl.dot``; :func:`_patch_interpreter_bf16_dot` makes the interpreter upcast bfloat16 dot
operands to float32 (what the tensor cores do in effect: exact products, float32 sums).
Its integer-to-bfloat16 casts (``int8 -> bf16``, how the paged kernels widen an int8 cache for
a bf16 q) keep the integer's bits as the uint16 storage; :func:`_patch_interpreter_int_to_bf16`
routes them through float32, as a GPU converts. Its float8 widening turns NaN and Inf into
finite numbers (e4m3fn NaN reads as 480), so a poisoned quantized cache would pass unseen:
:func:`_patch_interpreter_fp8_widening` widens float8 exactly (ml_dtypes). One patch is for speed
alone: :func:`_patch_interpreter_device_calls`. Only the test process is patched; kernels and
GPUs are untouched.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _cuda_visible() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_TRITON = importlib.util.find_spec("triton") is not None
ON_CUDA = _cuda_visible()
INTERPRET = HAVE_TRITON and not ON_CUDA
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_interpreter_bf16_dot() -> bool:
    """Returns whether bfloat16 dots are right in the interpreter (patched or not needed)."""
    if not INTERPRET:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if builder is None or original is None or not hasattr(builder, "cast_impl"):
        return False
    if getattr(original, "_jaxattn_bf16", False):
        return True

    def create_dot(self, a, b, d, *args, **kwargs):  # type: ignore[no-untyped-def]
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original(self, a, b, d, *args, **kwargs)

    create_dot._jaxattn_bf16 = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
    return True


BF16_DOT_OK = HAVE_TRITON and _patch_interpreter_bf16_dot()


def _patch_interpreter_int_to_bf16() -> None:
    if not INTERPRET:
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "cast_impl"):
        return
    for name in ("create_si_to_fp", "create_ui_to_fp"):
        original = getattr(builder, name, None)
        if original is None or getattr(original, "_jaxattn_bf16", False):
            continue

        def to_fp(self, src, dst_type, _original=original):  # type: ignore[no-untyped-def]
            if dst_type.scalar == tl.bfloat16:
                return self.cast_impl(self.cast_impl(src, tl.float32), dst_type)
            return _original(self, src, dst_type)

        to_fp._jaxattn_bf16 = True  # type: ignore[attr-defined]
        setattr(builder, name, to_fp)


_patch_interpreter_int_to_bf16()


def _patch_interpreter_fp8_widening() -> None:
    if not INTERPRET:
        return
    try:
        import ml_dtypes
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_fp_to_fp", None)
    if builder is None or original is None or getattr(original, "_jaxattn_fp8", False):
        return
    formats = {tl.float8e4nv: ml_dtypes.float8_e4m3fn, tl.float8e5: ml_dtypes.float8_e5m2}

    def fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        fmt = formats.get(src.dtype.scalar)
        if fmt is None or dst_type.scalar not in (tl.float32, tl.float16, tl.bfloat16):
            return original(self, src, dst_type, rounding_mode)
        wide = interpreter.TensorHandle(src.data.view(fmt).astype(np.float32), tl.float32)
        return wide if dst_type.scalar == tl.float32 else self.cast_impl(wide, dst_type)

    fp_to_fp._jaxattn_fp8 = True  # type: ignore[attr-defined]
    builder.create_fp_to_fp = fp_to_fp


_patch_interpreter_fp8_widening()


def _patch_interpreter_device_calls() -> None:
    """Speed only: a device function's call skips re-patching a language its launch patched.

    The interpreter patches ``triton.language`` for the interpreter when a kernel launches and
    restores it when the launch ends; it also re-patches at every call of a ``@triton.jit``
    helper from inside a kernel (``inspect.getmembers`` over ``tl``, ``tl.tensor`` and
    ``tl.math``: a fifth of an interpreted backward's time), where the launch's patch is
    still in place and finds nothing left to patch. A call whose modules the running launch
    patched now skips that; any other call patches as before.
    """
    if not INTERPRET:
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_class is None or getattr(original, "_jaxattn_once", False):
        return
    patched: set[int] = set()  # ids of the language modules the running launch patched

    def patch_lang(fn):  # type: ignore[no-untyped-def]
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if langs and langs <= patched:
            return scope_class()  # nothing to undo
        scope = original(fn)
        patched.update(langs)
        restore = scope.restore

        def restore_and_forget() -> None:
            patched.clear()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang._jaxattn_once = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang


_patch_interpreter_device_calls()

needs_kernels = pytest.mark.skipif(
    not (HAVE_TORCH and HAVE_TRITON),
    reason="the Triton kernel tests need triton and torch (pip install torch==2.13.0 triton)",
)
# Tests that reach the kernels through a host callback on CPU tensors: interpreter only.
needs_interpreter = pytest.mark.skipif(
    not (HAVE_TORCH and INTERPRET),
    reason="runs the kernels in the Triton interpreter (hosts without a CUDA GPU, with torch)",
)
#: Where test_kernels puts its torch tensors: the GPU when there is one (native launches).
TORCH_DEVICE = "cuda" if ON_CUDA else "cpu"
