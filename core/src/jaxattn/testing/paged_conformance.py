"""The paged conformance suite: any backend over a paged KV cache checks itself against the oracle.

Subclass ``PagedConformanceSuite`` in a test module and name the backend::

    from jaxattn.testing.paged_conformance import PagedConformanceSuite

    class TestMyPagedBackend(PagedConformanceSuite):
        impl_name = "ragged_page_attention_v3"    # resolved with jaxattn.get_impl
        dtypes = ("float32", "bfloat16")

For every case of the matrix (``jaxattn.testing.paged_cases``) and dtype, the backend either
accepts the call and matches the float64 oracle (every row: padding rows and rows that see no
key must be exactly zero), or declines it with ``UnsupportedError`` and reasons. Uniform cases
also go through ``jaxattn.paged_attention`` (the decode form), and cases whose pages are not in
address order run again with ``jaxattn.pages_in_address_order``'s table; every case runs under
``jax.jit``, where nothing is concrete, and eagerly (``test_forward_eager``, in the first dtype:
``eager_dtypes``; tests running one program share it). Everything the
contract calls unread (rows of a sequence's last page at or past its length, pages listed past
its last page, unused pages of the pool) holds NaN, then +Inf, in ``test_unread_positions``,
compiled with XLA's default options; the output must still match the oracle. The same guards
as the dense suite run too: a feature not declared must be declined, and the call runs (or
declines) under ``jax_enable_x64``.

``test_mask_mod`` runs the calls with a ``mask_mod(seq, h, q_pos, kv_pos)`` (``mod_cases``:
``paged_cases.PAGED_MOD_CASES``, a speculative step's draft tree in a ragged batch and a uniform
one, packed documents under a window, a mask of the query head), the arrays the mask_mod captures
traced under ``jax.jit``: the output matches the oracle (which evaluates the mask_mod on each
sequence's index grid), with NaN, then +Inf, under ``jax.jit`` and NaN eagerly wherever nothing is
read: the unread positions above, and every slot and KV head no query's KV head sees. A backend
that does not declare ``Feature.MASK_MOD`` must decline them with reasons.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backend.capabilities import Feature
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.backend.paged_impl import PagedAttentionImpl
from jaxattn.backend.paging import pages_in_address_order
from jaxattn.errors import UnsupportedError

from . import oracle
from .cases import DEFAULT_TOLERANCES, DtypeTolerance, Level, magnitude_inputs
from .compare import assert_close, to_float64
from .contract import assert_forward_form, assert_output_contract
from .paged_cases import (
    MASK_MOD_ARRAYS,
    PAGED_MOD_CASES,
    PagedCase,
    make_paged_inputs,
    paged_cases_for,
    paged_features,
    paged_mask_mod,
    poison_unread,
    query_counts,
    seen_slots,
)
from .quantized_cases import QUANTIZED_PAGED_CASES, QuantizedCase, quantize_paged_inputs, quantized_to_jax
from .quick_jit import compiler_options_for_tests, default_compiler_options, eager_test_options
from .strict import STRICT_MODES

__all__ = ["PagedConformanceSuite"]

LEVEL_ENV = "JAXATTN_CONFORMANCE"

# One case per feature a paged call can require, to check that undeclared features are declined.
_FEATURE_CASES = {
    Feature.GQA: "decode",
    Feature.VALUE_DIM: "value_dim",
    Feature.SLIDING_WINDOW: "window",
    Feature.SOFT_CAP: "soft_cap",
    Feature.SINKS: "sinks",
    Feature.MULTI_TOKEN: "speculative",
    Feature.RAGGED: "ragged_mixed",
    Feature.MASK_MOD: "mm_tree",
}

# Logits of any finite size (``test_logits_of_any_magnitude``): a decode step and a ragged
# batch, no scaling by 1/sqrt(D) (the tied heads' scores pass 2^32), pages of 16.
_MAGNITUDE_CASES = (
    PagedCase("logits_of_any_magnitude_decode", q_lens=(1, 1, 1, 1), kv_lens=(40, 64, 50, 33), uniform=True,
              d=64, page_size=16, softmax_scale=0.7),
    PagedCase("logits_of_any_magnitude_ragged", q_lens=(3, 1, 2, 1), kv_lens=(40, 64, 50, 33), d=64,
              page_size=16, softmax_scale=0.7),
)

_ARRAYS = ("page_table", "kv_lengths", "cu_q_lens", "num_seqs")
_impl_cache: dict[type, PagedAttentionImpl] = {}
# (suite class, case, how, static arguments) -> the jitted call, so that tests running one
# program (test_forward's and test_pages_in_address_order's, a poison's two values, a case's
# dtypes) trace and compile it once per process. The most recent ones only.
_programs: OrderedDict[tuple[Any, ...], Callable[..., Any]] = OrderedDict()
_PROGRAMS_KEPT = 256
# (suite class, dtype) -> the cases its test_unread_positions is parametrised with; and per
# (suite class, dtype, how, poison) their outputs under one jitted program (None: it raised).
_unread_cases: dict[tuple[type, str], tuple[PagedCase, ...]] = {}
_unread_outputs: dict[tuple[type, str, str, str], dict[PagedCase, Any] | None] = {}


def _remember(key: tuple[Any, ...], make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """The jitted program under ``key`` in ``_programs``, made by ``make()`` the first time; the
    least recently used one is dropped beyond ``_PROGRAMS_KEPT``."""
    if key in _programs:
        _programs.move_to_end(key)
    else:
        _programs[key] = make()
        if len(_programs) > _PROGRAMS_KEPT:
            _programs.popitem(last=False)
    return _programs[key]


def _to_jax(arrays: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in arrays.items():
        if name in _ARRAYS:
            out[name] = jnp.asarray(value, jnp.int32)
        elif name in MASK_MOD_ARRAYS:
            out[name] = jnp.asarray(value, MASK_MOD_ARRAYS[name])
        elif name == "softmax_aux":
            out[name] = jnp.asarray(value, jnp.float32)
        else:
            out[name] = jnp.asarray(value, dtype)
    return out


class PagedConformanceSuite:
    """Base class of a paged backend's conformance tests (not collected itself: no ``Test`` prefix)."""

    #: The backend to test, by registered name (``jaxattn.get_impl``) ...
    impl_name: ClassVar[str | None] = None
    #: ... or by class, for backends that are not registered (instantiated with ``metadata``).
    impl_class: ClassVar[type[PagedAttentionImpl] | None] = None
    metadata: ClassVar[AttentionMetadata | None] = None
    #: Shorthand for ``metadata.platform``.
    platform: ClassVar[str | None] = None
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    #: Dtypes whose calls also run eagerly (None: the first of ``dtypes``): the eager path is
    #: the same code in every dtype, and each dtype's numerics are checked under ``jax.jit``.
    eager_dtypes: ClassVar[tuple[str, ...] | None] = None
    tolerances: ClassVar[Mapping[str, DtypeTolerance]] = DEFAULT_TOLERANCES
    #: "default" or "full"; None reads ``$JAXATTN_CONFORMANCE``, then default.
    level: ClassVar[Level | None] = None
    #: Run calls under jax.jit (as a serving loop does); eager when False.
    jit: ClassVar[bool] = True
    #: Strict modes (``jaxattn.testing.conformance.STRICT_MODES``) the backend is known to fail,
    #: each with why: expected failures, not strict (see ConformanceSuite.strict_mode_failures).
    strict_mode_failures: ClassVar[Mapping[str, str]] = {}
    #: The calls with a mask_mod of ``test_mask_mod``.
    mod_cases: ClassVar[Sequence[PagedCase]] = PAGED_MOD_CASES

    @classmethod
    def cases(cls, level: Level) -> Sequence[PagedCase]:
        """The matrix; override to adapt shapes for a kernel with tiling constraints."""
        return paged_cases_for(level)

    @classmethod
    def make_impl(cls) -> PagedAttentionImpl:
        if cls not in _impl_cache:
            md = cls.metadata or AttentionMetadata()
            if cls.platform is not None:
                md = md.replace(platform=cls.platform)
            if cls.impl_class is not None:
                _impl_cache[cls] = cls.impl_class(md)
            elif cls.impl_name is not None:
                from jaxattn.api.calls import get_impl

                impl = get_impl(cls.impl_name, md)
                if not isinstance(impl, PagedAttentionImpl):
                    raise TypeError(f"{cls.__name__}: {cls.impl_name!r} is not a paged impl")
                _impl_cache[cls] = impl
            else:
                raise TypeError(f"{cls.__name__}: set impl_name or impl_class")
        return _impl_cache[cls]

    @classmethod
    def runs_eager(cls, dtype: str) -> bool:
        """Whether calls in ``dtype`` also run eagerly (``eager_dtypes``)."""
        return dtype in (cls.eager_dtypes if cls.eager_dtypes is not None else cls.dtypes[:1])

    @classmethod
    def resolved_level(cls) -> Level:
        level = cls.level or os.environ.get(LEVEL_ENV) or "default"
        if level not in ("default", "full"):
            raise ValueError(f"conformance level must be 'default' or 'full', got {level!r}")
        return level  # type: ignore[return-value]  # narrowed by the check above

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        cls = type(self)
        if "quantized_case" in metafunc.fixturenames:
            metafunc.parametrize(("quantized_case", "dtype"), [pytest.param(c, dt, id=f"{c.name}-{dt}")
                                                               for c in QUANTIZED_PAGED_CASES for dt in cls.dtypes])
        elif "paged_mod_case" in metafunc.fixturenames:
            metafunc.parametrize(("paged_mod_case", "dtype"), [pytest.param(c, dt, id=f"{c.name}-{dt}")
                                                               for c in cls.mod_cases for dt in cls.dtypes])
        elif "magnitude_case" in metafunc.fixturenames:
            metafunc.parametrize(("magnitude_case", "dtype"), [pytest.param(c, dt, id=f"{c.name}-{dt}")
                                                               for c in _MAGNITUDE_CASES for dt in cls.dtypes])
        elif "paged_case" in metafunc.fixturenames:
            eager_only = metafunc.function.__name__ == "test_forward_eager"
            # paged_attention takes T queries per sequence: the decode form of uniform cases only.
            uniform_only = metafunc.function.__name__ == "test_decode_form"
            params = [pytest.param(c, dt, id=f"{c.name}-{dt}") for c in cls.cases(cls.resolved_level())
                      if c.uniform or not uniform_only
                      for dt in cls.dtypes if not eager_only or cls.runs_eager(dt)]
            if metafunc.function.__name__ == "test_unread_positions":
                _unread_cases.update({(cls, dt): tuple(cls.cases(cls.resolved_level())) for dt in cls.dtypes})
            metafunc.parametrize(("paged_case", "dtype"), params)
        elif "strict_mode" in metafunc.fixturenames:
            metafunc.parametrize("strict_mode", [
                pytest.param(m, marks=pytest.mark.xfail(strict=False, reason=cls.strict_mode_failures[m]))
                if m in cls.strict_mode_failures else m for m in STRICT_MODES])
        elif "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", cls.dtypes)

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    def _split(case: PagedCase, arrays: Mapping[str, Any]) -> tuple[tuple[Any, Any, Any, Any, Any], dict[str, Any]]:
        """Positional arrays and keywords of the ragged form (the mask_mod built from ``arrays``)."""
        args = (arrays["q"], arrays.get("k_pages"), arrays.get("v_pages"), arrays["page_table"], arrays["kv_lengths"])
        kwargs = {"cu_q_lens": arrays["cu_q_lens"], "num_seqs": arrays["num_seqs"], **paged_features(case)}
        for name in ("kv_pages", "softmax_aux", "k_scale", "v_scale"):
            if name in arrays:
                kwargs[name] = arrays[name]
        if case.uniform:
            kwargs["queries_per_seq"] = case.q_lens[0]
        if case.mask_mod is not None:
            kwargs["mask_mod"] = paged_mask_mod(case, arrays)
        return args, kwargs

    def _supports(self, case: PagedCase, arrays: Mapping[str, Any]) -> list[str]:
        args, kwargs = self._split(case, arrays)
        return self.make_impl().supports(*args, **kwargs)

    @classmethod
    def _hows(cls, case: PagedCase, how: str, dtype: str) -> tuple[str, ...]:
        """``how``, and for a uniform case also "eager" (in ``eager_dtypes``) and
        "static_count_jit": there num_seqs is known before tracing (``paged_attention`` passes
        it so), and a backend may skip masking rows past it (``PagedCall.static_num_seqs``), a
        path of its own to check."""
        if not case.uniform:
            return (how,)
        return (how, "eager", "static_count_jit") if cls.runs_eager(dtype) else (how, "static_count_jit")

    def _call_of(self, case: PagedCase, arrays: Mapping[str, Any],
                 how: str) -> tuple[Callable[[Any], Any], Any, str, dict[str, Any]]:
        """``(call, inputs, how, static)``: the ragged form's output as ``call(inputs)``, of the
        arrays a program traces; how "static_count_jit" becomes "default_jit" with num_seqs
        among the static arguments."""
        impl = self.make_impl()
        args, kwargs = self._split(case, arrays)
        kwargs.pop("mask_mod", None)  # built inside the program, from the arrays it captures (traced)
        captured = {n: arrays[n] for n in MASK_MOD_ARRAYS if n in arrays}
        static = {n: v for n, v in kwargs.items() if not hasattr(v, "shape")}
        traced = {n: v for n, v in kwargs.items() if hasattr(v, "shape")}
        if how == "static_count_jit":
            static["num_seqs"], how = np.asarray(traced.pop("num_seqs")), "default_jit"

        def call(inputs: tuple[tuple[Any, Any, Any, Any, Any], dict[str, Any], dict[str, Any]]) -> Any:
            (q, k_pages, v_pages, page_table, kv_lengths), traced, captured = inputs
            mods = {} if case.mask_mod is None else {"mask_mod": paged_mask_mod(case, captured)}
            return impl(q, k_pages, v_pages, page_table, kv_lengths, **traced, **static, **mods).attention_outputs

        return call, (args, traced, captured), how, static

    def _run(self, case: PagedCase, arrays: Mapping[str, Any], how: str = "test_jit") -> Any:
        """The ragged form's output. ``how``: "test_jit" (``jax.jit`` with the fast test options;
        eager where ``jit`` is False), "default_jit" (XLA's default options), "static_count_jit"
        (that, with num_seqs a NumPy constant rather than traced) or "eager"."""
        call, inputs, how, static = self._call_of(case, arrays, how)
        if how == "eager" or (how == "test_jit" and not self.jit):
            with eager_test_options():  # each op's own compile: the test options, as a jit's
                return call(inputs)
        # One jitted function per program: a run on other data (the poisons, another table of
        # the same shapes, another dtype) reuses the traced and compiled program.
        key = (type(self), case, how, repr(sorted(static.items())))
        options = compiler_options_for_tests() if how == "test_jit" else default_compiler_options()
        return _remember(key, lambda: jax.jit(call, compiler_options=options))(inputs)

    def _unread_batch(self, case: PagedCase, dtype: str, value: float, how: str) -> Any | None:
        """``case``'s output, poisoned with ``value``, out of one ``jax.jit`` program (XLA's
        defaults) holding the calls of every case ``test_unread_positions`` is parametrised with in
        this class and dtype that ``how`` runs, each on its own inputs (about half the compile time
        of a program each); None where ``case`` is not in it (a direct call, or the batch raised:
        each case then runs alone and reports its own error)."""
        key = (type(self), dtype)
        if how not in ("default_jit", "static_count_jit") or case not in _unread_cases.get(key, ()):
            return None
        out_key = (type(self), dtype, how, repr(value))
        if out_key not in _unread_outputs:
            _unread_outputs[out_key] = None
            try:
                parts = {}
                for c in _unread_cases[key]:
                    arrays = _to_jax(poison_unread(c, make_paged_inputs(c, dtype), value), dtype)
                    if how in self._hows(c, "default_jit", dtype) and not self._supports(c, arrays):
                        parts[c] = self._call_of(c, arrays, how)
                # The poisons' runs share one program: the same cases and static arguments.
                program_key = (type(self), dtype, how, tuple(parts),
                               repr([sorted(static.items()) for *_, static in parts.values()]))
                calls = [call for call, *_ in parts.values()]

                def calls_of(inputs: list[Any]) -> list[Any]:
                    return [call(x) for call, x in zip(calls, inputs, strict=True)]

                program = _remember(program_key, lambda: jax.jit(calls_of, compiler_options=default_compiler_options()))
                with jax.default_matmul_precision("highest"):
                    outs = program([inputs for _, inputs, *_ in parts.values()])
                _unread_outputs[out_key] = dict(zip(parts, outs, strict=True))
            except Exception:  # reported by the case that raises, alone
                pass
        outputs = _unread_outputs[out_key]
        return None if outputs is None else outputs.get(case)

    def _assert_declines(self, case: PagedCase, arrays: Mapping[str, Any]) -> None:
        args, kwargs = self._split(case, arrays)
        with pytest.raises(UnsupportedError) as info:
            self.make_impl()(*args, **kwargs)
        assert info.value.reasons, "UnsupportedError without reasons"

    def _skip_if_declined(self, case: PagedCase, arrays: Mapping[str, Any]) -> None:
        """Skip the test where the backend declines ``case``, once it has checked the decline."""
        reasons = self._supports(case, arrays)
        if reasons:
            self._assert_declines(case, arrays)
            pytest.skip(f"declined as it should: {'; '.join(reasons)}")

    def _expected(self, case: PagedCase, np_arrays: Mapping[str, Any]) -> np.ndarray:
        return oracle.paged_attention(
            np_arrays["q"], np_arrays.get("k_pages"), np_arrays.get("v_pages"), np_arrays["page_table"],
            np_arrays["kv_lengths"], np_arrays["cu_q_lens"], np_arrays["num_seqs"], kv_pages=np_arrays.get("kv_pages"),
            softmax_aux=np_arrays.get("softmax_aux"), mask_mod=paged_mask_mod(case, np_arrays), **paged_features(case),
        )

    def _check(self, case: PagedCase, got: Any, want: np.ndarray, dtype: str, label: str) -> None:
        assert_close(label, got, want, self.tolerances[dtype].forward)
        zero_rows = np.all(want == 0, axis=(1, 2))
        assert np.all(to_float64(got)[zero_rows] == 0), f"{label}: rows that see no key (or padding) are not zero"

    # -- the tests -----------------------------------------------------------------------
    def test_forward_form(self) -> None:
        """Each forward the impl's class overrides takes one argument, the ``PagedCall``."""
        assert_forward_form(self.make_impl())

    def test_output_contract(self, dtype: str) -> None:
        """The forward itself, unwrapped, returns an ``AttentionOutput`` of the call's shape and
        compute dtype, on the first case it accepts."""
        impl = self.make_impl()
        for case in self.cases(self.resolved_level()):
            arrays = _to_jax(make_paged_inputs(case, dtype), dtype)
            if self._supports(case, arrays):
                continue
            args, kwargs = self._split(case, arrays)
            with jax.default_matmul_precision("highest"):
                assert_output_contract(impl, impl.validate(*args, prepare=True, **kwargs), case.describe())
            return
        pytest.skip(f"declines every case in {dtype}")

    def test_forward(self, paged_case: PagedCase, dtype: str) -> None:
        np_arrays = make_paged_inputs(paged_case, dtype)
        arrays = _to_jax(np_arrays, dtype)
        self._skip_if_declined(paged_case, arrays)
        with jax.default_matmul_precision("highest"):
            got = self._run(paged_case, arrays)
        self._check(paged_case, got, self._expected(paged_case, np_arrays), dtype, paged_case.describe())

    def test_forward_eager(self, paged_case: PagedCase, dtype: str) -> None:
        """The same call outside ``jax.jit``, where everything is concrete."""
        np_arrays = make_paged_inputs(paged_case, dtype)
        arrays = _to_jax(np_arrays, dtype)
        if self._supports(paged_case, arrays):
            pytest.skip("declined (checked by test_forward)")
        with jax.default_matmul_precision("highest"):
            got = self._run(paged_case, arrays, how="eager")
        self._check(paged_case, got, self._expected(paged_case, np_arrays), dtype, f"eager: {paged_case.describe()}")

    def test_unread_positions(self, paged_case: PagedCase, dtype: str) -> None:
        """NaN, then +Inf, wherever the contract says nothing is read (``poison_unread``), under
        ``jax.jit`` with XLA's default options (a uniform case also eagerly and with num_seqs a
        constant: ``_hows``): the output matches the oracle on the clean cache."""
        np_arrays = make_paged_inputs(paged_case, dtype)
        if self._supports(paged_case, _to_jax(np_arrays, dtype)):
            pytest.skip("declined (checked by test_forward)")
        want = self._expected(paged_case, np_arrays)
        for value in (np.nan, np.inf):
            arrays = _to_jax(poison_unread(paged_case, np_arrays, value), dtype)
            for how in self._hows(paged_case, "default_jit", dtype):
                got = self._unread_batch(paged_case, dtype, value, how)
                if got is None:
                    with jax.default_matmul_precision("highest"):
                        got = self._run(paged_case, arrays, how=how)
                self._check(paged_case, got, want, dtype, f"{how}, unread positions = {value}: "
                            f"{paged_case.describe()}")

    def test_pages_in_address_order(self, paged_case: PagedCase, dtype: str) -> None:
        """The table from ``jaxattn.pages_in_address_order`` (what an engine may pass to read its
        pool in address order) gives the output of the table in position order."""
        np_arrays = make_paged_inputs(paged_case, dtype)
        table = pages_in_address_order(np_arrays["page_table"], np_arrays["kv_lengths"], paged_case.page_size,
                                       q_lens=query_counts(np_arrays), sliding_window=paged_case.sliding_window)
        if np.array_equal(table, np_arrays["page_table"]):
            pytest.skip("the case's pages are already in address order")
        arrays = _to_jax({**np_arrays, "page_table": table}, dtype)
        if self._supports(paged_case, arrays):
            pytest.skip("declined (checked by test_forward)")
        with jax.default_matmul_precision("highest"):
            got = self._run(paged_case, arrays)
        self._check(paged_case, got, self._expected(paged_case, np_arrays), dtype,
                    f"address-ordered table: {paged_case.describe()}")

    def test_decode_form(self, paged_case: PagedCase, dtype: str) -> None:
        """Uniform cases through ``jaxattn.paged_attention`` with q ``(B, T, Hq, D)``: eagerly in
        ``eager_dtypes``, under ``jax.jit`` in the others."""
        import jaxattn

        if not paged_case.uniform:
            pytest.skip("ragged case: paged_attention takes T queries per sequence")
        np_arrays = make_paged_inputs(paged_case, dtype)
        arrays = _to_jax(np_arrays, dtype)
        if self._supports(paged_case, arrays):
            pytest.skip("declined (checked by test_forward)")
        b, t = paged_case.num_rows, paged_case.q_lens[0]
        q = arrays["q"].reshape(b, t, paged_case.hq, paged_case.d)
        impl, features = self.make_impl(), paged_features(paged_case)

        def call(q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lengths: Any, kv_pages: Any,
                 softmax_aux: Any) -> Any:
            return jaxattn.paged_attention(q, k_pages, v_pages, page_table, kv_lengths, kv_pages=kv_pages,
                                           softmax_aux=softmax_aux, impl=impl, **features)

        eager = self.runs_eager(dtype)
        run = call if eager else jax.jit(call, compiler_options=compiler_options_for_tests())
        with jax.default_matmul_precision("highest"), eager_test_options() if eager else contextlib.nullcontext():
            got = run(q, arrays.get("k_pages"), arrays.get("v_pages"), arrays["page_table"], arrays["kv_lengths"],
                      arrays.get("kv_pages"), arrays.get("softmax_aux"))
        want = self._expected(paged_case, np_arrays).reshape(b, t, paged_case.hq, -1)
        assert got.shape == want.shape
        assert_close(paged_case.describe(), got, want, self.tolerances[dtype].forward)

    def test_quantized_kv(self, quantized_case: QuantizedCase, dtype: str) -> None:
        """An int8 / float8 cache (jaxattn.testing.quantized_cases), unread slots and scales
        poisoned: matches the oracle over the dequantized cache, or is declined with reasons
        (always, by a backend that does not declare Feature.QUANTIZED_KV)."""
        case = next(c for c in paged_cases_for("default") if c.name == quantized_case.base)
        np_arrays, ref_arrays = quantize_paged_inputs(case, quantized_case, make_paged_inputs(case, dtype))
        arrays = quantized_to_jax(np_arrays, dtype)
        reasons = self._supports(case, arrays)
        if Feature.QUANTIZED_KV not in self.make_impl().features:
            assert reasons, f"{self.make_impl()!r} does not declare {Feature.QUANTIZED_KV} but supports() accepts it"
        if reasons:
            self._assert_declines(case, arrays)
            pytest.skip(f"declined as it should: {'; '.join(reasons)}")
        want = self._expected(case, ref_arrays)
        for how in self._hows(case, "test_jit", dtype):
            with jax.default_matmul_precision("highest"):
                got = self._run(case, arrays, how=how)
            self._check(case, got, want, dtype,
                        f"{how}, {quantized_case.kv_dtype} per {quantized_case.granularity}: {case.describe()}")

    def test_logits_of_any_magnitude(self, magnitude_case: PagedCase, dtype: str) -> None:
        """Logits of any finite size (docs/contract.md), as the dense suite's test of that name
        (the inputs: ``cases.magnitude_inputs``, every page's KV head 1 one key vector), eagerly,
        under default ``jax.jit`` and under the test options."""
        case = magnitude_case
        np_arrays = make_paged_inputs(case, dtype)
        np_arrays["q"], np_arrays["k_pages"], _, _ = magnitude_inputs(np_arrays["q"], np_arrays["k_pages"], dtype)
        arrays = _to_jax(np_arrays, dtype)
        self._skip_if_declined(case, arrays)
        want = self._expected(case, np_arrays)
        for how in ("eager", "default_jit", "test_jit"):
            with jax.default_matmul_precision("highest"):
                got = self._run(case, arrays, how=how)
            self._check(case, got, want, dtype, f"{how}: {case.describe()}, logits of any magnitude")

    def test_mask_mod(self, paged_mod_case: PagedCase, dtype: str) -> None:
        """A call with a ``mask_mod`` (``mod_cases``), its captured arrays traced under ``jax.jit``:
        matches the oracle, which evaluates the mask_mod on each sequence's index grid
        (``oracle.paged_mask_mod_grid``). Every position the contract calls unread, and every
        slot and KV head no query's KV head sees (``seen_slots``), holds NaN, then +Inf, under
        ``jax.jit`` (one program), and NaN eagerly (in ``eager_dtypes``). A backend that does not
        declare ``Feature.MASK_MOD`` must decline with reasons."""
        case = paged_mod_case
        np_arrays = make_paged_inputs(case, dtype)
        arrays = _to_jax(np_arrays, dtype)
        reasons = self._supports(case, arrays)
        impl = self.make_impl()
        if Feature.MASK_MOD not in impl.features:
            assert reasons, f"{impl!r} does not declare {Feature.MASK_MOD} but supports() accepts a mask_mod"
        if reasons:
            self._assert_declines(case, arrays)
            pytest.skip(f"declined as it should: {'; '.join(reasons)}")
        want = self._expected(case, np_arrays)
        visible = oracle.paged_visibility(np_arrays["kv_lengths"], np_arrays["cu_q_lens"], np_arrays["num_seqs"],
                                          case.hq, sliding_window=case.sliding_window,
                                          mask_mod=paged_mask_mod(case, np_arrays))
        pool = np_arrays["kv_pages"] if "kv_pages" in np_arrays else np_arrays["k_pages"]
        seen = seen_slots(np_arrays["page_table"], visible, pool.shape[0], case.page_size, case.hkv)
        runs = [(np.nan, "test_jit"), (np.inf, "test_jit")] + ([(np.nan, "eager")] if self.runs_eager(dtype) else [])
        for value, how in runs:
            poisoned = _to_jax(poison_unread(case, np_arrays, value, seen=seen), dtype)
            with jax.default_matmul_precision("highest"):
                got = self._run(case, poisoned, how=how)
            self._check(case, got, want, dtype, f"{how}, unread and unseen positions = {value}: {case.describe()}")

    def test_runs_something(self, dtype: str) -> None:
        """Guard against a vacuous pass: some case of the matrix must run in every dtype listed."""
        for case in self.cases(self.resolved_level()):
            if not self._supports(case, _to_jax(make_paged_inputs(case, dtype), dtype)):
                return
        pytest.fail(f"{self.make_impl()!r} declines every paged case in {dtype}")

    def test_undeclared_features_are_declined(self) -> None:
        impl = self.make_impl()
        by_name = {c.name: c for c in (*paged_cases_for("default"), *PAGED_MOD_CASES)}
        dtype = self.dtypes[0]
        for feature, name in _FEATURE_CASES.items():
            if feature in impl.features:
                continue
            case = by_name[name]
            arrays = _to_jax(make_paged_inputs(case, dtype), dtype)
            assert self._supports(case, arrays), f"{impl!r} does not declare {feature} but supports() accepts it"
            self._assert_declines(case, arrays)

    def test_x64(self) -> None:
        """With ``jax_enable_x64`` on (int64 indices, as x64 code makes them): runs and matches, or declines."""
        wanted = "ragged_mixed" if Feature.RAGGED in self.make_impl().features else "decode"
        case = next(c for c in paged_cases_for("default") if c.name == wanted)
        dtype = self.dtypes[0]
        np_arrays = make_paged_inputs(case, dtype)
        with jax.enable_x64(True):
            arrays = _to_jax(np_arrays, dtype)
            arrays.update({n: arrays[n].astype(jnp.int64) for n in _ARRAYS})
            self._skip_if_declined(case, arrays)
            with jax.default_matmul_precision("highest"):
                got = self._run(case, arrays)
        self._check(case, got, self._expected(case, np_arrays), dtype, f"x64 {case.describe()}")

    def test_strict_modes(self, strict_mode: str) -> None:
        """Under rank promotion "raise", ``debug_infs``, ``debug_nans`` or ``enable_checks`` a ragged
        batch (a decode step where the backend takes no ragged batch) runs eagerly and under
        ``jax.jit`` and matches the oracle; so does the first ``mod_cases`` call (a draft tree) where
        the backend declares ``Feature.MASK_MOD``."""
        impl = self.make_impl()
        wanted = "ragged_mixed" if Feature.RAGGED in impl.features else "decode"
        cases = [next(c for c in paged_cases_for("default") if c.name == wanted)]
        if Feature.MASK_MOD in impl.features and self.mod_cases:
            cases.append(self.mod_cases[0])
        dtype = self.dtypes[0]
        for case in cases:
            np_arrays = make_paged_inputs(case, dtype)
            arrays = _to_jax(np_arrays, dtype)
            self._skip_if_declined(case, arrays)
            want = self._expected(case, np_arrays)
            with STRICT_MODES[strict_mode](), jax.default_matmul_precision("highest"):
                got = {how: self._run(case, arrays, how=how) for how in ("eager", "default_jit")}
            for how, out in got.items():
                self._check(case, out, want, dtype, f"{how}, {strict_mode}: {case.describe()}")
