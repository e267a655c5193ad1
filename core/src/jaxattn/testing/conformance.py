"""The conformance suite: any backend, ours or a third party's, checks itself against the oracle.

Subclass ``ConformanceSuite`` in a test module, name the impl, and pytest does the rest::

    from jaxattn.testing.conformance import ConformanceSuite

    class TestMyBackend(ConformanceSuite):
        impl_name = "my_flash"                     # resolved with jaxattn.get_impl
        metadata = AttentionMetadata()             # or e.g. platform="tpu", interpret=True
        dtypes = ("float32", "bfloat16")

For every case of the matrix (``jaxattn.testing.cases``) and every dtype the suite asks the
impl whether it supports the call. If it does, outputs, attention weights and log-sum-exp
(when returned) and gradients must match the float64 oracle within the dtype's tolerance.
If it does not, calling it must raise ``UnsupportedError`` with reasons (the test is then
reported as skipped, "declined"): a backend may refuse a feature but never ignore it.

Every case runs three ways: one program computing the forward and the gradients (the
checks of ``test_forward`` and ``test_gradients``, compiled with the fast test options), the
forward eagerly (in the first dtype: ``eager_dtypes``), and the forward alone under
``jax.jit`` with XLA's default options (``test_forward_eager_and_default_jit``; one program
holds the forwards of every case of a class and dtype, each on its own inputs and checked
alone, and a case runs alone where that program raises): a miscompile
can hide in one of them (jaxlib 0.10.2's XLA:CPU computed wrong decode logits only in a
forward-only program, docs/decode.md). Tests that run one program share it: it is traced
and compiled once per process.
Positions a call must not read are poisoned: in cases with ``kv_lengths``, K and V past each
length hold NaN, then +Inf (``test_unread_cache_positions``), and the outputs and gradients
must still match the oracle, which sees only the valid data. ``test_decode_sweep`` draws a
handful of decode shapes from a seed (``jaxattn.testing.cases.decode_sweep``; the seed is
``sweep_seed``, or ``$JAXATTN_SWEEP_SEED``, and appears in the test id), poisoned the same way.
``--jaxattn-conformance=full`` (with the
``jaxattn.testing.pytest_plugin`` plugin loaded), ``JAXATTN_CONFORMANCE=full`` in the
environment, or ``level = "full"`` on the class runs the larger one.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backend.capabilities import Feature
from jaxattn.backend.impl import AttentionImpl
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.backend.output import AttentionOutput
from jaxattn.backend.validation import resolve_call
from jaxattn.errors import UnsupportedError

from . import oracle
from .cases import (
    DEFAULT_TOLERANCES,
    SWEEP_SEED_ENV,
    Case,
    DtypeTolerance,
    Level,
    cases_for,
    decode_sweep,
    magnitude_inputs,
    make_inputs,
    static_features,
)
from .compare import assert_close, to_float64
from .contract import assert_forward_form, assert_output_contract
from .mod_conformance import ModConformance
from .quantized_cases import QUANTIZED_DENSE_CASES, QuantizedCase, quantize_dense_inputs, quantized_to_jax
from .quick_jit import compiler_options_for_tests, default_compiler_options, eager_test_options
from .strict import STRICT_MODES

__all__ = ["STRICT_CASES", "ConformanceSuite"]

LEVEL_ENV = "JAXATTN_CONFORMANCE"
LEVEL_OPTION = "jaxattn_conformance"

# Array arguments of a call besides q, k and v (absent from a case that does not use them).
_OPTIONAL_ARRAYS = ("mask", "bias", "q_segment_ids", "kv_segment_ids", "softmax_aux", "kv_lengths")

# One case per feature a call can require, to check that undeclared features are declined.
_FEATURE_CASES = {
    Feature.CAUSAL: "causal",
    Feature.MASK: "mask",
    Feature.BIAS: "bias",
    Feature.GQA: "gqa",
    Feature.CROSS: "odd_sizes",
    Feature.DECODE: "decode",
    Feature.VALUE_DIM: "value_dim",
    Feature.SLIDING_WINDOW: "sliding_window",
    Feature.SEGMENT_IDS: "segment_ids",
    Feature.SOFT_CAP: "soft_cap",
    Feature.SINKS: "sinks",
    Feature.KV_LENGTHS: "kv_lengths_decode",
}

# Under jax_enable_x64 (common in scientific code): the case of a bug report (GQA, causal,
# T < S), and packed sequences whose segment ids arrive as int64, as x64 code makes them.
_X64_CASES = (
    Case("x64_gqa_causal", b=1, t=32, s=48, hq=4, hkv=2, d=16, causal=True),
    Case("x64_segments", b=2, t=24, s=24, hq=2, hkv=1, d=16, segments=True, causal=True),
)

# Logits of any finite size (``test_logits_of_any_magnitude``): no scaling by 1/sqrt(D), so
# the tied heads' scores pass 2^32; D = 64 and 128 keys, sizes most kernels take.
# One prefill and one decode shape (T = 8 queries over 128 keys).
_MAGNITUDE_CASES = (
    Case("logits_of_any_magnitude", b=1, t=128, s=128, hq=4, hkv=2, d=64, softmax_scale=0.7),
    Case("logits_of_any_magnitude_decode", b=1, t=8, s=128, hq=4, hkv=2, d=64, softmax_scale=0.7),
)

#: Strict modes (``test_strict_modes``): JAX's own test harness runs with rank promotion
#: "raise", and users debug with NaN/Inf checks and jax's internal checks on. A masked, causal,
#: GQA call with T < S (no row without a key: a legitimate -inf there would trip debug_infs);
#: for backends that take no mask, the same with a window instead (the rows a kernel pads past
#: T see no key through it), then with neither. A suite runs the first its backend accepts.
STRICT_CASES = (
    Case("strict_masked_causal_gqa", b=2, t=8, s=24, hq=4, hkv=2, d=16, causal=True, mask=("B", 1, "T", "S")),
    Case("strict_windowed_causal_gqa", b=2, t=8, s=24, hq=4, hkv=2, d=16, causal=True, sliding_window=(4, 0)),
    Case("strict_causal_gqa", b=2, t=8, s=24, hq=4, hkv=2, d=16, causal=True),
)

_impl_cache: dict[type, AttentionImpl] = {}
# (suite class, case, dtype) -> (output, gradients | the error computing them | None)
_results_cache: dict[tuple[type, Case, str], tuple[AttentionOutput, Any]] = {}
# (suite class, how, differentiated names, static features) -> the jitted function, so that
# tests running one program (test_forward's and test_unread_cache_positions' on poisoned
# inputs, a dtype's two cases of one shape) trace and compile it once per process; jax.jit
# itself keys on shapes and dtypes. The most recent ones only: executables hold memory.
_programs: OrderedDict[tuple[Any, ...], Callable[..., Any]] = OrderedDict()
_PROGRAMS_KEPT = 256
# (suite class, dtype) -> the cases its test_forward_eager_and_default_jit is parametrised with,
# and, once the first of them runs, their forwards (None where the batch did not run).
_default_jit_cases: dict[tuple[type, str], tuple[Case, ...]] = {}
_default_jit_outputs: dict[tuple[type, str], dict[Case, AttentionOutput] | None] = {}


def _jax_arrays(arrays: Mapping[str, Any], dtype: str) -> dict[str, jax.Array]:
    """The call's arrays as jax arrays: floats in ``dtype``, sinks in float32, ids int32."""
    out: dict[str, jax.Array] = {}
    for name, value in arrays.items():
        if name == "mask":
            out[name] = jnp.asarray(value, dtype=bool)
        elif name.endswith("segment_ids") or name == "kv_lengths":
            out[name] = jnp.asarray(value, dtype=jnp.int32)
        elif name in ("softmax_aux", "d_output"):
            out[name] = jnp.asarray(value, dtype=jnp.float32)
        else:
            out[name] = jnp.asarray(value, dtype=dtype)
    return out


