"""Dispatch through jaxattn adds nothing: the compiled program is jax.nn's own.

Under ``jax.jit``, ``jaxattn.attention(..., impl="sdpa")`` (XLA on a CPU) and
``impl="cudnn"`` (on an NVIDIA GPU) must lower to the program a direct
``jax.nn.dot_product_attention`` call lowers to, and compile to the same HLO. Texts are
compared after removing what names the caller (module name, source locations, op
metadata); a negative control shows the comparison tells different programs apart.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import jaxattn

from ._devices import ON_CUDA


def canonical_stablehlo(text: str) -> str:
    return re.sub(r"^module @\S+", "module @m", text, flags=re.M)


def canonical_hlo(text: str) -> str:
    text = text.split("\n\nFileNames", 1)[0]  # the stack-frame tables name the callers
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)


def programs(fn: Callable[..., Any], *args: jax.ShapeDtypeStruct) -> tuple[str, str]:
    lowered = jax.jit(fn).lower(*args)
    compiled = lowered.compile().as_text()
    assert compiled is not None
    return canonical_stablehlo(lowered.as_text()), canonical_hlo(compiled)


def assert_same_program(ours: Callable[..., Any], theirs: Callable[..., Any], *args: jax.ShapeDtypeStruct) -> None:
    (ours_ir, ours_hlo), (their_ir, their_hlo) = programs(ours, *args), programs(theirs, *args)
    assert ours_ir == their_ir, "lowered programs differ"
    assert ours_hlo == their_hlo, "compiled programs differ"


def shapes(b: int, t: int, s: int, hq: int, hkv: int, d: int, dtype: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (
        jax.ShapeDtypeStruct((b, t, hq, d), dtype),
        jax.ShapeDtypeStruct((b, s, hkv, d), dtype),
        jax.ShapeDtypeStruct((b, s, hkv, d), dtype),
    )


# (T, S, Hq, Hkv, D, causal): jaxattn's causal; jax.nn gets what that means for its top-left rule.
CASES = [
    pytest.param(128, 128, 8, 8, 64, False, id="plain"),
    pytest.param(128, 128, 8, 2, 128, False, id="gqa-d128"),
    pytest.param(96, 96, 4, 1, 96, True, id="mqa-causal-d96"),
    pytest.param(1, 200, 8, 2, 64, True, id="decode-causal"),  # bottom-right: sees every key
    pytest.param(32, 160, 4, 4, 64, False, id="cross"),
]


def jax_nn_causal(t: int, causal: bool) -> bool:
    # jaxattn's bottom-right causal is jax.nn's is_causal for T == S, and no mask for T == 1.
    return causal and t > 1


def sdpa_implementation(t: int, s: int) -> str | None:
    # On CUDA sdpa takes cuDNN only where cuDNN's backward could follow (even T and S).
    if not ON_CUDA:
        return None
    return "cudnn" if t % 2 == 0 and s % 2 == 0 else "xla"


@pytest.mark.parametrize(("t", "s", "hq", "hkv", "d", "causal"), CASES)
def test_sdpa_is_jax_nn_on_this_host(t: int, s: int, hq: int, hkv: int, d: int, causal: bool) -> None:
    args = shapes(2, t, s, hq, hkv, d, jnp.bfloat16)
    assert_same_program(
        lambda q, k, v: jaxattn.attention(q, k, v, impl="sdpa", causal=causal),
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=jax_nn_causal(t, causal), implementation=sdpa_implementation(t, s)
        ),
        *args,
    )


def test_the_comparison_tells_programs_apart() -> None:
    args = shapes(2, 64, 64, 4, 4, 64, jnp.float32)
    with pytest.raises(AssertionError, match="differ"):
        assert_same_program(
            lambda q, k, v: jaxattn.attention(q, k, v, impl="sdpa", causal=True),
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
            *args,
        )
    with pytest.raises(AssertionError, match="differ"):
        assert_same_program(
            lambda q, k, v: jaxattn.attention(q, k, v, impl="sdpa", softmax_scale=0.3),
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
            *args,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU with cuDNN")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(("t", "s", "hq", "hkv", "d", "causal"), CASES)
def test_cudnn_is_jax_nn_cudnn(t: int, s: int, hq: int, hkv: int, d: int, causal: bool, dtype: Any) -> None:
    args = shapes(2, t, s, hq, hkv, d, dtype)
    assert_same_program(
        lambda q, k, v: jaxattn.attention(q, k, v, impl="cudnn", causal=causal),
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=jax_nn_causal(t, causal), implementation="cudnn"
        ),
        *args,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU with cuDNN")
def test_cudnn_gradient_is_jax_nn_cudnn_gradient() -> None:
    args = shapes(2, 256, 256, 8, 2, 128, jnp.bfloat16)

    def grad_of(attend: Callable[..., jax.Array]) -> Callable[..., Any]:
        return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))

    assert_same_program(
        grad_of(lambda q, k, v: jaxattn.attention(q, k, v, impl="cudnn", causal=True)),
        grad_of(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")),
        *args,
    )
