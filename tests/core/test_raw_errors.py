"""No raw Python errors from jaxattn's entry points: an unknown keyword argument is an
``InvalidInputError`` naming it with the closest names (not Python's ``TypeError``), a nonsense
ring option an ``InvalidInputError`` naming the option whoever runs the call (not "no installed
impl can accept"), and a scale that is no array an ``InvalidTypeError``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import InvalidInputError, InvalidTypeError

Q = jnp.zeros((1, 4, 2, 8), jnp.float32)
PAGES = jnp.zeros((4, 2, 2, 8), jnp.float32)
TABLE = np.asarray([[0, 1]], np.int32)
LENGTHS = np.asarray([4], np.int32)

UNKNOWN: dict[str, Callable[[], Any]] = {
    "attention": lambda: jaxattn.attention(Q, Q, Q, casual=True),
    "attention under jit": lambda: jax.jit(lambda q: jaxattn.attention(q, q, q, casual=True))(Q),
    "explain": lambda: jaxattn.explain(Q, Q, Q, casual=True),
    "impl call": lambda: jaxattn.get_impl("vanilla")(Q, Q, Q, casual=True),
    "auto call": lambda: jaxattn.get_impl("auto")(Q, Q, Q, casual=True),
    "supports": lambda: jaxattn.get_impl("vanilla").supports(Q, Q, Q, casual=True),
    "paged_attention": lambda: jaxattn.paged_attention(Q[:, 0], PAGES, PAGES, TABLE, LENGTHS, sliding_widow=2),
    "ragged_paged_attention": lambda: jaxattn.ragged_paged_attention(
        Q[0], PAGES, PAGES, TABLE, LENGTHS, np.asarray([0, 4], np.int32), 1, sliding_widow=2),
    "explain_paged": lambda: jaxattn.explain_paged(Q[:, 0], PAGES, PAGES, TABLE, LENGTHS, sliding_widow=2),
    "paged impl call": lambda: jaxattn.get_impl("vanilla_paged", kind="paged")(
        Q[0], PAGES, PAGES, TABLE, LENGTHS, cu_q_lens=np.asarray([0, 4], np.int32), num_seqs=1, sliding_widow=2),
}


@pytest.mark.parametrize("entry", list(UNKNOWN))
def test_an_unknown_keyword_names_itself_and_the_closest(entry: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        UNKNOWN[entry]()
    assert not isinstance(info.value, TypeError)
    typo, name = ("sliding_widow", "sliding_window") if "paged" in entry else ("casual", "causal")
    assert info.value.argument == typo
    assert f"did you mean '{name}'" in str(info.value)


def test_known_keywords_still_run() -> None:
    out = jaxattn.attention(Q, Q, Q, causal=True, softmax_scale=0.5)
    assert out.shape == Q.shape


@pytest.mark.parametrize(("option", "value"), [("ring_comm", "nonsense"), ("ring_layout", "diagonal"),
                                               ("ring_inputs", "shuffled")])
@pytest.mark.parametrize("mesh", [False, True], ids=["no mesh", "sequence mesh"])
@pytest.mark.parametrize("entry", ["attention", "jit", "explain"])
def test_a_nonsense_ring_option_is_an_input_error(option: str, value: str, mesh: bool, entry: str) -> None:
    axes: dict[str, Any] = {}
    if mesh:
        axes = {"mesh": jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("seq",)), "sequence_axis": "seq"}
    md = jaxattn.AttentionMetadata(extra={option: value}, **axes)
    run = {"attention": lambda: jaxattn.attention(Q, Q, Q, causal=True, metadata=md),
           "jit": lambda: jax.jit(lambda q: jaxattn.attention(q, q, q, causal=True, metadata=md))(Q),
           "explain": lambda: jaxattn.explain(Q, Q, Q, causal=True, metadata=md)}[entry]
    with pytest.raises(InvalidInputError, match=rf"metadata.extra\['{option}'\]: '{value}'") as info:
        run()
    assert type(info.value) is InvalidInputError  # not UnsupportedError's "no installed impl can accept"


@pytest.mark.parametrize("scale", [0.05, [0.05], (0.05, 0.05)], ids=["float", "list", "tuple"])
@pytest.mark.parametrize("quantized", [True, False], ids=["int8 cache", "float cache"])
def test_a_scale_that_is_no_array_is_a_type_error(scale: Any, quantized: bool) -> None:
    k = jnp.ones((1, 4, 2, 8), jnp.float32)
    good = None
    if quantized:
        k, good = jaxattn.quantize_kv(k, "int8")
    with pytest.raises(InvalidTypeError, match="k_scale: expected an array"):
        jaxattn.attention(Q[:, :1], k, k, k_scale=scale, v_scale=good)
