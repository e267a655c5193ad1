"""jaxattn-triton's serving backends as a plugin: lazy registration, which name resolves where,
what each accepts on an H100 and what it declines (with reasons that say what runs instead),
which kernel a call runs, the dispatch path by name (``jaxattn.paged_attention``,
``ragged_paged_attention``, ``attention(kv_lengths=...)``), and flash_attn2's kv_lengths.

The numerics of the conformance matrix are ``test_serving_conformance``'s; the kernel runs
here (through the Triton interpreter) are a few targeted ones.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backend import Backend
from jaxattn.backend.device import DeviceInfo
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.backend.problem import AttentionProblem, PagedProblem
from jaxattn.backend.validation import resolve_call
from jaxattn.discovery.plugins import isolated_registry, registry
from jaxattn.errors import UnsupportedError
from jaxattn.selection.lookup import new_impl
from jaxattn.testing import oracle
from jaxattn_triton.decode import ops as decode_ops
from jaxattn_triton.decode.impl import MAX_DECODE_QUERIES, TritonDecodeAttention
from jaxattn_triton.flash import impl as impl_module
from jaxattn_triton.flash.impl import TritonFlashAttention
from jaxattn_triton.paged import ops as paged_ops
from jaxattn_triton.paged.impl import TritonPagedDecode, TritonRaggedPagedAttention

from ._env import needs_interpreter
from ._serving import LOG2_WARNING, paged_problem

H100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
T4 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="Tesla T4", compute_capability="7.5")
CPU = DeviceInfo(platform="cpu")
MD = AttentionMetadata()
S = jax.ShapeDtypeStruct
I32 = jnp.int32
PAGED: dict[str, type[Backend[Any]]] = {
    "page_attention": TritonPagedDecode, "ragged_page_attention_v3": TritonRaggedPagedAttention,
    "ragged_page_attention_v2": TritonRaggedPagedAttention, "ragged_page_attention": TritonRaggedPagedAttention,
}  # fmt: skip
def _dense(**kw: Any) -> AttentionProblem:
    base: dict[str, Any] = {
        "batch": 16, "seq_q": 1, "seq_k": 8192, "heads_q": 32, "heads_kv": 8, "head_dim": 128, "head_dim_v": 128,
        "dtype": "bfloat16", "causal": True,
    }  # fmt: skip
    base.update(kw)
    return AttentionProblem(**base)


# --- registration -------------------------------------------------------------------------


def test_registration_and_listing_import_no_kernel_library() -> None:
    # A fresh interpreter: this one has long imported the kernels.
    script = textwrap.dedent(
        """
        import sys
        import jaxattn_triton.plugin
        assert "jax" not in sys.modules, "the entry-point module imported jax"
        import jaxattn
        rows = {(r.name, r.distribution): r for r in jaxattn.list_impls()}
        ragged = rows["ragged_page_attention_v3", "jaxattn-triton"]
        decode = rows["page_attention", "jaxattn-triton"]
        dense = rows["autoregressive_decodeattn", "jaxattn-triton"]
        assert (ragged.kind, ragged.platforms, ragged.priority) == ("paged", ("cuda",), 100), ragged
        assert ragged.aliases == ("ragged_page_attention_v2", "ragged_page_attention"), ragged
        assert (decode.kind, decode.platforms, decode.priority) == ("paged", ("cuda",), 100), decode
        assert (dense.kind, dense.platforms, dense.priority) == ("dense", ("cuda",), 100), dense
        import jaxattn_triton.decode.impl, jaxattn_triton.paged.impl
        bad = [m for m in ("triton", "jax_triton", "torch") if m in sys.modules]
        assert not bad, bad
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_names_resolve_to_the_triton_classes_on_cuda() -> None:
    reg = registry()
    backends: dict[str, type[Backend[Any]]] = {**PAGED, "autoregressive_decodeattn": TritonDecodeAttention}
    for name, cls in backends.items():
        cuda = reg.resolve(name, "gpu", "cuda")
        assert cuda.origin == "jaxattn-triton" and cuda.load() is cls, cuda
        assert cuda.kind == cls.kind and cuda.priority == cls.priority == 100
        assert all(not list(reg.conflicting(p)) for p in reg.providers_of(name))
        impl = new_impl(name, MD, H100)
        assert type(impl) is cls and (impl.platform, impl.vendor) == ("gpu", "cuda")
    for name in PAGED:  # on a CPU the names stay jaxattn-vanilla's references
        assert reg.resolve(name, "cpu", None).origin == "jaxattn-vanilla"


