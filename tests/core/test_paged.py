"""The paged op kind in the core: validation, entry points, choosing within a kind, registry rules."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import Feature, InvalidInputError, PagedAttentionImpl, PluginError, UnsupportedError
from jaxattn.discovery.plugins import isolated_registry
from jaxattn.testing import oracle
from jaxattn_vanilla.paged.impl import PagedReference

from .toy_impls import PlainImpl


class DecodeOnly(PagedReference):
    """A paged backend for T queries per sequence (no ragged batch), as a decode kernel is."""

    features: ClassVar = PagedReference.features - {Feature.RAGGED}
    priority: ClassVar[int] = 5

    @classmethod
    def get_impl_name(cls) -> str:
        return "page_decode"


@pytest.fixture(autouse=True)
def paged_registry() -> Any:
    # Float32 products at full precision: on a GPU jax's default is TF32, and these tests check
    # the math against the float64 oracle.
    with isolated_registry(discover=False), jax.default_matmul_precision("highest"):
        for impl in (PagedReference, DecodeOnly, PlainImpl):
            jaxattn.register_impl(impl)
        yield


def cache(num_pages: int = 8, page_size: int = 4, hkv: int = 2, d: int = 8, seed: int = 0) -> tuple[Any, Any]:
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.normal(size=(num_pages, page_size, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(num_pages, page_size, hkv, d)), jnp.float32)
    return k, v


def ragged_args(**over: Any) -> dict[str, Any]:
    k, v = cache()
    args = {
        "q": jnp.ones((5, 4, 8), jnp.float32),
        "k_pages": k, "v_pages": v,
        "page_table": jnp.asarray([[3, 1, 0], [5, 2, 7]], jnp.int32),
        "kv_lengths": jnp.asarray([9, 6], jnp.int32),
        "cu_q_lens": jnp.asarray([0, 3, 5], jnp.int32),
        "num_seqs": 2,
    }
    args.update(over)
    return args


def call_ragged(**over: Any) -> Any:
    a = ragged_args(**over)
    return jaxattn.ragged_paged_attention(a.pop("q"), a.pop("k_pages"), a.pop("v_pages"), a.pop("page_table"),
                                         a.pop("kv_lengths"), a.pop("cu_q_lens"), a.pop("num_seqs"), **a)


def test_ragged_call_matches_the_oracle_and_reads_the_right_pages() -> None:
    a = ragged_args(q=jnp.asarray(np.random.default_rng(1).normal(size=(5, 4, 8)), jnp.float32))
    got = call_ragged(q=a["q"])
    want = oracle.paged_attention(*(np.asarray(a[n]) for n in ("q", "k_pages", "v_pages", "page_table",
                                                               "kv_lengths", "cu_q_lens")), np.asarray([2]))
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize(("over", "argument", "words"), [
    ({"page_table": jnp.asarray([[3, 9, 0], [5, 2, 7]], jnp.int32)}, "page_table", "page_table[0, 1] = 9"),
    ({"kv_lengths": jnp.asarray([13, 6], jnp.int32)}, "kv_lengths", "outside 0..12"),
    ({"kv_lengths": jnp.asarray([-1, 6], jnp.int32)}, "kv_lengths", "outside 0..12"),
    ({"cu_q_lens": jnp.asarray([0, 4, 3], jnp.int32)}, "cu_q_lens", "must not decrease"),
    ({"cu_q_lens": jnp.asarray([1, 3, 5], jnp.int32)}, "cu_q_lens", "must start at 0"),
    ({"cu_q_lens": jnp.asarray([0, 3, 6], jnp.int32)}, "cu_q_lens", "exceeds the 5 query rows"),
    ({"num_seqs": 3}, "num_seqs", "the page table has 2 rows"),
    ({"q": jnp.ones((5, 3, 8), jnp.float32)}, "q", "not a multiple of Hkv=2"),
    ({"q": jnp.ones((5, 4, 16), jnp.float32)}, "k_pages", "head dim 8 differs from q's 16"),
    ({"q": jnp.ones((1, 5, 4, 8), jnp.float32)}, "q", "rank 3"),
    ({"q": jnp.ones((5, 4, 8), jnp.bfloat16)}, "k_pages", "differs from q's bfloat16"),
    ({"kv_lengths": jnp.asarray([9, 6, 1], jnp.int32)}, "kv_lengths", "shape (2,)"),
    ({"page_table": jnp.asarray([[3, 1, 0], [5, 2, 7]], jnp.float32)}, "page_table", "integers"),
    ({"kv_pages": jnp.ones((8, 4, 4, 8))}, "kv_pages", "not both"),
])
def test_bad_input_names_the_argument_the_constraint_and_a_way_out(over: dict[str, Any], argument: str,
                                                                   words: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        call_ragged(**over)
    assert info.value.argument == argument and words in str(info.value)


def test_under_jit_values_cannot_be_checked_and_bad_pages_are_clamped_not_read_out_of_bounds() -> None:
    a = ragged_args(page_table=jnp.asarray([[3, 1, 0], [5, 70, 7]], jnp.int32))  # 70: a bad allocator

    @jax.jit
    def step(q: Any, table: Any, lengths: Any) -> Any:
        return jaxattn.ragged_paged_attention(q, a["k_pages"], a["v_pages"], table, lengths, a["cu_q_lens"], 2)

    out = step(a["q"], a["page_table"], a["kv_lengths"])
    assert np.isfinite(np.asarray(out)).all()
    with pytest.raises(InvalidInputError, match="page_table"):  # the same values, concrete: checked
        call_ragged(page_table=a["page_table"])


def test_decode_form_takes_rank_3_and_rank_4_queries() -> None:
    k, v = cache()
    table, lengths = jnp.asarray([[3, 1, 0], [5, 2, 7]], jnp.int32), jnp.asarray([9, 6], jnp.int32)
    q = jnp.asarray(np.random.default_rng(2).normal(size=(2, 4, 8)), jnp.float32)
    one = jaxattn.paged_attention(q, k, v, table, lengths)
    assert one.shape == (2, 4, 8)
    four = jaxattn.paged_attention(q[:, None], k, v, table, lengths)
    np.testing.assert_allclose(four[:, 0], one, atol=1e-6)
    want = oracle.paged_attention(np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(table),
                                  np.asarray(lengths), np.arange(3) * 1, np.asarray([2]))
    np.testing.assert_allclose(one, want, atol=2e-5)
    with pytest.raises(InvalidInputError, match="q: must have shape"):
        jaxattn.paged_attention(q[0], k, v, table, lengths)


def test_names_resolve_to_paged_impls_and_kinds_do_not_mix() -> None:
    for name in ("ragged_page_attention_v2", "ragged_page_attention"):  # EasyDeL's names of this op
        impl = jaxattn.get_impl(name)
        assert isinstance(impl, PagedAttentionImpl) and impl.name() == "vanilla_paged"
    assert isinstance(jaxattn.get_impl("auto", kind="paged"), PagedAttentionImpl)
    q = jnp.ones((1, 4, 4, 8))
    with pytest.raises(InvalidInputError, match="is a paged impl; attention\\(\\) runs dense ones"):
        jaxattn.attention(q, q, q, impl="page_decode")
    with pytest.raises(InvalidInputError, match="not a paged one"):
        call_ragged(impl="plain")
    with pytest.raises(InvalidInputError, match="kind"):
        jaxattn.get_impl("auto", kind="sparse")


def test_use_impl_applies_to_calls_of_its_kind() -> None:
    from jaxattn.selection.dispatch import current_impl_name

    with jaxattn.use_impl("plain"):
        assert current_impl_name(None, "dense") == "plain"
        assert current_impl_name(None, "paged") == "auto"
        call_ragged()  # a dense scope does not break a paged call
    with jaxattn.use_impl("page_decode"):
        assert current_impl_name(None, "paged") == "page_decode"
        assert current_impl_name(None, "dense") == "auto"
        with pytest.raises(UnsupportedError, match="ragged batches"):  # it applies, and page_decode declines
            call_ragged()


def test_explicit_choice_declines_with_every_reason_and_names_who_accepts() -> None:
    with pytest.raises(UnsupportedError) as info:
        call_ragged(impl="page_decode", softmax_aux=jnp.zeros(4))
    err = info.value
    assert any("ragged batches" in r for r in err.reasons)
    assert err.hint is not None and "vanilla_paged" in err.hint


def test_auto_picks_within_the_kind_and_explain_shows_only_paged_impls() -> None:
    k, v = cache()
    table, lengths = jnp.asarray([[3, 1, 0], [5, 2, 7]], jnp.int32), jnp.asarray([9, 6], jnp.int32)
    decode = jaxattn.explain_paged(jnp.ones((2, 4, 8)), k, v, table, lengths)
    assert {c.name for c in decode.candidates} == {"vanilla_paged", "page_decode"}
    assert decode.chosen == "page_decode" and "paged:" in str(decode)
    a = ragged_args()
    ragged = jaxattn.explain_paged(a["q"], k, v, table, lengths, a["cu_q_lens"], 2)
    assert ragged.chosen == "vanilla_paged"  # the decode-only backend declines a ragged batch
    assert any("ragged batches" in r for c in ragged.candidates if c.name == "page_decode" for r in c.reasons)


class TpuPageAttention(PagedReference):
    """Another platform's provider of a mechanism name, as jaxattn-pallas' page_attention is."""

    platforms: ClassVar = frozenset({"tpu"})
    priority: ClassVar[int] = 50

    @classmethod
    def get_impl_name(cls) -> str:
        return "page_attention"


def test_explain_by_name_shows_the_provider_that_serves_the_name_here() -> None:
    # The TPU kernel registers page_attention first; on this CPU the name is vanilla_paged's alias,
    # and an explicit choice must explain (and the bench time) that one, not "nothing can run".
    k, v = cache()
    table, lengths = jnp.asarray([[3, 1, 0], [5, 2, 7]], jnp.int32), jnp.asarray([9, 6], jnp.int32)
    with isolated_registry(discover=False):
        jaxattn.register_impl(TpuPageAttention)
        jaxattn.register_impl(PagedReference)
        explained = jaxattn.explain_paged(jnp.ones((2, 4, 8)), k, v, table, lengths, impl="page_attention")
        assert explained.requested == "page_attention" and explained.chosen == "vanilla_paged"
        assert [c.name for c in explained.candidates if c.chosen] == ["vanilla_paged"]
        tpu = jaxattn.explain_paged(jnp.ones((2, 4, 8)), k, v, table, lengths, impl="page_attention",
                                    metadata=jaxattn.AttentionMetadata(platform="tpu", interpret=True))
        assert tpu.chosen == "page_attention"


class Recording(PagedReference):
    """The reference, keeping every call its forward receives."""

    calls: ClassVar[list[Any]] = []

    @classmethod
    def get_impl_name(cls) -> str:
        return "page_recording"

    def forward_native(self, call: Any) -> Any:
        Recording.calls.append(call)
        return super().forward_native(call)


def test_a_known_num_seqs_stays_known_where_the_arrays_are_traced() -> None:
    # paged_attention's count is every row of the table; a kernel may then skip masking rows
    # past num_seqs (a launch of its own on a GPU). A traced count must never claim that.
    jaxattn.register_impl(Recording)
    Recording.calls.clear()
    a = ragged_args()
    k, v, table, lengths = a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"]
    q = jnp.ones((2, 4, 8), jnp.float32)
    eager = jaxattn.paged_attention(q, k, v, table, lengths, impl="page_recording")
    jitted = jax.jit(lambda q: jaxattn.paged_attention(q, k, v, table, lengths, impl="page_recording"))(q)
    want = oracle.paged_attention(np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(table),
                                  np.asarray(lengths), np.arange(3), np.asarray([2]))
    for out in (eager, jitted):  # jit may round differently from eager (a GPU's fusions): the oracle's tolerance
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
    first, second = Recording.calls
    assert isinstance(second.q, jax.core.Tracer)  # under jit and the custom VJP that refuses gradients
    assert [(c.static_num_seqs, c.problem.num_seqs) for c in (first, second)] == [(2, 2), (2, 2)]  # every row

    Recording.calls.clear()
    cu, one = jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray([1], jnp.int32)
    jaxattn.ragged_paged_attention(q, k, v, table, lengths, cu, one, impl="page_recording")
    jax.jit(lambda n: jaxattn.ragged_paged_attention(q, k, v, table, lengths, cu, n, impl="page_recording"))(one)
    assert [(c.static_num_seqs, c.problem.num_seqs) for c in Recording.calls] == [(1, 2), (None, 2)]


def test_paged_calls_are_forward_only_and_refuse_gradients_with_a_reason() -> None:
    a = ragged_args()

    def loss(q: Any) -> Any:
        out = jaxattn.ragged_paged_attention(q, a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"],
                                             a["cu_q_lens"], 2, impl="ragged_page_attention_v3")
        return jnp.sum(out)

    with pytest.raises(UnsupportedError) as info:
        jax.grad(loss)(a["q"])
    assert info.value.gradient and any("gradients" in r for r in info.value.reasons)


def test_a_mesh_shards_paged_calls_over_heads_only() -> None:
    # Head sharding on 8 devices: tests/sharding/multidevice/check_paged.py.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(UnsupportedError, match="shards only the KV heads"):
        call_ragged(metadata=jaxattn.AttentionMetadata(mesh=mesh, batch_axis="data"))
    sharded = call_ragged(metadata=jaxattn.AttentionMetadata(mesh=mesh, head_axis="data"))
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(call_ragged()))


def test_a_name_means_one_kind_of_call() -> None:
    class DenseNamedLikePaged(PlainImpl):
        priority: ClassVar[int] = 77

        @classmethod
        def get_impl_name(cls) -> str:
            return "page_attention"  # an alias of the paged reference

    with pytest.raises(PluginError, match=r"page_attention names a (dense|paged) impl .* and a (paged|dense) impl"):
        jaxattn.register_impl(DenseNamedLikePaged)


def test_a_directly_constructed_reference_runs_on_its_own() -> None:
    impl = PagedReference()
    a = ragged_args()
    out = impl(a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["kv_lengths"], cu_q_lens=a["cu_q_lens"],
               num_seqs=jnp.asarray([2], jnp.int32))
    np.testing.assert_allclose(out.attention_outputs, call_ragged(), atol=1e-6)
    assert Feature.RAGGED in impl.features and Feature.RAGGED not in DecodeOnly.features


def poisoned_cache(value: float) -> tuple[Any, Any]:
    """``cache()`` with every position ``ragged_args``' call never reads set to ``value``: rows
    of a last page at and past the length, the page listed past sequence 1's last one, and
    the pages no sequence lists."""
    k, v = (np.array(x) for x in cache())
    for x in (k, v):
        x[0, 1:] = value  # sequence 0 (9 tokens in pages 3, 1, 0): page 0 holds token 8 only
        x[2, 2:] = value  # sequence 1 (6 tokens in pages 5, 2): page 2 holds tokens 4 and 5
        x[[7, 4, 6]] = value  # listed past sequence 1's last page; never listed
    return jnp.asarray(k), jnp.asarray(v)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("form", ["ragged", "decode"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_unread_cache_positions_may_hold_any_bit_pattern(value: float, form: str, jit: bool) -> None:
    a = ragged_args(q=jnp.asarray(np.random.default_rng(1).normal(size=(5, 4, 8)), jnp.float32))
    if form == "decode":  # one query per sequence: T = 1
        a.update(q=a["q"][:2], cu_q_lens=jnp.asarray([0, 1, 2], jnp.int32))
    clean = cache()
    k, v = poisoned_cache(value)
    want = oracle.paged_attention(np.asarray(a["q"]), *(np.asarray(x) for x in clean), np.asarray(a["page_table"]),
                                  np.asarray(a["kv_lengths"]), np.asarray(a["cu_q_lens"]), np.asarray([2]))

    def run(q: Any, k: Any, v: Any) -> Any:
        if form == "decode":
            return jaxattn.paged_attention(q, k, v, a["page_table"], a["kv_lengths"])
        return jaxattn.ragged_paged_attention(q, k, v, a["page_table"], a["kv_lengths"], a["cu_q_lens"], 2)

    got = np.asarray((jax.jit(run) if jit else run)(a["q"], k, v))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("form", ["ragged", "decode"])
def test_infinite_sinks_take_the_whole_mass_or_nothing(form: str) -> None:
    a = ragged_args(q=jnp.asarray(np.random.default_rng(1).normal(size=(5, 4, 8)), jnp.float32))
    if form == "decode":
        a.update(q=a["q"][:2], cu_q_lens=jnp.asarray([0, 1, 2], jnp.int32))
    aux = jnp.asarray([np.inf, 0.5, -np.inf, 1.0], jnp.float32)
    got = np.asarray(call_ragged(softmax_aux=aux, **{n: a[n] for n in ("q", "cu_q_lens")}))
    want = oracle.paged_attention(*(np.asarray(a[n]) for n in ("q", "k_pages", "v_pages", "page_table",
                                                               "kv_lengths", "cu_q_lens")), np.asarray([2]),
                                  softmax_aux=np.asarray(aux))
    assert np.isfinite(got).all() and not got[:, 0].any()
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("w", [0, 1, 3])
def test_a_window_of_w_shows_the_query_and_the_w_keys_before_it(w: int) -> None:
    """One sequence of 9 tokens, V one-hot by position: each output row is the probabilities
    over positions, so the keys a query sees are the positions its row puts mass on. A pair
    ``(w, right)`` is the same window: paged calls are causal, so ``right`` hides nothing more."""
    k, _ = cache()
    v = jnp.zeros((8, 4, 2, 12), jnp.float32)
    table = jnp.asarray([[3, 1, 0]], jnp.int32)
    for pos in range(9):  # token pos lives in page table[0, pos // 4], row pos % 4
        v = v.at[int(table[0, pos // 4]), pos % 4, :, pos].set(1.0)
    q = jnp.asarray(np.random.default_rng(4).normal(size=(3, 4, 8)), jnp.float32)  # positions 6, 7, 8

    def seen(window: Any) -> np.ndarray:
        out = jaxattn.ragged_paged_attention(q, k, v, table, jnp.asarray([9], jnp.int32), jnp.asarray([0, 3]), 1,
                                             sliding_window=window)
        return np.asarray(out) > 0  # (rows, heads, positions)

    for row, pos in enumerate((6, 7, 8)):
        want = np.zeros(12, bool)
        want[max(0, pos - w): pos + 1] = True  # w + 1 keys: the query's own position and w before it
        assert (seen(w)[row] == want).all(), (row, seen(w)[row, 0])
    for right in (0, 2):
        np.testing.assert_array_equal(seen((w, right)), seen(w))


# -- sliding_window: the call holds the dense call's (left, right) pair ----------------------

class _WindowSeen(PagedAttentionImpl):
    """A windowed paged backend that records the ``sliding_window`` its forward receives (on the
    call and on its problem), and the problem's its hooks are asked about."""

    features: ClassVar = frozenset({Feature.GQA, Feature.SLIDING_WINDOW, Feature.MULTI_TOKEN, Feature.RAGGED})
    seen: ClassVar[list[Any]] = []
    asked: ClassVar[list[tuple[str, Any]]] = []

    def forward(self, call: Any) -> Any:
        type(self).seen.append((call.sliding_window, call.problem.sliding_window))
        return jaxattn.backend.AttentionOutput(attention_outputs=jnp.zeros((*call.q.shape[:2], 8), call.q.dtype))


