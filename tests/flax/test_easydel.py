"""EasyDeL's operator call (``impl(**input_dict)``) and mask shapes, against the float64 oracle."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.testing import oracle
from jaxattn_flax.easydel import EasyDeLOperator, easydel_call

B, T, HQ, HKV, D = 2, 6, 4, 2, 8
REP = HQ // HKV


def states(t: int = T, s: int = T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, t, HQ, D), np.float32), rng.standard_normal((B, s, HKV, D), np.float32),
            rng.standard_normal((B, s, HKV, D), np.float32))


def random_mask(shape: tuple[int, ...], seed: int = 1) -> np.ndarray:
    mask = np.random.default_rng(seed).random(shape) > 0.4
    return mask


def want(q: Any, k: Any, v: Any, **kw: Any) -> np.ndarray:
    return oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), **kw).output


def run(op: EasyDeLOperator, jit: bool, **inputs: Any) -> np.ndarray:
    arrays = {n: x for n, x in inputs.items() if isinstance(x, np.ndarray)}
    rest = {n: x for n, x in inputs.items() if n not in arrays}
    def call(a: dict[str, Any]) -> Any:
        return op(**a, **rest).attention_outputs

    return np.asarray(jax.jit(call)(arrays) if jit else call(arrays))


JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


@JIT
@pytest.mark.parametrize("heads", [1, HKV, HQ], ids=["one-head", "kv-heads", "q-heads"])
def test_four_dim_masks(heads: int, jit: bool) -> None:
    q, k, v = states()
    mask = random_mask((B, heads, T, T))
    full = np.repeat(mask, REP, axis=1) if heads == HKV else np.broadcast_to(mask, (B, HQ, T, T))
    out = run(EasyDeLOperator("vanilla"), jit, q=q, k=k, v=v, mask=mask)
    np.testing.assert_allclose(out, want(q, k, v, mask=full), atol=2e-5)


@JIT
def test_three_dim_mask_is_shared_by_the_heads(jit: bool) -> None:
    q, k, v = states()
    mask = random_mask((B, T, T))
    out = run(EasyDeLOperator("auto"), jit, query_states=q, key_states=k, value_states=v, attention_mask=mask)
    np.testing.assert_allclose(out, want(q, k, v, mask=mask[:, None]), atol=2e-5)


@JIT
def test_two_dim_mask_is_key_padding(jit: bool) -> None:
    # a decode step over a cache of 10 positions of which 7 and 4 are written (EasyDeL's (b, S) mask)
    q, k, v = states(t=1, s=10)
    mask = np.arange(10)[None, :] < np.array([[7], [4]])
    out = run(EasyDeLOperator("auto"), jit, query=q, key=k, value=v, mask=mask.astype(np.int32), causal=True)
    np.testing.assert_allclose(out, want(q, k, v, mask=mask[:, None, None, :]), atol=2e-5)


def test_bias_with_kv_heads_and_init_bias_only_without_a_mask() -> None:
    q, k, v = states()
    bias = np.random.default_rng(2).standard_normal((B, HKV, T, T)).astype(np.float32)
    op = EasyDeLOperator("vanilla")
    out = op(q=q, k=k, v=v, bias=bias).attention_outputs
    np.testing.assert_allclose(out, want(q, k, v, bias=np.repeat(bias, REP, axis=1)), atol=2e-5)
    called: list[int] = []

    def init_bias() -> Any:
        called.append(1)
        return jnp.asarray(bias[:, :1])

    mask = random_mask((B, 1, T, T))
    out = op(q=q, k=k, v=v, mask=mask, init_bias=init_bias).attention_outputs
    assert called == []  # VanillaAttn calls init_bias only without a mask and a bias
    np.testing.assert_allclose(out, want(q, k, v, mask=mask), atol=2e-5)
    out = op(q=q, k=k, v=v, init_bias=init_bias).attention_outputs
    assert called == [1]
    np.testing.assert_allclose(out, want(q, k, v, bias=bias[:, :1]), atol=2e-5)


@JIT
def test_the_flexible_attention_module_input_dict(jit: bool) -> None:
    """The keys a recent FlexibleAttentionModule passes, with their defaults and a cache view."""
    q, k, v = states()
    seg = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]], np.int32)
    inputs: dict[str, Any] = {
        "query": q, "key": k, "value": v, "mask_info": None, "bias": None, "sliding_window": None,
        "cache_metadata": object(), "cache_view": object(), "init_bias": None, "causal": True, "deterministic": False,
        "dropout_rng": None, "softmax_aux": None, "softmax_scale": 0.3, "logits_soft_cap": None, "dropout_prob": 0.0,
        "precision": jax.lax.Precision.DEFAULT, "prevent_cse": True, "cum_seqlens_q": None, "cum_seqlens_k": None,
        "normalize_output": True, "fused_backward": False, "compute_dtype": None, "optimized": False,
        "mask_value": None, "vmem_limit_bytes": None, "policy": jax.checkpoint_policies.nothing_saveable,
        "segment_ids": seg}
    out = run(EasyDeLOperator("auto"), jit, **inputs)
    np.testing.assert_allclose(out, want(q, k, v, causal=True, softmax_scale=0.3, q_segment_ids=seg,
                                         kv_segment_ids=seg), atol=2e-5)
    # an impl object called directly, the older keys (q/k/v, mask)
    out = easydel_call(jaxattn.get_impl("vanilla"), q=q, k=k, v=v, mask=None, causal=True, segment_ids=seg,
                       deterministic=True).attention_outputs
    np.testing.assert_allclose(out, want(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg), atol=2e-5)


def test_what_cannot_be_honoured_is_refused_by_name() -> None:
    q, k, v = states()
    op = EasyDeLOperator("vanilla", jaxattn.AttentionMetadata(dropout_prob=0.1))
    with pytest.raises(jaxattn.InvalidInputError, match=r"bogus, other_key: not a key"):
        op(q=q, k=k, v=v, bogus=1, other_key=2)
    with pytest.raises(jaxattn.InvalidInputError, match=r"^deterministic:.*shared"):
        op(q=q, k=k, v=v, deterministic=False, dropout_rng=jax.random.key(0))  # the metadata's probability
    out = op(q=q, k=k, v=v, deterministic=True).attention_outputs  # no dropout: the metadata's 0.1 unused
    np.testing.assert_allclose(out, want(q, k, v), atol=2e-5)
    for name in ("mask_value", "cum_seqlens_q", "mask_info"):
        with pytest.raises(jaxattn.InvalidInputError, match=rf"^{name}:"):
            op(q=q, k=k, v=v, **{name: np.zeros(3)})
    with pytest.raises(jaxattn.InvalidInputError, match=r"^q: give exactly one of q, query, query_states"):
        op(q=q, query=q, k=k, v=v)
    with pytest.raises(jaxattn.InvalidInputError, match=r"^mask: 3 heads"):
        op(q=q, k=k, v=v, mask=np.ones((B, 3, T, T), bool))

    class PagedView:
        kv_pages = None

    with pytest.raises(jaxattn.InvalidInputError, match=r"^cache_view:.*ragged_paged_attention"):
        op(q=q, k=k, v=v, cache_view=PagedView())
    with pytest.raises(jaxattn.InvalidInputError, match=r"^impl:.*paged impl"):
        EasyDeLOperator("ragged_page_attention")
    with pytest.raises(jaxattn.InvalidInputError, match=r"^segment_ids:.*T == S"):
        op(q=q[:, :2], k=k, v=v, segment_ids=np.zeros((B, 2), np.int32))


@pytest.mark.slow
def test_the_easydel_page_examples_run_in_order() -> None:
    """docs/easydel.md's blocks, pasted in order into one process: the port gives auto's numbers."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "easydel.md").read_text()
    code = "\n\n".join(body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", page, re.S | re.M)
                       if lang == "python")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(2, 16, 8, 32)" in result.stdout and "a sliding window is not supported by ported_vanilla" in result.stdout