def test_declines_on_a_cpu_with_the_platform() -> None:
    for cls, problem in ((TritonPagedDecode, paged_problem()), (TritonRaggedPagedAttention, paged_problem()),
                         (TritonDecodeAttention, _dense())):
        reasons = cls(MD, CPU).not_supported_reasons(problem)  # type: ignore[arg-type]
        assert any("cuda" in r and "cpu" in r for r in reasons), reasons


# --- what they accept on an H100 -----------------------------------------------------------


@pytest.mark.usefixtures("kernels_installed")
@pytest.mark.parametrize(
    "problem",
    [
        paged_problem(),
        paged_problem(kv_layout="combined", page_size=64),
        paged_problem(queries_per_seq=4, num_tokens=64, sliding_window=(1024, 0), logits_soft_cap=30.0,
                      sinks=True),
        paged_problem(heads_q=8, heads_kv=8, head_dim=256, head_dim_v=256, dtype="float16", page_size=5),
        paged_problem(head_dim=192, head_dim_v=64, heads_kv=1),
    ],
)
def test_paged_backends_accept_uniform_calls_on_an_h100(problem: PagedProblem) -> None:
    for cls in (TritonPagedDecode, TritonRaggedPagedAttention):
        assert cls(MD, H100).not_supported_reasons(problem) == [], cls


@pytest.mark.usefixtures("kernels_installed")
def test_ragged_batches_run_on_ragged_page_attention_only() -> None:
    ragged = paged_problem(queries_per_seq=None, num_tokens=700, sliding_window=(128, 0), sinks=True,
                           logits_soft_cap=50.0)
    assert TritonRaggedPagedAttention(MD, H100).not_supported_reasons(ragged) == []
    reasons = TritonPagedDecode(MD, H100).not_supported_reasons(ragged)
    assert any("ragged_page_attention_v3 runs them" in r for r in reasons), reasons
    # The advice for a ragged batch is the ragged kernel, not the reference.
    assert not any("vanilla_paged" in r for r in reasons if "ragged batches" in r), reasons


@pytest.mark.usefixtures("kernels_installed")
@pytest.mark.parametrize(
    ("problem", "metadata", "expected"),
    [
        (paged_problem(dtype="float32"), MD, "TF32"),
        (paged_problem(dtype="float64"), MD, "float64"),
        (paged_problem(head_dim=320, head_dim_v=320), MD, "320"),
        (paged_problem(), AttentionMetadata(softmax_dtype="bfloat16"), "softmax_dtype"),
        (paged_problem(needs_grad=True), MD, "forward only"),
    ],
)
def test_paged_declines_with_a_reason(problem: PagedProblem, metadata: AttentionMetadata, expected: str) -> None:
    for cls in (TritonPagedDecode, TritonRaggedPagedAttention):
        reasons = cls(metadata, H100).not_supported_reasons(problem)
        assert any(expected in r for r in reasons), reasons
        if expected != "forward only":  # the reference runs these: each reason says how to reach it
            assert all("impl='vanilla_paged'" in r for r in reasons), reasons


def test_paged_declines_without_jax_triton_and_on_old_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(impl_module, "_installed", lambda module: module != "jax_triton")
    for cls in (TritonPagedDecode, TritonRaggedPagedAttention):
        reasons = cls(MD, T4).not_supported_reasons(paged_problem())
        assert any("pip install 'jax-triton" in r for r in reasons), reasons
        assert any("7.5" in r for r in reasons), reasons