class PairWindow(_WindowSeen):
    window_pair = True

    @classmethod
    def get_impl_name(cls) -> str:
        return "pair_window"

    def not_supported_reasons(self, problem: Any) -> list[str]:
        type(self).asked.append(("reasons", problem.sliding_window))
        window = problem.sliding_window
        return super().not_supported_reasons(problem) + ([] if window is None or window[0] <= 8 else ["wide"])


class IntWindow(_WindowSeen):
    """The compatibility form: hooks and forward written against the int left window, as third-party
    backends were before the problem held the pair."""

    window_pair = False

    @classmethod
    def get_impl_name(cls) -> str:
        return "int_window"

    def not_supported_reasons(self, problem: Any) -> list[str]:
        type(self).asked.append(("reasons", problem.sliding_window))
        window = problem.sliding_window  # an int compared as one: a pair here would raise TypeError
        wide = [] if window is None or window <= 8 else [f"a window of {window} keys is wider than 8"]
        return super().not_supported_reasons(problem) + wide + self.notes(problem)[1:]  # a hook calling a hook

    def notes(self, problem: Any) -> list[str]:
        type(self).asked.append(("notes", problem.sliding_window))
        return [f"window {problem.sliding_window}"]


class UnsaidWindow(_WindowSeen):
    @classmethod
    def get_impl_name(cls) -> str:
        return "unsaid_window"


