"""Every bad argument of the public entry points gets one ``InvalidInputError`` naming it.

A sweep of ``attention``, ``explain``, ``paged_attention``, ``ragged_paged_attention`` and
``get_impl``: wrong types, zero and negative sizes, huge ints, bools where numbers are expected,
non-finite scales, float arrays for lengths. A wrong type is an ``InvalidTypeError``, which
``except TypeError`` catches too. Arguments that are merely extreme (a window of ``10**12``,
NumPy arrays anywhere an array is taken) run, and give the float64 oracle's numbers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import AttentionMetadata, InvalidInputError
from jaxattn.errors import InvalidTypeError
from jaxattn.testing import oracle

_RNG = np.random.default_rng(0)
B, T, S, HQ, HKV, D = 2, 3, 6, 4, 2, 8


def _f32(*shape: int) -> np.ndarray:
    return _RNG.normal(size=shape).astype(np.float32)


Q, K, V = _f32(B, T, HQ, D), _f32(B, S, HKV, D), _f32(B, S, HKV, D)
LENGTHS = np.array([4, 6], np.int32)
PAGES_K, PAGES_V = _f32(6, 4, HKV, D), _f32(6, 4, HKV, D)
TABLE = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
Q_RAGGED = _f32(4, HQ, D)
CU = np.array([0, 1, 4], np.int32)


def _entry(fn: Callable[..., Any], positional: tuple[str, ...], base: dict[str, Any],
           change: dict[str, Any]) -> Callable[[], Any]:
    call = {**base, **change}
    args = [call[n] for n in positional]
    kwargs = {n: x for n, x in call.items() if n not in positional}
    return lambda: fn(*args, **kwargs)


_DENSE = {"q": Q, "k": K, "v": V}
_PAGED = {"q": Q[:, 0], "k_pages": PAGES_K, "v_pages": PAGES_V, "page_table": TABLE, "kv_lengths": LENGTHS}
_RAGGED = {**_PAGED, "q": Q_RAGGED, "cu_q_lens": CU, "num_seqs": 2}


def dense(**change: Any) -> Callable[[], Any]:
    return _entry(jaxattn.attention, ("q", "k", "v"), _DENSE, change)


def explain(**change: Any) -> Callable[[], Any]:
    return _entry(jaxattn.explain, ("q", "k", "v"), _DENSE, change)


def paged(**change: Any) -> Callable[[], Any]:
    return _entry(jaxattn.paged_attention, tuple(_PAGED), _PAGED, change)


def ragged(**change: Any) -> Callable[[], Any]:
    return _entry(jaxattn.ragged_paged_attention, tuple(_RAGGED), _RAGGED, change)


def get_impl(name: Any = "vanilla", **kwargs: Any) -> Callable[[], Any]:
    return lambda: jaxattn.get_impl(name, **kwargs)


def metadata(**fields: Any) -> Callable[[], Any]:
    return lambda: AttentionMetadata(**fields)


BAD_TYPE = InvalidTypeError
BAD_VALUE = InvalidInputError

# (label, the call, the argument the error must name, the error class)
CASES: list[tuple[str, Callable[[], Any], str, type[Exception]]] = [
    # -- attention ---------------------------------------------------------------------------
    ("q a string", dense(q="q"), "q", BAD_TYPE),
    ("q a list", dense(q=Q.tolist()), "q", BAD_TYPE),
    ("q integers", dense(q=Q.astype(np.int32)), "q", BAD_VALUE),
    ("D = 0", dense(q=Q[..., :0], k=K[..., :0], v=V[..., :0]), "q/k/v", BAD_VALUE),
    ("Dv = 0", dense(v=V[..., :0]), "q/k/v", BAD_VALUE),
    ("Hq = 0", dense(q=Q[:, :, :0]), "q/k/v", BAD_VALUE),
    ("T = 0", dense(q=Q[:, :0]), "q/k", BAD_VALUE),
    ("causal an int", dense(causal=1), "causal", BAD_TYPE),
    ("causal a string", dense(causal="yes"), "causal", BAD_TYPE),
    ("window a float", dense(sliding_window=2.5), "sliding_window", BAD_TYPE),
    ("window a bool", dense(sliding_window=True), "sliding_window", BAD_TYPE),
    ("window a string", dense(sliding_window="2"), "sliding_window", BAD_TYPE),
    ("window a triple", dense(sliding_window=(1, 2, 3)), "sliding_window", BAD_TYPE),
    ("window float sides", dense(sliding_window=(1.0, 0)), "sliding_window", BAD_TYPE),
    ("window negative", dense(sliding_window=(-1, 0)), "sliding_window", BAD_VALUE),
    ("scale a string", dense(softmax_scale="a"), "softmax_scale", BAD_TYPE),
    ("scale a bool", dense(softmax_scale=True), "softmax_scale", BAD_TYPE),
    ("scale a list", dense(softmax_scale=[0.5]), "softmax_scale", BAD_TYPE),
    ("scale an array", dense(softmax_scale=np.ones(2)), "softmax_scale", BAD_TYPE),
    ("scale inf", dense(softmax_scale=math.inf), "softmax_scale", BAD_VALUE),
    ("scale nan", dense(softmax_scale=math.nan), "softmax_scale", BAD_VALUE),
    ("scale past float", dense(softmax_scale=10**400), "softmax_scale", BAD_VALUE),
    ("dropout past float", dense(dropout_prob=10**400), "dropout_prob", BAD_VALUE),
    ("scale 0", dense(softmax_scale=0.0), "softmax_scale", BAD_VALUE),
    ("scale negative", dense(softmax_scale=-1), "softmax_scale", BAD_VALUE),
    ("cap inf", dense(logits_soft_cap=math.inf), "logits_soft_cap", BAD_VALUE),
    ("cap -inf", dense(logits_soft_cap=-math.inf), "logits_soft_cap", BAD_VALUE),
    ("cap nan", dense(logits_soft_cap=math.nan), "logits_soft_cap", BAD_VALUE),
    ("cap 0", dense(logits_soft_cap=0), "logits_soft_cap", BAD_VALUE),
    ("cap negative", dense(logits_soft_cap=-3.0), "logits_soft_cap", BAD_VALUE),
    ("cap a string", dense(logits_soft_cap="30"), "logits_soft_cap", BAD_TYPE),
    ("dropout a string", dense(dropout_prob="a"), "dropout_prob", BAD_TYPE),
    ("dropout a bool", dense(dropout_prob=True), "dropout_prob", BAD_TYPE),
    ("dropout 1", dense(dropout_prob=1.0), "dropout_prob", BAD_VALUE),
    ("dropout negative", dense(dropout_prob=-0.1), "dropout_prob", BAD_VALUE),
    ("dropout nan", dense(dropout_prob=math.nan), "dropout_prob", BAD_VALUE),
    ("dropout without rng", dense(dropout_prob=0.5), "dropout_rng", BAD_VALUE),
    ("rng an int", dense(dropout_prob=0.5, dropout_rng=3), "dropout_rng", BAD_TYPE),
    ("rng floats", dense(dropout_prob=0.5, dropout_rng=np.zeros(2, np.float32)), "dropout_rng", BAD_TYPE),
    ("rng a batch of keys", dense(dropout_prob=0.5, dropout_rng=jax.random.split(jax.random.key(0))),
     "dropout_rng", BAD_TYPE),
    ("lengths floats", dense(kv_lengths=LENGTHS.astype(np.float32)), "kv_lengths", BAD_VALUE),
    ("lengths bools", dense(kv_lengths=np.ones(B, bool)), "kv_lengths", BAD_VALUE),
    ("lengths a list", dense(kv_lengths=[4, 6]), "kv_lengths", BAD_TYPE),
    ("lengths an int", dense(kv_lengths=4), "kv_lengths", BAD_TYPE),
    ("lengths shape", dense(kv_lengths=LENGTHS[:1]), "kv_lengths", BAD_VALUE),
    ("lengths negative", dense(kv_lengths=np.array([-1, 6], np.int32)), "kv_lengths", BAD_VALUE),
    ("lengths huge", dense(kv_lengths=np.array([2**31 - 1, 6], np.int64)), "kv_lengths", BAD_VALUE),
    ("mask floats", dense(mask=np.ones((T, S), np.float32)), "mask", BAD_VALUE),
    ("mask a list", dense(mask=[[True]]), "mask", BAD_TYPE),
    ("mask a bool", dense(mask=True), "mask", BAD_TYPE),
    ("bias booleans", dense(bias=np.ones((T, S), bool)), "bias", BAD_VALUE),
    ("bias shape", dense(bias=np.ones((T + 1, S), np.float32)), "bias", BAD_VALUE),
    ("init_bias not callable", dense(init_bias=3), "init_bias", BAD_VALUE),
    ("sinks integers", dense(softmax_aux=np.zeros(HQ, np.int32)), "softmax_aux", BAD_VALUE),
    ("sinks shape", dense(softmax_aux=np.zeros(HKV, np.float32)), "softmax_aux", BAD_VALUE),
    ("sinks a list", dense(softmax_aux=[0.0] * HQ), "softmax_aux", BAD_TYPE),
    ("segment ids floats", dense(q_segment_ids=np.zeros((B, T)), kv_segment_ids=np.zeros((B, S))),
     "q_segment_ids", BAD_VALUE),
    ("impl an int", dense(impl=3), "impl", BAD_TYPE),
    ("impl paged", dense(impl="page_attention"), "impl", BAD_VALUE),
    ("metadata a dict", dense(metadata={"softmax_scale": 0.5}), "metadata", BAD_TYPE),
    ("metadata a string", dense(metadata="fast"), "metadata", BAD_TYPE),
    # -- explain -----------------------------------------------------------------------------
    ("explain D = 0", explain(q=Q[..., :0], k=K[..., :0], v=V[..., :0]), "q/k/v", BAD_VALUE),
    ("explain scale inf", explain(softmax_scale=math.inf), "softmax_scale", BAD_VALUE),
    ("explain scale a string", explain(softmax_scale="a"), "softmax_scale", BAD_TYPE),
    ("explain window a float", explain(sliding_window=1.5), "sliding_window", BAD_TYPE),
    ("explain impl an int", explain(impl=7), "impl", BAD_TYPE),
    ("explain metadata a dict", explain(metadata={}), "metadata", BAD_TYPE),
    ("explain rng an int", explain(dropout_prob=0.1, dropout_rng=1), "dropout_rng", BAD_TYPE),
    # -- paged_attention ---------------------------------------------------------------------
    ("paged q rank 2", paged(q=Q[:, 0, 0]), "q", BAD_VALUE),
    ("paged q a string", paged(q="q"), "q", BAD_TYPE),
    ("paged D = 0", paged(q=Q[:, 0, :, :0], k_pages=PAGES_K[..., :0], v_pages=PAGES_V[..., :0]),
     "q/k_pages/v_pages", BAD_VALUE),
    ("paged k_pages a string", paged(k_pages="k"), "k_pages", BAD_TYPE),
    ("paged table rows differ from B", paged(q=Q_RAGGED[:3]), "page_table", BAD_VALUE),
    ("paged table floats", paged(page_table=TABLE.astype(np.float32)), "page_table", BAD_VALUE),
    ("paged table a list", paged(page_table=TABLE.tolist()), "page_table", BAD_TYPE),
    ("paged lengths floats", paged(kv_lengths=LENGTHS.astype(np.float32)), "kv_lengths", BAD_VALUE),
    ("paged lengths past the table", paged(kv_lengths=np.array([4, 13], np.int32)), "kv_lengths", BAD_VALUE),
    ("paged window negative", paged(sliding_window=-1), "sliding_window", BAD_VALUE),
    ("paged window a float", paged(sliding_window=2.5), "sliding_window", BAD_TYPE),
    ("paged window a bool", paged(sliding_window=True), "sliding_window", BAD_TYPE),
    ("paged scale inf", paged(softmax_scale=math.inf), "softmax_scale", BAD_VALUE),
    ("paged scale a string", paged(softmax_scale="a"), "softmax_scale", BAD_TYPE),
    ("paged cap inf", paged(logits_soft_cap=math.inf), "logits_soft_cap", BAD_VALUE),
    ("paged cap nan", paged(logits_soft_cap=math.nan), "logits_soft_cap", BAD_VALUE),
    ("paged cap negative", paged(logits_soft_cap=-1.0), "logits_soft_cap", BAD_VALUE),
    ("paged sinks integers", paged(softmax_aux=np.zeros(HQ, np.int32)), "softmax_aux", BAD_VALUE),
    ("paged impl dense", paged(impl="vanilla"), "impl", BAD_VALUE),
    ("paged impl an int", paged(impl=1), "impl", BAD_TYPE),
    ("paged metadata a dict", paged(metadata={}), "metadata", BAD_TYPE),
    # -- ragged_paged_attention --------------------------------------------------------------
    ("ragged cu_q_lens floats", ragged(cu_q_lens=CU.astype(np.float32)), "cu_q_lens", BAD_VALUE),
    ("ragged cu_q_lens decreasing", ragged(cu_q_lens=np.array([0, 3, 1], np.int32)), "cu_q_lens", BAD_VALUE),
    ("ragged cu_q_lens past q", ragged(cu_q_lens=np.array([0, 1, 9], np.int32)), "cu_q_lens", BAD_VALUE),
    ("ragged num_seqs a float", ragged(num_seqs=2.0), "num_seqs", BAD_VALUE),
    ("ragged num_seqs a bool", ragged(num_seqs=True), "num_seqs", BAD_VALUE),
    ("ragged num_seqs negative", ragged(num_seqs=-1), "num_seqs", BAD_VALUE),
    ("ragged num_seqs past the table", ragged(num_seqs=3), "num_seqs", BAD_VALUE),
    ("ragged num_seqs huge", ragged(num_seqs=10**12), "num_seqs", BAD_VALUE),
    ("ragged num_seqs a float array", ragged(num_seqs=np.array([2.0])), "num_seqs", BAD_VALUE),
    ("ragged lengths floats", ragged(kv_lengths=LENGTHS.astype(np.float64)), "kv_lengths", BAD_VALUE),
    ("ragged window a string", ragged(sliding_window="4"), "sliding_window", BAD_TYPE),
    ("ragged scale nan", ragged(softmax_scale=math.nan), "softmax_scale", BAD_VALUE),
    ("ragged cap a bool", ragged(logits_soft_cap=True), "logits_soft_cap", BAD_TYPE),
    ("ragged metadata a string", ragged(metadata="x"), "metadata", BAD_TYPE),
    # -- get_impl ----------------------------------------------------------------------------
    ("get_impl name an int", get_impl(3), "name", BAD_TYPE),
    ("get_impl name None", get_impl(None), "name", BAD_TYPE),
    ("get_impl metadata a dict", get_impl("vanilla", metadata={}), "metadata", BAD_TYPE),
    ("get_impl kind unknown", get_impl("auto", kind="sparse"), "kind", BAD_VALUE),
    ("get_impl kind for a name", get_impl("vanilla", kind="dense-ish"), "kind", BAD_VALUE),
    ("get_impl kind an array", get_impl("auto", kind=np.array(["dense", "paged"])), "kind", BAD_VALUE),
    # -- AttentionMetadata -------------------------------------------------------------------
    ("metadata scale inf", metadata(softmax_scale=math.inf), "AttentionMetadata.softmax_scale",
     BAD_VALUE),
    ("metadata scale a string", metadata(softmax_scale="a"), "AttentionMetadata.softmax_scale",
     BAD_TYPE),
    ("metadata cap nan", metadata(logits_soft_cap=math.nan), "AttentionMetadata.logits_soft_cap",
     BAD_VALUE),
    ("metadata dropout a string", metadata(dropout_prob="x"), "AttentionMetadata.dropout_prob",
     BAD_TYPE),
]


@pytest.mark.parametrize(("call", "argument", "error"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_argument_gets_one_error_naming_it(call: Callable[[], Any], argument: str,
                                                 error: type[Exception]) -> None:
    with pytest.raises(InvalidInputError) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert info.value.argument == argument, str(info.value)
    assert str(info.value).startswith(f"{argument}: ")


def test_the_baseline_calls_run() -> None:
    """The sweep's calls with nothing changed run, so each error above is its argument's."""
    for call in (dense(), explain(), paged(), ragged(), get_impl()):
        call()


def test_a_wrong_type_is_also_a_type_error() -> None:
    with pytest.raises(TypeError, match="softmax_scale"):
        jaxattn.attention(Q, K, V, softmax_scale="a")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dropout_rng"):
        jaxattn.attention(Q, K, V, dropout_prob=0.5, dropout_rng=3)
    with pytest.raises(TypeError, match=r"^name: "):
        jaxattn.get_impl(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^impl: "):
        jaxattn.attention(Q, K, V, impl=3)  # type: ignore[arg-type]


def test_a_traced_scale_is_refused_as_not_static() -> None:
    with pytest.raises(InvalidTypeError, match=r"softmax_scale.*static"):
        jax.jit(lambda s: jaxattn.attention(Q, K, V, softmax_scale=s))(0.5)


# -- what is valid, however extreme, runs and gives the oracle's numbers -------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("window", [10**12, (10**12, 0), (0, 10**12), (2**40, 2**40)])
@pytest.mark.parametrize("lengths", [None, LENGTHS], ids=["full", "kv_lengths"])
def test_a_window_wider_than_any_sequence_is_unbounded(window: Any, lengths: Any, jit: bool) -> None:
    # OverflowError from jit before: sizes past int32 reached the kernels
    def call(q: Any, k: Any, v: Any) -> Any:
        extra = {} if lengths is None else {"kv_lengths": lengths}
        return jaxattn.attention(q, k, v, causal=True, sliding_window=window, **extra)

    got = (jax.jit(call) if jit else call)(Q, K, V)
    pair = (window, window) if isinstance(window, int) else window
    unbounded = (min(pair[0], S), min(pair[1], S))  # no query is S positions from a key
    want = oracle.attention(Q.astype(np.float64), K.astype(np.float64), V.astype(np.float64), causal=True,
                            sliding_window=unbounded, kv_lengths=lengths).output
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_a_clamped_window_is_the_problem_jaxattn_sees() -> None:
    spec = jaxattn.backend.validation.resolve_call(Q, K, V, sliding_window=(10**12, 1))
    assert spec.sliding_window == (S, 1)


@pytest.mark.parametrize("impl", ["vanilla_paged", "auto"])
def test_a_paged_window_wider_than_the_table_is_unbounded(impl: str) -> None:
    got = jaxattn.ragged_paged_attention(Q_RAGGED, PAGES_K, PAGES_V, TABLE, LENGTHS, CU, 2, sliding_window=10**12,
                                         impl=impl)
    want = oracle.paged_attention(Q_RAGGED, PAGES_K, PAGES_V, TABLE, LENGTHS, CU, np.array([2]))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    decode = jaxattn.paged_attention(Q[:, 0], PAGES_K, PAGES_V, TABLE, LENGTHS, sliding_window=2**40, impl=impl)
    want = oracle.paged_attention(Q[:, 0], PAGES_K, PAGES_V, TABLE, LENGTHS, np.array([0, 1, 2]), np.array([2]))
    np.testing.assert_allclose(np.asarray(decode), want, atol=2e-5)


# The dtypes a call tries, in order, with the tolerance against the float64 oracle: a name can reach a
# kernel that declines float32 on this platform (the Triton kernels on a GPU multiply it in TF32).
_DTYPES = (("float32", 2e-5), ("bfloat16", 5e-2))


def _first_accepted(run: Callable[[Callable[[Any], Any]], Any]) -> tuple[Any, float] | None:
    """``run(cast)``'s result in the first dtype the backend accepts, or None if it declines them all.

    A decline must be an ``UnsupportedError`` with reasons: NumPy inputs never cause a raw error.
    """
    declines = []
    for dtype, atol in _DTYPES:
        try:
            return run(lambda x, dtype=dtype: np.asarray(x).astype(jnp.dtype(dtype))), atol
        except jaxattn.UnsupportedError as err:
            declines.append(err)
    assert all(err.reasons for err in declines)
    return None


def _close(got: Any, want: Any, atol: float) -> None:
    np.testing.assert_allclose(np.asarray(got).astype(np.float64), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("impl", ["vanilla_paged", "page_attention", "ragged_page_attention_v3", "auto"])
def test_numpy_arrays_run_every_paged_entry_point_outside_jit(impl: str) -> None:
    """TracerArrayConversionError before: a kernel indexed a NumPy pool with traced rows."""
    ragged = _first_accepted(lambda c: jaxattn.ragged_paged_attention(
        c(Q_RAGGED), c(PAGES_K), c(PAGES_V), TABLE, LENGTHS, CU, 2, impl=impl, softmax_aux=np.zeros(HQ, np.float32)))
    if ragged is not None:
        want = oracle.paged_attention(Q_RAGGED, PAGES_K, PAGES_V, TABLE, LENGTHS, CU, np.array([2]),
                                      softmax_aux=np.zeros(HQ))
        _close(ragged[0], want, ragged[1])
    else:  # only page_attention may decline ragged batches (on a GPU it is the uniform Triton kernel)
        assert impl == "page_attention"
    decode = _first_accepted(lambda c: jaxattn.paged_attention(c(Q[:, :2]), c(PAGES_K), c(PAGES_V), TABLE, LENGTHS,
                                                               impl=impl))
    assert decode is not None, f"{impl} declined a decode call in every dtype"
    want = oracle.paged_attention(Q[:, :2].reshape(2 * B, HQ, D), PAGES_K, PAGES_V, TABLE, LENGTHS,
                                  np.array([0, 2, 4]), np.array([2]))
    _close(np.asarray(decode[0]).reshape(2 * B, HQ, D), want, decode[1])


@pytest.mark.parametrize("impl", ["vanilla", "blockwise", "sdpa", "autoregressive_decodeattn", "auto"])
def test_numpy_arrays_run_every_dense_impl(impl: str) -> None:
    mask = np.tril(np.ones((T, S), bool), S - T)
    got = _first_accepted(lambda c: jaxattn.attention(c(Q[:, :1]), c(K), c(V), impl=impl, causal=True,
                                                      kv_lengths=LENGTHS, softmax_aux=np.full(HQ, 0.5, np.float32)))
    assert got is not None, f"{impl} declined a decode call in every dtype"
    want = oracle.attention(Q[:, :1], K, V, causal=True, kv_lengths=LENGTHS, softmax_aux=np.full(HQ, 0.5)).output
    _close(got[0], want, got[1])
    if impl != "autoregressive_decodeattn":  # a decode kernel: T = 1 only
        full = _first_accepted(lambda c: jaxattn.attention(c(Q), c(K), c(V), impl=impl, mask=mask))
        assert full is not None, f"{impl} declined a masked call in every dtype"
        _close(full[0], oracle.attention(Q, K, V, mask=mask).output, full[1])


def test_jnp_scalars_and_numpy_ints_are_numbers() -> None:
    want = jaxattn.attention(Q, K, V, causal=True, sliding_window=(2, 0), softmax_scale=0.3)
    numpy_window: Any = (np.int64(2), np.int32(0))
    got = jaxattn.attention(Q, K, V, causal=np.bool_(True), sliding_window=numpy_window,  # type: ignore[arg-type]
                            softmax_scale=jnp.float32(0.3))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_paged_attention_names_what_the_caller_passed() -> None:
    """A page table whose rows differ from q's B named ``cu_q_lens`` before, which
    paged_attention builds itself."""
    with pytest.raises(InvalidInputError) as info:
        jaxattn.paged_attention(Q_RAGGED[:3], PAGES_K, PAGES_V, TABLE, LENGTHS)
    assert info.value.argument == "page_table" and "cu_q_lens" not in str(info.value)
    assert "2 rows" in str(info.value) and "3 sequences" in str(info.value)


def test_an_impl_name_from_the_environment_or_a_scope_says_where_it_came_from(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXATTN_IMPL", "nonexistent")
    for call in (dense(), explain(), paged(), ragged()):
        with pytest.raises(jaxattn.ImplNotFoundError,
                           match=r"^\$JAXATTN_IMPL='nonexistent': unknown attention impl 'nonexistent'"):
            call()
    jaxattn.attention(Q, K, V, impl="vanilla")  # an explicit name wins over the environment
    monkeypatch.setenv("JAXATTN_IMPL", "vanilla")
    dense()()
    monkeypatch.delenv("JAXATTN_IMPL")
    with jaxattn.use_impl("nothing_here"), pytest.raises(jaxattn.ImplNotFoundError,
                                                         match=r"^use_impl\('nothing_here'\): unknown"):
        dense()()


_ODD: tuple[Any, ...] = (-1, 2**40, 10**400, 1.5, math.nan, True, "a", [1], (1, 2, 3), object(), np.array([1, 2]),
                         jax.random.key(0), 1j)
_DENSE_KEYWORDS = ("q", "mask", "bias", "init_bias", "causal", "sliding_window", "q_segment_ids", "softmax_scale",
                   "logits_soft_cap", "softmax_aux", "dropout_prob", "dropout_rng", "kv_lengths", "metadata", "impl")
_PAGED_KEYWORDS = ("q", "k_pages", "page_table", "kv_lengths", "sliding_window", "softmax_scale", "logits_soft_cap",
                   "softmax_aux", "impl", "metadata", "kv_pages")
_RAGGED_KEYWORDS = ("cu_q_lens", "num_seqs")


@pytest.mark.parametrize(("entry", "keyword"), [(dense, n) for n in _DENSE_KEYWORDS]
                         + [(paged, n) for n in _PAGED_KEYWORDS] + [(ragged, n) for n in _RAGGED_KEYWORDS])
def test_odd_values_of_every_keyword_run_or_raise_a_jaxattn_error(entry: Callable[..., Callable[[], Any]],
                                                                  keyword: str) -> None:
    """No raw Python or JAX exception from any keyword, whatever its value."""
    extra = {"dropout_prob": 0.5} if keyword == "dropout_rng" else {}
    for value in _ODD:
        with contextlib.suppress(jaxattn.JaxattnError):
            entry(**{keyword: value, **extra})()
