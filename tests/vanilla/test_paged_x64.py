"""A float64 paged call stays float64 end to end (issue: x64 ragged attention on a GPU).

The ragged path once accumulated P @ V as an f64 x f64 -> f32 product: on a GPU cuBLASLt refuses
that mixed GEMM ("GEMM is not supported by cublasLt"), and everywhere it rounds the result to
float32. Checked here against the float64 oracle at float64 precision, eager and under jit, for the
ragged and the uniform path; the same test runs on the GPU machine's test run.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxattn
from jaxattn.testing import oracle


def _call(rng: np.random.Generator, ragged: bool) -> dict[str, np.ndarray]:
    num_pages, page_size, hkv, hq, d = 12, 4, 2, 4, 8
    lengths = np.array([7, 13, 1], np.int32)
    q_lens = np.array([3, 5, 1] if ragged else [1, 1, 1], np.int32)
    table = rng.permutation(num_pages)[:12].reshape(3, 4).astype(np.int32)
    return {
        "q": rng.normal(size=(int(q_lens.sum()), hq, d)),
        "k_pages": rng.normal(size=(num_pages, page_size, hkv, d)),
        "v_pages": rng.normal(size=(num_pages, page_size, hkv, d)),
        "page_table": table,
        "kv_lengths": lengths,
        "cu_q_lens": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        "num_seqs": np.array([3], np.int32),
    }


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "uniform"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_float64_paged_matches_oracle_at_float64_precision(ragged: bool, jit: bool) -> None:
    a = _call(np.random.default_rng(3), ragged)
    ref = oracle.paged_attention(a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"],
                                 a["cu_q_lens"], a["num_seqs"], softmax_aux=None)
    with jax.enable_x64(True):
        args = {k: jax.numpy.asarray(v) for k, v in a.items()}

        def run(args: dict[str, jax.Array]) -> jax.Array:
            return jaxattn.ragged_paged_attention(
                args["q"], args["k_pages"], args["v_pages"], args["page_table"], args["kv_lengths"],
                args["cu_q_lens"], args["num_seqs"], impl="vanilla_paged")

        out = jax.jit(run)(args) if jit else run(args)
        assert out.dtype == jax.numpy.float64
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-12, atol=1e-12)