@pytest.mark.parametrize(("window", "want"), [(3, (3, 0)), ((3, 0), (3, 0)), ((3, 5), (3, 0)), (10**12, (12, 0))])
def test_a_paged_call_holds_the_window_as_a_left_zero_pair(window: Any, want: tuple[int, int]) -> None:
    """Right is 0 whatever the caller gives (queries are causal); left is clamped to the 3 pages
    of 4 tokens a sequence holds. The problem keeps the left window."""
    a = ragged_args(num_seqs=np.asarray([2], np.int32), sliding_window=window)
    arrays = [a.pop(n) for n in ("q", "k_pages", "v_pages", "page_table", "kv_lengths")]
    call = PagedReference().validate(*arrays, **a)
    assert call.sliding_window == want and call.problem.sliding_window == want


@pytest.mark.parametrize(("impl_cls", "want"), [(PairWindow, (3, 0)), (IntWindow, 3)])
def test_a_windowed_paged_backend_reads_the_form_it_declares(impl_cls: type[_WindowSeen], want: Any) -> None:
    """On the call and on its problem, in the forward and in the hooks the class overrides."""
    jaxattn.register_impl(impl_cls)
    impl_cls.seen.clear()
    impl_cls.asked.clear()
    call_ragged(sliding_window=3, impl=impl_cls.get_impl_name())
    call_ragged(impl=impl_cls.get_impl_name())
    assert impl_cls.seen == [(want, want), (None, None)]
    assert {w for hook, w in impl_cls.asked if hook == "reasons"} == {want, None}
    assert {w for _, w in impl_cls.asked} == {want, None}  # IntWindow's notes, called by its reasons, too


