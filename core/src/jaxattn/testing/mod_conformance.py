"""The conformance tests of masks and scores as programs, part of every ``ConformanceSuite``.

``test_mask_and_score_mods`` runs each case of ``jaxattn.testing.mod_cases`` (every constructor
of ``jaxattn.masks``, user functions of b and h, compositions, score_mods with captured
parameters) against the float64 oracle:

* under ``jax.jit`` (the suite's options), forward and gradients (of q, k, v, the bias, and the
  arrays the score_mod captures), the mask_mod's captured arrays traced and a ``BlockMask``
  built inside the program (``jaxattn.masks.block_mask``) and passed as ``block_mask=``;
* eagerly, forward only, without a block mask (in the suite's eager dtypes, ``runs_eager``);
* with K and V poisoned (NaN under jit, +Inf eagerly) at every key that no query of its sequence
  and KV head may see: the contract says those keys are unread.

``test_mods_in_strict_modes`` runs a mask_mod and score_mod call, eagerly and under ``jax.jit``
(with gradients), under each of the suite's strict modes (rank promotion "raise", ``debug_infs``,
``debug_nans``, ``enable_checks``), its ``BlockMask`` tiles not dividing T: rows a backend pads
must never surface an Inf or NaN that the contract's output does not have.

A backend that does not declare ``Feature.MASK_MOD`` (or ``SCORE_MOD``) must decline such calls
with reasons, which the test checks before it skips.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.backend.capabilities import Feature
from jaxattn.errors import UnsupportedError

from . import oracle
from .cases import static_features
from .compare import assert_close
from .mod_cases import MOD_CASES, MOD_PARAMS, ModCase, build_mods, make_mod_inputs, score_factory
from .quick_jit import eager_test_options
from .strict import STRICT_MODES

__all__ = ["BLOCK_MASK_BLOCKS", "STRICT_MOD_CASES", "ModConformance"]

#: The tiles of the BlockMask the suite builds under jit (several per axis at its shapes).
BLOCK_MASK_BLOCKS = (4, 4)
_INT_ARRAYS = ("prefix_lengths", "doc_q_ids", "doc_kv_ids")
#: test_mods_in_strict_modes' cases, the first a backend accepts: T = S = 10 over the BlockMask's
#: tiles of 4 (padded rows), and every row sees a key (a legitimate -inf lse would trip debug_infs).
STRICT_MOD_CASES = tuple(
    dataclasses.replace(c, name=f"strict_{c.name}", base=dataclasses.replace(c.base, name="strict_mods", t=10, s=10))
    for c in MOD_CASES if c.name in ("sm_alibi_causal", "mm_chunked_causal"))
_PARAM_ARRAYS = ("slopes", "rel_table")


class ModConformance:
    """Mixin of ``ConformanceSuite`` (whose helpers it uses): the mask_mod / score_mod tests."""

    mod_cases = MOD_CASES
    #: ``test_mods_in_strict_modes``' cases (a suite whose backend takes other head dims maps them).
    strict_mod_cases = STRICT_MOD_CASES

    def _mod_arrays(self, case: ModCase, dtype: str) -> tuple[dict[str, Any], dict[str, Any]]:
        np_arrays = make_mod_inputs(case, dtype)
        arrays: dict[str, Any] = {}
        for name, value in np_arrays.items():  # as the suite's _jax_arrays converts them
            if name == "mask":
                arrays[name] = jnp.asarray(value, bool)
            elif name in _INT_ARRAYS or name.endswith("segment_ids") or name == "kv_lengths":
                arrays[name] = jnp.asarray(value, jnp.int32)
            elif name in (*_PARAM_ARRAYS, "softmax_aux", "d_output"):
                arrays[name] = jnp.asarray(value, jnp.float32)
            else:
                arrays[name] = jnp.asarray(value, dtype)
        return np_arrays, arrays

    @staticmethod
    def _split(arrays: Mapping[str, Any]) -> dict[str, Any]:
        return {n: a for n, a in arrays.items() if n not in (*_INT_ARRAYS, *_PARAM_ARRAYS)}

    def _mod_call(self, case: ModCase, arrays: Mapping[str, Any], features: Mapping[str, Any],
                  with_block_mask: bool) -> Any:
        mods = build_mods(case, arrays)
        if with_block_mask and "mask_mod" in mods:
            from jaxattn import masks

            base = case.base
            mods["block_mask"] = masks.block_mask(mods["mask_mod"], base.b, base.hq, base.t, base.s,
                                                  block_q=BLOCK_MASK_BLOCKS[0], block_kv=BLOCK_MASK_BLOCKS[1])
        return self._call(self._split(arrays), {**features, **mods})  # type: ignore[attr-defined]

    def test_mask_and_score_mods(self, mod_case: ModCase, dtype: str) -> None:
        case = mod_case
        suite: Any = self
        np_arrays, arrays = self._mod_arrays(case, dtype)
        features = static_features(case.base)
        impl = suite.make_impl()
        reasons = suite._supports(self._split(arrays), {**features, **build_mods(case, arrays)})
        for needed, feature in ((case.mask_mod, Feature.MASK_MOD), (case.score_mod, Feature.SCORE_MOD)):
            if needed is not None and feature not in impl.features:
                assert reasons, f"{impl!r} does not declare {feature} but supports() accepts a call with one"
        if reasons:
            with pytest.raises(UnsupportedError) as info:  # eagerly: from the call itself
                self._mod_call(case, arrays, features, with_block_mask=False)
            assert info.value.reasons, "UnsupportedError without reasons"
            pytest.skip(f"declined as it should: {'; '.join(reasons)}")

        kwargs = self._mod_oracle_kwargs(case, np_arrays)
        q, k, v = np_arrays["q"], np_arrays["k"], np_arrays["v"]
        ref = oracle.attention(q, k, v, **kwargs)
        # Keys no query of a (sequence, KV head) sees: poisoned, never read.
        b, hq, t, s = ref.visible.shape
        hkv = case.base.hkv
        unseen = np.logical_not(np.any(ref.visible.reshape(b, hkv, hq // hkv, t, s), axis=(2, 3)))  # (B, Hkv, S)
        unseen_bshd = jnp.asarray(np.transpose(unseen, (0, 2, 1))[..., None])

        def poisoned(value: float) -> dict[str, Any]:
            out = dict(arrays)
            for name in ("k", "v"):
                out[name] = jnp.where(unseen_bshd, jnp.asarray(value, arrays[name].dtype), arrays[name])
            return out

        diff_names = self._mod_diff_names(case, arrays, features)
        label = case.describe()
        jitted = self._mod_program(case, features)
        with jax.default_matmul_precision("highest"):
            nan = poisoned(np.nan)
            out, grads = jitted({n: nan[n] for n in diff_names}, {n: a for n, a in nan.items() if n not in diff_names})
            # Eagerly in the suite's eager dtypes only (the same code in every dtype).
            eager = None
            if suite.runs_eager(dtype):
                with eager_test_options():
                    eager = self._mod_call(case, poisoned(np.inf), features, with_block_mask=False)
        suite._check_forward_out(out, ref, dtype, f"jit, block_mask, NaN at unseen keys: {label}")
        if eager is not None:
            suite._check_forward_out(eager, ref, dtype, f"eager, +Inf at unseen keys: {label}")
        if grads:
            self._check_mod_grads(grads, np_arrays, kwargs, dtype, label)

    def test_mods_in_strict_modes(self, strict_mode: str) -> None:
        """The first of ``STRICT_MOD_CASES`` the backend accepts, under one strict mode, eagerly
        and under ``jax.jit`` (gradients too), with a ``BlockMask`` whose tiles pad the rows,
        matches the oracle."""
        suite: Any = self
        if not self.mod_cases:
            pytest.skip("this suite runs no mod cases (mod_cases = ()): another suite runs them")
        dtype = suite.dtypes[0]
        for case in self.strict_mod_cases:
            np_arrays, arrays = self._mod_arrays(case, dtype)
            features = static_features(case.base)
            if not suite._supports(self._split(arrays), {**features, **build_mods(case, arrays)}):
                break
        else:
            pytest.skip("declines every strict mod case (checked by test_mask_and_score_mods)")
        kwargs = self._mod_oracle_kwargs(case, np_arrays)
        ref = oracle.attention(np_arrays["q"], np_arrays["k"], np_arrays["v"], **kwargs)
        assert np.isfinite(ref.lse).all(), "a strict case must give every row a key"
        diff_names = self._mod_diff_names(case, arrays, features)
        label = f"{strict_mode}: {case.describe()}"
        with STRICT_MODES[strict_mode](), jax.default_matmul_precision("highest"):
            eager = self._mod_call(case, arrays, features, with_block_mask=True)
            out, grads = self._mod_program(case, features)({n: arrays[n] for n in diff_names},
                                                           {n: a for n, a in arrays.items() if n not in diff_names})
        suite._check_forward_out(eager, ref, dtype, f"eager, block_mask, {label}")
        suite._check_forward_out(out, ref, dtype, f"jit, block_mask, {label}")
        if grads:
            self._check_mod_grads(grads, np_arrays, kwargs, dtype, label)

    # -- helpers -------------------------------------------------------------------------
    def _mod_oracle_kwargs(self, case: ModCase, np_arrays: Mapping[str, Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = self._oracle_kwargs(np_arrays, case.base)  # type: ignore[attr-defined]
        if case.mask_mod is not None:
            kwargs["mask_mod"] = build_mods(case, np_arrays)["mask_mod"]
        factory = score_factory(case, np_arrays)
        if factory is not None:
            kwargs["score_mod"], kwargs["score_params"] = factory
        return kwargs

    def _mod_diff_names(self, case: ModCase, arrays: Mapping[str, Any], features: Mapping[str, Any]) -> list[str]:
        """What the suite differentiates: q, k, v (the bias) and the score_mod's captured
        parameters; nothing where the backend declines gradients of the call."""
        suite: Any = self
        if suite._supports(self._split(arrays), {**features, **build_mods(case, arrays)}, grad=True):
            return []
        return [*suite._diff_names(self._split(arrays)), *(MOD_PARAMS.get(case.score_mod or "", ()))]

    def _mod_program(self, case: ModCase, features: Mapping[str, Any]) -> Callable[..., Any]:
        """``(diff, fixed) -> (output, gradients of diff)``, a ``BlockMask`` built inside, under
        ``jax.jit`` with the suite's options (where the suite jits)."""
        suite: Any = self

        def run(diff: dict[str, Any], fixed: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            def loss(diff: dict[str, Any]) -> tuple[Any, Any]:
                out = self._mod_call(case, {**fixed, **diff}, features, with_block_mask=True)
                return jnp.sum(out.attention_outputs.astype(jnp.float32) * fixed["d_output"]), out

            if not diff:
                return self._mod_call(case, fixed, features, with_block_mask=True), {}
            (_, out), grads = jax.value_and_grad(loss, has_aux=True)(diff)
            return out, grads

        return jax.jit(run, compiler_options=suite._compiler_options()) if suite.jit else run

    def _check_mod_grads(self, grads: dict[str, Any], np_arrays: Mapping[str, Any], kwargs: Mapping[str, Any],
                         dtype: str, label: str) -> None:
        suite: Any = self
        back = oracle.attention_backward(np_arrays["q"], np_arrays["k"], np_arrays["v"], np_arrays["d_output"],
                                         **kwargs)
        assert all(np.isfinite(np.asarray(g, np.float64)).all() for g in grads.values()), \
            f"{label}: non-finite gradients"
        params = {n: grads.pop(n) for n in list(grads) if n in _PARAM_ARRAYS}
        suite._check_grads(grads, back, dtype, label)
        tol = suite.tolerance(dtype).grad
        for name, got in params.items():
            assert_close(f"{label} d{name} (captured by the score_mod)", got, back.dscore_params[name], tol)