@pytest.mark.usefixtures("kernels_installed")
def test_decode_accepts_its_features_on_an_h100() -> None:
    impl = TritonDecodeAttention(MD, H100)
    problem = _dense(
        seq_q=MAX_DECODE_QUERIES, heads_q=32, heads_kv=1, head_dim=96, head_dim_v=64, sliding_window=(1024, 0),
        logits_soft_cap=30.0, sinks=True, kv_lengths=True, needs_grad=True,
    )  # fmt: skip
    assert impl.not_supported_reasons(problem) == []
    assert impl.not_supported_reasons(_dense(causal=False, seq_q=3, sliding_window=(4, 2), dtype="float16")) == []


@pytest.mark.usefixtures("kernels_installed")
@pytest.mark.parametrize(
    ("problem", "metadata", "expected"),
    [
        (_dense(seq_q=MAX_DECODE_QUERIES + 1), MD, "flash_attn2 or cudnn run longer queries"),
        (_dense(mask_shape=(16, 1, 1, 8192)), MD, "reads no mask; flash_attn2 runs it"),
        (_dense(bias_shape=(1, 32, 1, 8192)), MD, "reads no bias; flash_attn2 runs it"),
        (_dense(segment_ids=True), MD, "reads no segment ids; flash_attn2 runs it"),
        (_dense(dropout_prob=0.1), MD, "impl='vanilla' runs it"),
        (_dense(dtype="float32"), MD, "TF32"),
        (_dense(), AttentionMetadata(softmax_dtype="float16"), "softmax_dtype"),
        (_dense(needs_grad=True), AttentionMetadata(block_q_bwd=48), "powers of two"),
    ],
)
def test_decode_declines_with_a_reason(problem: AttentionProblem, metadata: AttentionMetadata, expected: str) -> None:
    reasons = TritonDecodeAttention(metadata, H100).not_supported_reasons(problem)
    assert any(expected in r for r in reasons), reasons


@pytest.mark.usefixtures("kernels_installed")
def test_decode_tile_overrides_only_bind_the_backward() -> None:
    # The split-K forward tiles itself; a backward tile override declines only differentiated calls.
    impl = TritonDecodeAttention(AttentionMetadata(block_k_bwd=40), H100)
    assert impl.not_supported_reasons(_dense()) == []
    assert impl.grad_reasons(_dense()) != []


@pytest.mark.usefixtures("kernels_installed")
def test_flash_attn2_takes_kv_lengths_on_its_decode_path_only() -> None:
    impl = TritonFlashAttention(MD, H100)
    assert impl.not_supported_reasons(_dense(kv_lengths=True, needs_grad=True, sinks=True)) == []
    assert impl.not_supported_reasons(_dense(kv_lengths=True, seq_k=1)) == []
    for problem in (_dense(kv_lengths=True, seq_q=3), _dense(kv_lengths=True, mask_shape=(16, 1, 1, 8192)),
                    _dense(kv_lengths=True, segment_ids=True)):
        reasons = impl.not_supported_reasons(problem)
        assert any("split-K decode path" in r and "autoregressive_decodeattn" in r for r in reasons), reasons
    assert impl.not_supported_reasons(_dense(seq_q=3, seq_k=40, mask_shape=(16, 1, 3, 40))) == []


# --- kernels behind the forwards (interpreter) ----------------------------------------------


def _interpreted(cls: type[Backend[Any]]) -> Any:
    from .test_serving_conformance import InterpretedDecode, InterpretedPagedDecode, InterpretedRaggedPaged

    interpreted: dict[type[Backend[Any]], type[Backend[Any]]] = {
        TritonPagedDecode: InterpretedPagedDecode, TritonRaggedPagedAttention: InterpretedRaggedPaged,
        TritonDecodeAttention: InterpretedDecode,
    }  # fmt: skip
    return interpreted[cls]