def test_an_int_window_backend_declines_and_explains_in_its_own_form() -> None:
    """``window_pair = False``: auto, ``explain_paged`` and ``supports`` ask its hooks about the int
    left window (its comparisons run), while the problem that ``explain`` reports keeps the pair."""
    jaxattn.register_impl(IntWindow)
    a = ragged_args(sliding_window=(12, 0))
    arrays = [a.pop(n) for n in ("q", "k_pages", "v_pages", "page_table", "kv_lengths")]
    cu, n = a.pop("cu_q_lens"), np.asarray([a.pop("num_seqs")], np.int32)
    ex = jaxattn.explain_paged(*arrays, cu, n, impl="int_window", **a)
    (cand,) = [c for c in ex.candidates if c.name == "int_window"]
    assert cand.reasons == ("a window of 12 keys is wider than 8",) and ex.problem.sliding_window == (12, 0)
    assert IntWindow().supports(*arrays, cu_q_lens=cu, num_seqs=n, **a) == ["a window of 12 keys is wider than 8"]
    with pytest.raises(UnsupportedError, match="a window of 12 keys is wider than 8"):
        call_ragged(sliding_window=12, impl="int_window")
    narrow = jaxattn.explain_paged(*arrays, cu, n, impl="int_window", sliding_window=5)
    assert narrow.chosen == "int_window" and "window 5" in next(c for c in narrow.candidates if c.chosen).notes


def test_a_windowed_paged_backend_that_says_no_form_is_refused_when_registered() -> None:
    from jaxattn.backend import DeclarationError

    with pytest.raises(DeclarationError, match=r"Feature.SLIDING_WINDOW but not which call.sliding_window.*"
                       r"window_pair = True for the \(left, 0\) pair, or window_pair = False"):
        jaxattn.register_impl(UnsaidWindow)