class ConformanceSuite(ModConformance):
    """Base class of a backend's conformance tests (not collected itself: no ``Test`` prefix)."""

    #: The impl to test, by registered name (``jaxattn.get_impl``) ...
    impl_name: ClassVar[str | None] = None
    #: ... or by class, for impls that are not registered (instantiated with ``metadata``).
    impl_class: ClassVar[type[AttentionImpl] | None] = None
    #: Bound to the impl; carries the platform override (``platform="tpu", interpret=True``).
    metadata: ClassVar[AttentionMetadata | None] = None
    #: Shorthand for ``metadata.platform``.
    platform: ClassVar[str | None] = None
    #: Dtypes to run every case in.
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    #: Dtypes whose forward also runs eagerly (None: the first of ``dtypes``). An eager run
    #: checks the impl's path with concrete arrays, the same code in every dtype; each dtype's
    #: numerics are checked by the same case under ``jax.jit`` (both programs), and the eager
    #: compiles of each op (most of a CPU's time) are not repeated per dtype.
    eager_dtypes: ClassVar[tuple[str, ...] | None] = None
    tolerances: ClassVar[Mapping[str, DtypeTolerance]] = DEFAULT_TOLERANCES
    #: "default" or "full"; None reads --jaxattn-conformance, then $JAXATTN_CONFORMANCE.
    level: ClassVar[Level | None] = None
    #: Compare the gradient of the bias (turn off for kernels whose bias is constant).
    check_bias_grad: ClassVar[bool] = True
    #: Run calls under jax.jit (the way models run them); eager when False.
    jit: ClassVar[bool] = True
    dropout_prob: ClassVar[float] = 0.25
    #: (T, S) of the backward sweep (``test_backward_lengths``): tiny, odd and prime lengths,
    #: decode and cross attention. Differentiating each must give gradients or raise
    #: ``UnsupportedError``, never another exception from inside a kernel.
    backward_lengths: ClassVar[tuple[tuple[int, int], ...]] = ((1, 1), (3, 3), (1, 333), (333, 333), (1001, 1001))
    #: XLA options of the suite's programs; None: on a CPU, skip LLVM's optimisations, which
    #: cost 3-5x the compile time of these tiny programs and buy nothing at their size. The
    #: forward-only runs (``test_forward_eager_and_default_jit``, ``test_decode_sweep``) always
    #: use XLA's defaults, as a user's ``jax.jit`` does.
    compiler_options: ClassVar[Mapping[str, Any] | None] = None
    #: Seed of ``test_decode_sweep`` (None: ``$JAXATTN_SWEEP_SEED``, else 0) and its case count.
    sweep_seed: ClassVar[int | None] = None
    sweep_count: ClassVar[int] = 4
    #: Strict modes (``STRICT_MODES``) the backend is known to fail, each with why: expected
    #: failures, not strict ones, because such a failure may depend on what the process traced
    #: before (Pallas TPU interpret mode under jax_enable_checks passed and failed across runs of
    #: one suite); a fix shows up as an unexpected pass (XPASS) in the summary.
    strict_mode_failures: ClassVar[Mapping[str, str]] = {}
    #: ``test_strict_modes``' cases, the first the backend accepts (a suite whose backend takes other
    #: head dims maps them).
    strict_cases: ClassVar[tuple[Case, ...]] = STRICT_CASES

    # -- configuration hooks -------------------------------------------------------------
    @classmethod
    def cases(cls, level: Level) -> Sequence[Case]:
        """The matrix; override to adapt shapes for a kernel with tiling constraints."""
        return cases_for(level)

    @classmethod
    def sweep_cases(cls) -> Sequence[Case]:
        """The seeded decode sweep; override to adapt shapes for a kernel with tiling constraints."""
        seed = cls.sweep_seed if cls.sweep_seed is not None else int(os.environ.get(SWEEP_SEED_ENV) or 0)
        return decode_sweep(seed, cls.sweep_count)

    @classmethod
    def make_impl(cls) -> AttentionImpl:
        """The impl under test (one instance per suite class)."""
        if cls not in _impl_cache:
            md = cls.metadata or AttentionMetadata()
            if cls.platform is not None:
                md = md.replace(platform=cls.platform)
            if cls.impl_class is not None:
                _impl_cache[cls] = cls.impl_class(md)
            elif cls.impl_name is not None:
                from jaxattn.api.calls import get_impl

                _impl_cache[cls] = get_impl(cls.impl_name, md)
            else:
                raise TypeError(f"{cls.__name__}: set impl_name or impl_class")
        return _impl_cache[cls]

    @classmethod
    def _compiler_options(cls) -> dict[str, Any] | None:
        if cls.compiler_options is not None:
            return dict(cls.compiler_options)
        return compiler_options_for_tests()

    @classmethod
    def runs_eager(cls, dtype: str) -> bool:
        """Whether the forward of a case in ``dtype`` also runs eagerly (``eager_dtypes``)."""
        return dtype in (cls.eager_dtypes if cls.eager_dtypes is not None else cls.dtypes[:1])

    @classmethod
    def tolerance(cls, dtype: str) -> DtypeTolerance:
        if dtype not in cls.tolerances:
            raise KeyError(f"{cls.__name__}: no tolerance for dtype {dtype!r}; extend `tolerances`")
        return cls.tolerances[dtype]

    @classmethod
    def resolved_level(cls, config: pytest.Config | None = None) -> Level:
        """The class's level, else the command-line option, else the environment, else default."""
        option = config.getoption(LEVEL_OPTION, None) if config is not None else None
        level = cls.level or option or os.environ.get(LEVEL_ENV) or "default"
        if level not in ("default", "full"):
            raise ValueError(f"conformance level must be 'default' or 'full', got {level!r}")
        return level  # type: ignore[return-value]  # narrowed by the check above

    # -- parametrisation (pytest calls this hook on test classes) ------------------------
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        cls = type(self)
        names = metafunc.fixturenames
        if "quantized_case" in names:
            metafunc.parametrize(("quantized_case", "dtype"), [pytest.param(c, dt, id=f"{c.name}-{dt}")
                                                               for c in QUANTIZED_DENSE_CASES for dt in cls.dtypes])
        elif "mod_case" in names:
            metafunc.parametrize(("mod_case", "dtype"), [pytest.param(c, dt, id=f"{c.name}-{dt}")
                                                         for c in cls.mod_cases for dt in cls.dtypes])
        elif "sweep_case" in names:
            metafunc.parametrize(("sweep_case", "dtype"), [pytest.param(c, dt, id=f"{c.name}-{dt}")
                                                           for c in cls.sweep_cases() for dt in cls.dtypes])
        elif "case" in names:
            wanted = cls.cases(cls.resolved_level(metafunc.config))
            if metafunc.function.__name__ == "test_gradients":
                wanted = [c for c in wanted if c.grad]
            if metafunc.function.__name__ == "test_unread_cache_positions":
                wanted = [c for c in wanted if c.kv_lengths is not None]
            if metafunc.function.__name__ == "test_forward_eager_and_default_jit":
                _default_jit_cases.update({(cls, dt): tuple(wanted) for dt in cls.dtypes})
            params = [pytest.param(c, dt, id=f"{c.name}-{dt}") for c in wanted for dt in cls.dtypes]
            metafunc.parametrize(("case", "dtype"), params)
        elif "lengths" in names:
            metafunc.parametrize("lengths", cls.backward_lengths, ids=[f"T{t}-S{s}" for t, s in cls.backward_lengths])
        elif "magnitude_case" in names:
            metafunc.parametrize(("magnitude_case", "dtype"), [pytest.param(c, dt, id=f"{c.name}-{dt}")
                                                               for c in _MAGNITUDE_CASES for dt in cls.dtypes])
        elif "x64_case" in names:
            metafunc.parametrize("x64_case", _X64_CASES, ids=[c.name for c in _X64_CASES])
        elif "strict_mode" in names:
            metafunc.parametrize("strict_mode", [
                pytest.param(m, marks=pytest.mark.xfail(strict=False, reason=cls.strict_mode_failures[m]))
                if m in cls.strict_mode_failures else m for m in STRICT_MODES])
        elif "dtype" in names:
            metafunc.parametrize("dtype", cls.dtypes)

    # -- helpers -------------------------------------------------------------------------
    def _call(self, arrays: Mapping[str, Any], features: Mapping[str, Any]) -> AttentionOutput:
        args = {n: a for n, a in arrays.items() if n != "d_output"}
        q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
        return self.make_impl()(q, k, v, **args, **features)

    def _compiled(
        self, features: Mapping[str, Any], diff_names: Sequence[str] = (), how: str = "test_jit"
    ) -> Callable[[Mapping[str, Any]], tuple[AttentionOutput, dict[str, jax.Array]]]:
        """``arrays -> (output, gradients of sum(out * d_output) for diff_names)``.

        Both come from one compiled program (on a CPU compiling dominates the suite's time);
        reuse the returned function to run one program on several inputs. ``how``:
        "test_jit" (``jax.jit`` with ``compiler_options``; eager where ``jit`` is False),
        "default_jit" (``jax.jit`` with XLA's default options) or "eager".
        """

        def run(diff: dict[str, jax.Array], fixed: dict[str, Any]) -> tuple[AttentionOutput, dict[str, jax.Array]]:
            if not diff:
                return self._call(fixed, features), {}

            def loss(diff: dict[str, jax.Array]) -> tuple[jax.Array, AttentionOutput]:
                out = self._call({**fixed, **diff}, features)
                d_output = fixed["d_output"]
                return jnp.sum(out.attention_outputs.astype(jnp.float32) * d_output), out

            (_, out), grads = jax.value_and_grad(loss, has_aux=True)(diff)
            return out, grads

        if how == "eager" or (how == "test_jit" and not self.jit):
            def compiled(diff: dict[str, jax.Array], fixed: dict[str, Any]) -> tuple[AttentionOutput,
                                                                                     dict[str, jax.Array]]:
                with eager_test_options():  # each op's own compile: the test options, as a jit's
                    return run(diff, fixed)
        else:
            key = (type(self), how, tuple(diff_names), tuple(sorted(features.items())))
            if key in _programs:
                _programs.move_to_end(key)
            else:
                options = default_compiler_options() if how == "default_jit" else self._compiler_options()
                _programs[key] = jax.jit(run, compiler_options=options)
                if len(_programs) > _PROGRAMS_KEPT:
                    _programs.popitem(last=False)
            compiled = _programs[key]

        def split(arrays: Mapping[str, Any]) -> tuple[AttentionOutput, dict[str, jax.Array]]:
            diff = {n: arrays[n] for n in diff_names}
            fixed = {n: a for n, a in arrays.items() if n not in diff}
            if not diff:
                fixed.pop("d_output", None)
            return compiled(diff, fixed)

        return split

    def _evaluate(
        self, arrays: Mapping[str, Any], features: Mapping[str, Any], diff_names: Sequence[str] = (),
        how: str = "test_jit",
    ) -> tuple[AttentionOutput, dict[str, jax.Array]]:
        # The suite checks the math against a float64 oracle: float32 matrix products run at
        # full precision, not the TF32 / bf16-pass default XLA uses on GPUs and TPUs.
        with jax.default_matmul_precision("highest"):
            return self._compiled(features, diff_names, how)(arrays)

    def _diff_names(self, arrays: Mapping[str, Any]) -> list[str]:
        names = ["q", "k", "v"]
        if "bias" in arrays and self.check_bias_grad:
            names.append("bias")
        if "softmax_aux" in arrays:
            names.append("softmax_aux")
        return names

    def _case_results(
        self, case: Case, dtype: str, arrays: Mapping[str, Any], features: Mapping[str, Any]
    ) -> tuple[AttentionOutput, dict[str, jax.Array] | BaseException | None]:
        """Forward (and, where supported, gradients) of a case, computed once per suite class.

        ``test_forward`` and ``test_gradients`` share the compiled program. If only the
        backward fails, the forward is still checked and ``test_gradients`` reports the error.
        """
        key = (type(self), case, dtype)
        if key not in _results_cache:
            grads: dict[str, jax.Array] | BaseException | None = None
            if case.grad and not self._supports(arrays, features, grad=True):
                try:
                    out, grads = self._evaluate(arrays, features, self._diff_names(arrays))
                except Exception as err:  # reported by test_gradients, not here
                    grads = err
                    out, _ = self._evaluate(arrays, features)
            else:
                out, _ = self._evaluate(arrays, features)
            _results_cache[key] = (out, grads)
        return _results_cache[key]

    def _supports(self, arrays: Mapping[str, Any], features: Mapping[str, Any], grad: bool = False) -> list[str]:
        args = {n: a for n, a in arrays.items() if n != "d_output"}
        q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
        return self.make_impl().supports(q, k, v, needs_grad=grad, **args, **features)

    def _skip_declined(self, arrays: Mapping[str, Any], features: Mapping[str, Any], reasons: Sequence[str]) -> None:
        """Where the impl gave reasons, the call must raise them (``_assert_declines``); the test then skips."""
        if reasons:
            self._assert_declines(arrays, features)
            pytest.skip(f"declined as it should: {'; '.join(reasons)}")

    def _assert_declines(self, arrays: Mapping[str, Any], features: Mapping[str, Any]) -> None:
        """A declined call must raise UnsupportedError with reasons, never run regardless."""
        # Eagerly: the error must come from the call itself.
        with pytest.raises(UnsupportedError) as info:
            self._call(arrays, features)
        assert info.value.reasons, "UnsupportedError without reasons"
        assert all(isinstance(r, str) and r for r in info.value.reasons)

    @staticmethod
    def _oracle_kwargs(np_arrays: Mapping[str, Any], case: Case) -> dict[str, Any]:
        kwargs = {n: np_arrays[n] for n in _OPTIONAL_ARRAYS if n in np_arrays}
        return {**kwargs, **static_features(case)}

    def _prepare(self, case: Case, dtype: str) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        np_arrays = make_inputs(case, dtype)
        return np_arrays, _jax_arrays(np_arrays, dtype)

    def _check_forward_out(self, out: AttentionOutput, ref: oracle.OracleResult, dtype: str, label: str) -> None:
        tol = self.tolerance(dtype).forward
        features = self.make_impl().features
        assert_close(f"{label} attention_outputs", out.attention_outputs, ref.output, tol)
        if Feature.WEIGHTS in features:
            assert out.attention_weights is not None, "declares Feature.WEIGHTS but returned no weights"
        if out.attention_weights is not None:
            assert_close(f"{label} attention_weights", out.attention_weights, ref.weights, tol)
        if Feature.LSE in features:
            assert out.softmax_lse is not None, "declares Feature.LSE but returned no softmax_lse"
        if out.softmax_lse is not None:
            assert_close(f"{label} softmax_lse", out.softmax_lse, ref.lse, tol)
        # A row that sees no key (lse = -inf) is exactly zero, not merely small.
        empty = np.isneginf(ref.lse).transpose(0, 2, 1)  # (B, T, Hq)
        got = to_float64(out.attention_outputs)
        assert not got[empty].any(), f"{label}: rows that see no key are not zero"

    def _check_grads(self, grads: Mapping[str, jax.Array], ref: oracle.OracleGrads, dtype: str, label: str) -> None:
        expected = {"q": ref.dq, "k": ref.dk, "v": ref.dv, "bias": ref.dbias, "softmax_aux": ref.dsoftmax_aux}
        tol = self.tolerance(dtype).grad
        for name, got in grads.items():
            want = expected[name]
            assert want is not None, f"oracle has no gradient for {name}"
            assert_close(f"{label} d{name}", got, want, tol)

    # -- the tests -----------------------------------------------------------------------
    def test_forward(self, case: Case, dtype: str) -> None:
        np_arrays, arrays = self._prepare(case, dtype)
        features = static_features(case)
        reasons = self._supports(arrays, features)
        self._skip_declined(arrays, features, reasons)
        out, _ = self._case_results(case, dtype, arrays, features)
        ref = oracle.attention(np_arrays["q"], np_arrays["k"], np_arrays["v"], **self._oracle_kwargs(np_arrays, case))
        self._check_forward_out(out, ref, dtype, case.describe())

    def _forward_checks(self, case: Case, dtype: str, np_arrays: Mapping[str, Any],
                        arrays: Mapping[str, Any], label: str, batched: bool = False) -> None:
        """The forward of ``case``, eagerly and under ``jax.jit`` at XLA's default options (with the
        rest of its batch where ``batched``: ``_default_jit_forward``), against the oracle on
        ``np_arrays`` (``arrays`` may hold poison where nothing reads)."""
        features = static_features(case)
        ref = oracle.attention(np_arrays["q"], np_arrays["k"], np_arrays["v"], **self._oracle_kwargs(np_arrays, case))
        for how in ("eager", "default_jit") if self.runs_eager(dtype) else ("default_jit",):
            out = self._default_jit_forward(case, dtype) if batched and how == "default_jit" else None
            if out is None:
                out, _ = self._evaluate(arrays, features, how=how)
            self._check_forward_out(out, ref, dtype, f"{how}: {label}")

    def _default_jit_forward(self, case: Case, dtype: str) -> AttentionOutput | None:
        """The forward of ``case`` out of one ``jax.jit`` program (XLA's default options) holding
        the forwards of every case ``test_forward_eager_and_default_jit`` is parametrised with in
        this class and dtype, each on its own inputs; None where ``case`` is not in it (a direct
        call, or the batch raised: each case then runs alone and reports its own error).

        XLA compiles a program of many small, disjoint forwards in about half the time of one
        program each (a fixed cost per program: tracing, lowering, the compiler's set-up); each
        forward is the same computation, at the same options, as alone."""
        key = (type(self), dtype)
        if case not in _default_jit_cases.get(key, ()):
            return None
        if key not in _default_jit_outputs:
            _default_jit_outputs[key] = None
            try:
                runs = {}
                for c in _default_jit_cases[key]:
                    _, arrays = self._prepare(c, dtype)
                    if not self._supports(arrays, static_features(c)):
                        runs[c] = {n: a for n, a in arrays.items() if n != "d_output"}
                order = list(runs)

                def forwards(inputs: list[dict[str, jax.Array]]) -> list[AttentionOutput]:
                    return [self._call(a, static_features(c)) for c, a in zip(order, inputs, strict=True)]

                with jax.default_matmul_precision("highest"):
                    outs = jax.jit(forwards, compiler_options=default_compiler_options())(list(runs.values()))
                _default_jit_outputs[key] = dict(zip(order, outs, strict=True))
            except Exception:  # reported by the case that raises, alone
                pass
        outputs = _default_jit_outputs[key]
        return None if outputs is None else outputs.get(case)

    @staticmethod
    def _poisoned(case: Case, arrays: Mapping[str, Any], value: float) -> dict[str, Any]:
        """``arrays`` with K and V at every position ``>= kv_lengths[b]`` set to ``value``."""
        out = dict(arrays)
        if case.kv_lengths is None:
            return out
        past = np.arange(case.s)[None, :] >= np.asarray(case.kv_lengths)[:, None]  # (B, S)
        for name in ("k", "v"):
            out[name] = jnp.where(jnp.asarray(past)[:, :, None, None], jnp.asarray(value, arrays[name].dtype),
                                  arrays[name])
        return out

    def test_forward_eager_and_default_jit(self, case: Case, dtype: str) -> None:
        """The forward alone, eagerly (in ``eager_dtypes``) and under ``jax.jit`` with XLA's default
        options (no test options, no gradients in the program), matches the oracle."""
        np_arrays, arrays = self._prepare(case, dtype)
        reasons = self._supports(arrays, static_features(case))
        if reasons:
            pytest.skip(f"declined (checked by test_forward): {'; '.join(reasons)}")
        self._forward_checks(case, dtype, np_arrays, arrays, case.describe(), batched=True)

    def test_unread_cache_positions(self, case: Case, dtype: str) -> None:
        """K and V past each ``kv_lengths`` hold NaN, then +Inf (the contract: any bit pattern):
        outputs and gradients match the oracle, which sees only the valid data."""
        np_arrays, arrays = self._prepare(case, dtype)
        features = static_features(case)
        if self._supports(arrays, features):
            pytest.skip("declined (checked by test_forward)")
        grad_ok = case.grad and not self._supports(arrays, features, grad=True)
        diff_names = self._diff_names(arrays) if grad_ok else []
        run = self._compiled(features, diff_names)  # one program, both poisons
        kwargs = self._oracle_kwargs(np_arrays, case)
        q, k, v = np_arrays["q"], np_arrays["k"], np_arrays["v"]
        ref = oracle.attention(q, k, v, **kwargs)
        back = oracle.attention_backward(q, k, v, np_arrays["d_output"], **kwargs) if diff_names else None
        for value in (np.nan, np.inf):
            with jax.default_matmul_precision("highest"):
                out, grads = run(self._poisoned(case, arrays, value))
            label = f"K/V past kv_lengths = {value}: {case.describe()}"
            self._check_forward_out(out, ref, dtype, label)
            if back is not None:
                self._check_grads(grads, back, dtype, label)

    def test_decode_sweep(self, sweep_case: Case, dtype: str) -> None:
        """A seeded random decode shape (GQA ratios, T <= 16, odd and even S, lengths with NaN past
        them): eager (in ``eager_dtypes``), forward-only under default ``jax.jit``, and forward + gradients,
        against the oracle."""
        case = sweep_case
        np_arrays, arrays = self._prepare(case, dtype)
        features = static_features(case)
        reasons = self._supports(arrays, features)
        self._skip_declined(arrays, features, reasons)
        poisoned = self._poisoned(case, arrays, np.nan)
        self._forward_checks(case, dtype, np_arrays, poisoned, case.describe())
        if not self._supports(arrays, features, grad=True):
            _, grads = self._evaluate(poisoned, features, self._diff_names(arrays))
            kwargs = self._oracle_kwargs(np_arrays, case)
            back = oracle.attention_backward(np_arrays["q"], np_arrays["k"], np_arrays["v"], np_arrays["d_output"],
                                             **kwargs)
            self._check_grads(grads, back, dtype, case.describe())

    def test_quantized_kv(self, quantized_case: QuantizedCase, dtype: str) -> None:
        """Decode over an int8 / float8 dense cache with ``kv_lengths`` (jaxattn.testing.quantized_cases),
        positions past a length poisoned in values and scales: matches the oracle over the
        dequantized cache, or is declined with reasons (always, without Feature.QUANTIZED_KV)."""
        case = next(c for c in cases_for("full") if c.name == quantized_case.base)
        np_arrays, ref_arrays = quantize_dense_inputs(quantized_case, make_inputs(case, dtype))
        arrays = quantized_to_jax(np_arrays, dtype)
        features = static_features(case)
        reasons = self._supports(arrays, features)
        if Feature.QUANTIZED_KV not in self.make_impl().features:
            assert reasons, f"{self.make_impl()!r} does not declare {Feature.QUANTIZED_KV} but supports() accepts it"
        self._skip_declined(arrays, features, reasons)
        out, _ = self._evaluate(arrays, features)
        ref = oracle.attention(ref_arrays["q"], ref_arrays["k"], ref_arrays["v"],
                               **self._oracle_kwargs(ref_arrays, case))
        self._check_forward_out(out, ref, dtype, f"{quantized_case.kv_dtype} per {quantized_case.granularity}: "
                                f"{case.describe()}")

    def test_gradients(self, case: Case, dtype: str) -> None:
        np_arrays, arrays = self._prepare(case, dtype)
        features = static_features(case)
        reasons = self._supports(arrays, features, grad=True)
        if reasons:
            if self._supports(arrays, features):
                self._assert_declines(arrays, features)
            pytest.skip(f"declined as it should: {'; '.join(reasons)}")
        _, grads = self._case_results(case, dtype, arrays, features)
        if isinstance(grads, BaseException):
            raise grads
        assert grads is not None
        ref = oracle.attention_backward(
            np_arrays["q"],
            np_arrays["k"],
            np_arrays["v"],
            np_arrays["d_output"],
            **self._oracle_kwargs(np_arrays, case),
        )
        assert all(np.isfinite(to_float64(g)).all() for g in grads.values()), "non-finite gradients"
        self._check_grads(grads, ref, dtype, case.describe())

    def test_logits_of_any_magnitude(self, magnitude_case: Case, dtype: str) -> None:
        """Logits of any finite size (docs/contract.md; the inputs: ``cases.magnitude_inputs``):
        rows 2^-100 .. 2^100 in size, and exact ties past 2^32, eagerly, under default
        ``jax.jit`` and with gradients, match the oracle; each row's log-sum-exp to its own size."""
        case = magnitude_case
        np_arrays = make_inputs(case, dtype)
        np_arrays["q"], np_arrays["k"], group, hot = magnitude_inputs(np_arrays["q"], np_arrays["k"], dtype)
        # Hot rows only have to stay finite in the backward: no output gradient there.
        np_arrays["d_output"] = np.where(hot[..., None], 0.0, np_arrays["d_output"])
        group = group.transpose(0, 2, 1)  # as the lse: (B, Hq, T)
        arrays = _jax_arrays(np_arrays, dtype)
        features = static_features(case)
        self._skip_declined(arrays, features, self._supports(arrays, features))
        kwargs = self._oracle_kwargs(np_arrays, case)
        q, k, v = np_arrays["q"], np_arrays["k"], np_arrays["v"]
        ref = oracle.attention(q, k, v, **kwargs)
        runs = [(how, *self._evaluate(arrays, features, how=how)) for how in ("eager", "default_jit")]
        grad_ok = not self._supports(arrays, features, grad=True)
        if grad_ok:
            runs.append(("with gradients", *self._evaluate(arrays, features, self._diff_names(arrays))))
        for how, out, grads in runs:
            label = f"{how}: {case.describe()}, logits of any magnitude"
            self._check_forward_out(out, ref, dtype, label)
            if out.softmax_lse is not None:
                got = to_float64(out.softmax_lse)
                for g in np.unique(group):
                    assert_close(f"{label}: softmax_lse of row group {g}", got[group == g], ref.lse[group == g],
                                 self.tolerance(dtype).forward)
            if grads:
                back = oracle.attention_backward(q, k, v, np_arrays["d_output"], **kwargs)
                assert all(np.isfinite(to_float64(g)).all() for g in grads.values()), f"{label}: non-finite gradients"
                self._check_grads(grads, back, dtype, label)

    def test_runs_something(self, dtype: str, request: pytest.FixtureRequest) -> None:
        """Guard against a vacuous pass: some case of the matrix must run in every dtype listed."""
        for case in self.cases(self.resolved_level(request.config)):
            _, arrays = self._prepare(case, dtype)
            if not self._supports(arrays, static_features(case)):
                return
        pytest.fail(f"{self.make_impl()!r} declines every case in {dtype}; is {dtype} in its dtypes?")

    def test_forward_form(self) -> None:
        """Each forward the impl's class overrides has an accepted form (``jaxattn list`` refuses
        the class otherwise): one call argument, or the seed's q, k, v taking what it declares."""
        assert_forward_form(self.make_impl())

    def test_output_contract(self, dtype: str, request: pytest.FixtureRequest) -> None:
        """The forward itself, unwrapped, returns an ``AttentionOutput`` of the call's shape and
        compute dtype, on the first case of the matrix it accepts."""
        impl = self.make_impl()
        for case in self.cases(self.resolved_level(request.config)):
            _, arrays = self._prepare(case, dtype)
            if self._supports(arrays, static_features(case)):
                continue
            args: dict[str, Any] = {n: a for n, a in arrays.items() if n != "d_output"}
            q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
            call = resolve_call(q, k, v, metadata=impl.metadata, prepare=True, **args, **static_features(case))
            if impl.fallback_reasons(call.problem):  # another impl runs it: not this forward's output
                continue
            with jax.default_matmul_precision("highest"):
                assert_output_contract(impl, call, case.describe())
            return
        pytest.skip(f"declines every case in {dtype} (test_runs_something says whether it should)")

    def test_undeclared_features_are_declined(self) -> None:
        """Each feature the impl does not declare is declined, with reasons, when a call needs it."""
        impl = self.make_impl()
        by_name = {c.name: c for c in cases_for("default")}
        dtype = self.dtypes[0]
        problems = [
            (str(feature), *self._prepare(by_name[name], dtype)[1:], static_features(by_name[name]))
            for feature, name in _FEATURE_CASES.items()
            if feature not in impl.features
        ]
        if Feature.DROPOUT not in impl.features:
            problems.append(("dropout", *self._dropout_problem(dtype)))
        for feature, arrays, features in problems:
            reasons = self._supports(arrays, features)
            assert reasons, f"{impl!r} does not declare {feature} but supports() accepts it"
            self._assert_declines(arrays, features)

    def _check_case_with_grads(self, case: Case, dtype: str, arrays: Mapping[str, Any],
                               np_arrays: Mapping[str, Any]) -> None:
        """Forward and gradients of ``case`` against the oracle, or a consistent refusal.

        Differentiating must raise ``UnsupportedError`` exactly when ``supports(needs_grad=True)``
        declines; any other exception (a kernel's own error) fails the test.
        """
        features = static_features(case)
        if self._supports(arrays, features):
            self._assert_declines(arrays, features)
            pytest.skip("forward declined as it should")
        grad_reasons = self._supports(arrays, features, grad=True)
        if grad_reasons:
            with pytest.raises(UnsupportedError) as info:
                self._evaluate(arrays, features, self._diff_names(arrays))
            assert info.value.reasons, "UnsupportedError without reasons"
            out, grads = self._evaluate(arrays, features)
        else:
            # Any exception here fails the test: supports(needs_grad=True) accepted the call.
            out, grads = self._evaluate(arrays, features, self._diff_names(arrays))
        kwargs = self._oracle_kwargs(np_arrays, case)
        q, k, v = np_arrays["q"], np_arrays["k"], np_arrays["v"]
        self._check_forward_out(out, oracle.attention(q, k, v, **kwargs), dtype, case.describe())
        if grads:
            assert all(np.isfinite(to_float64(g)).all() for g in grads.values()), "non-finite gradients"
            ref = oracle.attention_backward(q, k, v, np_arrays["d_output"], **kwargs)
            self._check_grads(grads, ref, dtype, case.describe())

    def test_backward_lengths(self, lengths: tuple[int, int]) -> None:
        """Tiny, odd and prime lengths: gradients match the oracle, or ``UnsupportedError``, nothing else."""
        t, s = lengths
        case = Case(f"lengths_{t}x{s}", b=1, t=t, s=s, hq=4, hkv=2, d=16, causal=True)
        dtype = self.dtypes[0]
        np_arrays, arrays = self._prepare(case, dtype)
        self._check_case_with_grads(case, dtype, arrays, np_arrays)

    def test_x64(self, x64_case: Case) -> None:
        """With ``jax_enable_x64`` on, forward and backward run (or decline with reasons) and match."""
        dtype = self.dtypes[0]
        np_arrays = make_inputs(x64_case, dtype)
        with jax.enable_x64(True):
            arrays = _jax_arrays(np_arrays, dtype)
            for name in ("q_segment_ids", "kv_segment_ids"):
                if name in arrays:  # x64 code makes int64 ids
                    arrays[name] = arrays[name].astype(jnp.int64)
            self._check_case_with_grads(x64_case, dtype, arrays, np_arrays)

    def test_strict_modes(self, strict_mode: str) -> None:
        """Under rank promotion "raise", ``debug_infs``, ``debug_nans`` or ``enable_checks``, the
        first strict case the impl accepts runs eagerly and under ``jax.jit`` (with gradients
        where supported) and matches the oracle."""
        dtype = self.dtypes[0]
        for case in self.strict_cases:
            np_arrays, arrays = self._prepare(case, dtype)
            features = static_features(case)
            if not self._supports(arrays, features):
                break
        else:
            pytest.skip("declines every strict case (checked by test_forward)")
        kwargs = self._oracle_kwargs(np_arrays, case)
        q, k, v = np_arrays["q"], np_arrays["k"], np_arrays["v"]
        ref = oracle.attention(q, k, v, **kwargs)
        assert np.isfinite(ref.lse).all(), "a strict case must give every row a key"
        grad_ok = not self._supports(arrays, features, grad=True)
        diff_names = self._diff_names(arrays) if grad_ok else []
        label = f"{strict_mode}: {case.describe()}"
        with STRICT_MODES[strict_mode]():
            eager, _ = self._evaluate(arrays, features, how="eager")
            jitted, grads = self._evaluate(arrays, features, diff_names, how="default_jit")
        self._check_forward_out(eager, ref, dtype, f"eager, {label}")
        self._check_forward_out(jitted, ref, dtype, f"jit, {label}")
        if grads:
            self._check_grads(grads, oracle.attention_backward(q, k, v, np_arrays["d_output"], **kwargs), dtype, label)

    # -- dropout -------------------------------------------------------------------------
    def _dropout_problem(
        self, dtype: str, b: int = 2, t: int = 16, s: int = 32, h: int = 2
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """q = 0 makes every probability 1/S; v = one-hot(key) makes output[..., j] = weight of j.

        So ``output * S * (1 - p)`` is exactly the keep-mask the backend drew.
        """
        q = jnp.zeros((b, t, h, 8), dtype=dtype)
        k = jnp.asarray(np.random.default_rng(0).normal(size=(b, s, h, 8)), dtype=dtype)
        v = jnp.broadcast_to(jnp.eye(s, dtype=dtype)[None, :, None, :], (b, s, h, s))
        arrays = {"q": q, "k": k, "v": v, "dropout_rng": jax.random.key(0)}
        return arrays, {"dropout_prob": self.dropout_prob}

    def _kept(self, out: AttentionOutput, s: int) -> np.ndarray:
        scaled = to_float64(out.attention_outputs) * s * (1.0 - self.dropout_prob)
        keep = np.rint(scaled)
        assert np.all(np.isin(keep, (0.0, 1.0))), "dropped weights are not 0 or (1/S)/(1-p)"
        assert np.abs(scaled - keep).max() < 0.05, "kept weights are not scaled by 1/(1-p)"
        return keep.astype(bool)  # (B, T, H, S)

    def test_dropout_statistics(self, dtype: str) -> None:
        """Keep-rate 1 - p, unbiased weights, one draw per rng, fresh masks per batch/head/query."""
        arrays, features = self._dropout_problem(dtype)
        reasons = self._supports(arrays, features)
        self._skip_declined(arrays, features, reasons)
        run = self._compiled(features)  # one program, three calls
        s = arrays["k"].shape[1]
        first, _ = run(arrays)
        again, _ = run(arrays)
        other, _ = run({**arrays, "dropout_rng": jax.random.key(1)})
        keep = self._kept(first, s)
        p = self.dropout_prob
        sigma = np.sqrt(p * (1 - p) / keep.size)
        rate = keep.mean()
        assert abs(rate - (1 - p)) < 6 * sigma, f"keep rate {rate:.3f}, expected {1 - p}"
        # Unbiased: the mean weight equals the no-dropout weight 1/S.
        mean_weight = to_float64(first.attention_outputs).mean()
        assert abs(mean_weight * s - 1) < 6 * sigma / (1 - p), f"E[weight] * S = {mean_weight * s:.3f}"
        np.testing.assert_array_equal(
            to_float64(first.attention_outputs),
            to_float64(again.attention_outputs),
            err_msg="same dropout_rng, different result",
        )
        changed = (self._kept(other, s) != keep).mean()
        assert changed > 0.1, f"another dropout_rng changed only {changed:.1%} of the keep-mask"
        # One mask per (batch, query, head), not one broadcast over any of them.
        for axis in (0, 1, 2):
            a, b = np.take(keep, 0, axis=axis), np.take(keep, 1, axis=axis)
            assert (a != b).mean() > 0.1, f"keep-mask repeats along axis {'BTH'[axis]}"
        if first.attention_weights is not None:
            # Returned weights are the ones that multiplied V, i.e. after dropout.
            np.testing.assert_allclose(
                to_float64(first.attention_weights),
                to_float64(first.attention_outputs).transpose(0, 2, 1, 3),
                rtol=1e-2,
                atol=1e-3,
            )

    def test_dropout_matches_oracle(self, dtype: str) -> None:
        """With the keep-mask read off the returned weights, dropout numerics match the oracle."""
        case = Case("dropout", b=2, t=6, s=9, hq=4, hkv=2, d=8, causal=True, bias=(1, "H", "T", "S"))
        np_arrays, arrays = self._prepare(case, dtype)
        features = {**static_features(case), "dropout_prob": self.dropout_prob}
        arrays["dropout_rng"] = jax.random.key(3)
        if self._supports(arrays, features):
            self._assert_declines(arrays, features)
            pytest.skip("declines dropout (checked)")
        grad_ok = not self._supports(arrays, features, grad=True)
        diff_names = [n for n in self._diff_names(arrays) if grad_ok]
        out, grads = self._evaluate(arrays, features, diff_names)
        if out.attention_weights is None:
            pytest.skip("returns no attention weights, so the keep-mask cannot be recovered")
        kwargs = {
            **self._oracle_kwargs(np_arrays, case),
            "dropout_prob": self.dropout_prob,
            "dropout_keep": to_float64(out.attention_weights) != 0,
        }
        q, k, v = np_arrays["q"], np_arrays["k"], np_arrays["v"]
        self._check_forward_out(out, oracle.attention(q, k, v, **kwargs), dtype, "dropout")
        if grads:
            ref = oracle.attention_backward(q, k, v, np_arrays["d_output"], **kwargs)
            self._check_grads(grads, ref, dtype, "dropout")