def _cache(rng: np.random.Generator, seqs: int, kv_lens: tuple[int, ...], *, hq: int = 4, hkv: int = 2,
           d: int = 16, page_size: int = 4) -> dict[str, np.ndarray]:
    pages_per_seq = -(-max(kv_lens) // page_size) + 1
    num_pages = seqs * pages_per_seq + 2
    return {
        "k": rng.standard_normal((num_pages, page_size, hkv, d)),
        "v": rng.standard_normal((num_pages, page_size, hkv, d)),
        "table": rng.permutation(num_pages)[: seqs * pages_per_seq].reshape(seqs, pages_per_seq).astype(np.int32),
        "lens": np.asarray(kv_lens, np.int32),
        "hq": np.asarray(hq),
    }


def _f32(x: np.ndarray) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in ("paged_decode", "ragged_paged"):
        original = getattr(paged_ops, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(paged_ops, name, counted)
    return calls


@needs_interpreter
@pytest.mark.filterwarnings(LOG2_WARNING)
@pytest.mark.parametrize("cls", [TritonRaggedPagedAttention, TritonPagedDecode])
def test_uniform_calls_run_paged_decode_and_rows_past_num_seqs_are_zero(
    cls: type[Backend[Any]], kernel_calls: list[str]
) -> None:
    rng = np.random.default_rng(0)
    c = _cache(rng, 3, (9, 14, 5))
    t = 2
    q = rng.standard_normal((3 * t, 4, 16))
    cu = np.arange(4, dtype=np.int32) * t
    impl = _interpreted(cls)(MD)
    args = (_f32(q), _f32(c["k"]), _f32(c["v"]), jnp.asarray(c["table"]), jnp.asarray(c["lens"]))
    # Two of the table's three sequences are real: the third's rows are zeros.
    out = impl(*args, cu_q_lens=jnp.asarray(cu), num_seqs=jnp.asarray([2], I32), queries_per_seq=t,
               sliding_window=6)
    assert kernel_calls == ["paged_decode"]
    want = oracle.paged_attention(q, c["k"], c["v"], c["table"], c["lens"], cu, np.asarray([2]), sliding_window=6)
    np.testing.assert_allclose(np.asarray(out.attention_outputs), want, atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(out.attention_outputs)[2 * t:] == 0.0)


@needs_interpreter
@pytest.mark.filterwarnings(LOG2_WARNING)
def test_ragged_calls_run_ragged_paged(kernel_calls: list[str]) -> None:
    rng = np.random.default_rng(1)
    c = _cache(rng, 3, (9, 14, 5))
    cu = np.asarray([0, 4, 5, 7], np.int32)
    q = rng.standard_normal((8, 4, 16))  # one padding row
    impl = _interpreted(TritonRaggedPagedAttention)(MD)
    out = impl(_f32(q), _f32(c["k"]), _f32(c["v"]), jnp.asarray(c["table"]), jnp.asarray(c["lens"]),
               cu_q_lens=jnp.asarray(cu), num_seqs=jnp.asarray([3], I32))
    assert kernel_calls == ["ragged_paged"]
    want = oracle.paged_attention(q, c["k"], c["v"], c["table"], c["lens"], cu, np.asarray([3]))
    np.testing.assert_allclose(np.asarray(out.attention_outputs), want, atol=2e-5, rtol=2e-5)


@pytest.fixture
def interpreted_registered() -> Iterator[None]:
    """The interpreted classes registered for the CPU, above jaxattn-vanilla's references, in a
    registry of their own: the names then resolve to them, as the real ones do on a GPU."""
    with isolated_registry():
        for cls in (TritonPagedDecode, TritonRaggedPagedAttention, TritonDecodeAttention):
            jaxattn.register_impl(_interpreted(cls))
        yield


@needs_interpreter
@pytest.mark.filterwarnings(LOG2_WARNING)
@pytest.mark.usefixtures("interpreted_registered")
def test_the_dispatch_path_by_name_under_jit() -> None:
    rng = np.random.default_rng(2)
    c = _cache(rng, 3, (9, 14, 1), hq=8, hkv=2)
    q = rng.standard_normal((3, 8, 16))
    sinks = rng.standard_normal(8)
    k, v, table, lens = _f32(c["k"]), _f32(c["v"]), jnp.asarray(c["table"]), jnp.asarray(c["lens"])
    assert type(jaxattn.get_impl("page_attention", kind="paged")).__name__ == "InterpretedPagedDecode"

    @jax.jit
    def decode(q: jax.Array, sinks: jax.Array) -> Any:
        return jaxattn.paged_attention(q, k, v, table, lens, impl="page_attention", softmax_aux=sinks,
                                       logits_soft_cap=2.0)

    @jax.jit
    def ragged(q: jax.Array, cu: jax.Array, n: jax.Array) -> Any:
        return jaxattn.ragged_paged_attention(q, k, v, table, lens, cu, n, impl="ragged_page_attention_v2")

    cu = np.arange(4, dtype=np.int32)
    want = oracle.paged_attention(q, c["k"], c["v"], c["table"], c["lens"], cu, np.asarray([3]), softmax_aux=sinks,
                                  logits_soft_cap=2.0)
    np.testing.assert_allclose(np.asarray(decode(_f32(q), _f32(sinks))), want, atol=2e-5, rtol=2e-5)
    want = oracle.paged_attention(q, c["k"], c["v"], c["table"], c["lens"], cu, np.asarray([3]))
    got = ragged(_f32(q), jnp.asarray(cu), jnp.asarray([3], I32))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    # "auto" ranks the Triton backends (100) above the references (0).
    assert jaxattn.explain_paged(_f32(q), k, v, table, lens).chosen == "page_attention"


@needs_interpreter
@pytest.mark.filterwarnings(LOG2_WARNING)
@pytest.mark.usefixtures("interpreted_registered")
def test_paged_attention_hands_the_kernel_its_lengths_unmasked(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every row of paged_attention's table is a sequence: masking rows past num_seqs would be a
    # launch before the kernel (docs/bench.md), so the caller's lengths go in as they are. A
    # count of fewer rows is still masked (test_uniform_calls_run_paged_decode_and_rows_...).
    lengths_seen: list[Any] = []
    original = paged_ops.paged_decode

    def spy(q: Any, k: Any, v: Any, table: Any, lengths: Any, **kw: Any) -> Any:
        lengths_seen.append(lengths)
        return original(q, k, v, table, lengths, **kw)

    monkeypatch.setattr(paged_ops, "paged_decode", spy)
    rng = np.random.default_rng(4)
    c = _cache(rng, 3, (9, 14, 1), hq=8, hkv=2)
    q = rng.standard_normal((3, 8, 16))
    k, v, table, lens = _f32(c["k"]), _f32(c["v"]), jnp.asarray(c["table"]), jnp.asarray(c["lens"])
    out = jaxattn.paged_attention(_f32(q), k, v, table, lens, impl="page_attention")
    assert len(lengths_seen) == 1 and lengths_seen[0] is lens
    want = oracle.paged_attention(q, c["k"], c["v"], c["table"], c["lens"], np.arange(4), np.asarray([3]))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)


@needs_interpreter
@pytest.mark.filterwarnings(LOG2_WARNING)
@pytest.mark.usefixtures("interpreted_registered")
def test_dense_decode_by_name_with_kv_lengths_and_gradients_under_x64() -> None:
    rng = np.random.default_rng(3)
    b, t, s, hq, hkv, d = 3, 2, 21, 4, 1, 16
    q, k, v = (rng.standard_normal(sh) for sh in ((b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d)))
    dout = rng.standard_normal((b, t, hq, d))
    lens = np.asarray([21, 1, 6])
    kw: dict[str, Any] = {"causal": True, "sliding_window": (4, 0), "logits_soft_cap": 2.0}

    with jax.enable_x64(True):  # int64 lengths, as x64 code makes them
        def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
            out = jaxattn.attention(q, k, v, impl="autoregressive_decodeattn",
                                    kv_lengths=jnp.asarray(lens, jnp.int64), **kw)
            return jnp.sum(out * _f32(dout)), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            _f32(q), _f32(k), _f32(v))
    ref = oracle.attention(q, k, v, kv_lengths=lens, **kw)
    np.testing.assert_allclose(np.asarray(out), ref.output, atol=1e-4, rtol=1e-4)
    want = oracle.attention_backward(q, k, v, dout, kv_lengths=lens, **kw)
    for name, g, w in zip(("dq", "dk", "dv"), grads, (want.dq, want.dk, want.dv), strict=True):
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-4, rtol=2e-4, err_msg=name)


@needs_interpreter
@pytest.mark.filterwarnings(LOG2_WARNING)
def test_a_right_window_past_the_cache_still_cuts_queries_before_its_start() -> None:
    # T = 9 queries over S = 4 keys, not causal, window (1, 5): query 0 sits at position -5 and
    # sees key 0 only. A right window >= S is not "unbounded" when queries precede the cache.
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(sh) for sh in ((1, 9, 2, 16), (1, 4, 1, 16), (1, 4, 1, 16)))
    impl = _interpreted(TritonDecodeAttention)(MD)
    got = impl(_f32(q), _f32(k), _f32(v), sliding_window=(1, 5)).attention_outputs
    want = oracle.attention(q, k, v, sliding_window=(1, 5)).output
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


@needs_interpreter
@pytest.mark.filterwarnings(LOG2_WARNING)
@pytest.mark.parametrize(("s", "lens"), [(1, (0, 1)), (30, (30, 7))], ids=["S1", "S30"])
def test_flash_attn2_runs_kv_lengths_through_dense_decode_with_gradients(
    s: int, lens: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # S == 1 too: a cache of one position (whose length may be 0) takes the decode path.
    from .test_conformance import InterpretedTritonFlash

    calls: list[Any] = []
    original = decode_ops.decode_with_flash_grad

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[3])
        return original(*args, **kwargs)

    monkeypatch.setattr(decode_ops, "decode_with_flash_grad", counted)
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(sh) for sh in ((2, 1, 4, 16), (2, s, 2, 16), (2, s, 2, 16)))
    dout = rng.standard_normal((2, 1, 4, 16))
    sinks = rng.standard_normal(4)
    lengths = np.asarray(lens)
    impl = InterpretedTritonFlash(MD)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array) -> tuple[jax.Array, Any]:
        res = impl(q, k, v, causal=True, kv_lengths=jnp.asarray(lengths), softmax_aux=sinks)
        return jnp.sum(res.attention_outputs * _f32(dout)), res

    (_, res), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        _f32(q), _f32(k), _f32(v), _f32(sinks))
    assert len(calls) == 1 and calls[0] is not None, "flash_attn2 did not take the decode path with kv_lengths"
    kw: dict[str, Any] = {"causal": True, "kv_lengths": lengths, "softmax_aux": sinks}
    ref = oracle.attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(res.attention_outputs), ref.output, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(res.softmax_lse), ref.lse, atol=1e-4, rtol=1e-4)
    want = oracle.attention_backward(q, k, v, dout, **kw)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, (want.dq, want.dk, want.dv, want.dsoftmax_aux),
                          strict=True):
        assert w is not None
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-4, rtol=2e-4, err_msg=name)


def test_direct_forwards_never_drop_what_they_cannot_run() -> None:
    q, k = jnp.zeros((1, 3, 2, 16)), jnp.zeros((1, 8, 1, 16))
    with pytest.raises(NotImplementedError, match="reads no mask"):
        TritonDecodeAttention(MD, H100).forward_cuda(resolve_call(q, k, k, mask=jnp.ones((1, 1, 3, 8), bool),
                                                                   prepare=True))
    with pytest.raises(NotImplementedError, match="split-K decode path"):
        TritonFlashAttention(MD, H100).forward_cuda(resolve_call(q, k, k, kv_lengths=jnp.asarray([4]), prepare=True))


@pytest.mark.usefixtures("kernels_installed")
def test_calls_are_declined_before_any_kernel_runs() -> None:
    # On a CPU host the registered classes decline with UnsupportedError, every reason at once.
    q = jnp.zeros((2, 1, 4, 16), jnp.float32)
    k = jnp.zeros((2, 8, 2, 16), jnp.float32)
    with pytest.raises(UnsupportedError) as info:
        TritonDecodeAttention(MD, CPU)(q, k, k, kv_lengths=jnp.asarray([3, 8]), mask=jnp.ones((2, 1, 1, 8), bool))
    reasons = info.value.reasons
    for expected in ("this platform is cpu", "TF32", "reads no mask"):
        assert sum(expected in r for r in reasons) == 1, reasons
