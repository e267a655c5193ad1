"""jaxattn-pallas's paged backends as a plugin: lazy registration, which name resolves where,
what "auto" picks on a TPU and in interpret mode, what is declined and why, and the decode
wrapper's own promises (exact float32/float16 terms, clamping under jit, num_seqs, the TPU
lowering).

The numerics of every case are the conformance suite's (``test_paged_conformance.py``); the
interpret-mode runs here are few (each compiles for seconds).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pa_kernel

import jaxattn
from jaxattn.backend.device import DeviceInfo
from jaxattn.discovery.plugins import registry
from jaxattn.errors import UnsupportedError
from jaxattn.selection.lookup import new_impl
from jaxattn.testing import oracle
from jaxattn_pallas.decode import rules as paged_decode_rules
from jaxattn_pallas.decode.impl import PallasPagedDecode
from jaxattn_pallas.decode.kernel import bf16_terms, paged_attention_decode
from jaxattn_pallas.ragged.impl import PallasRaggedPagedAttention
from jaxattn_vanilla.paged.impl import PagedReference

INTERPRET = jaxattn.AttentionMetadata(platform="tpu", interpret=True)
V5E = DeviceInfo(platform="tpu", device_kind="TPU v5 lite", tpu_generation="v5e")
V3 = DeviceInfo(platform="tpu", device_kind="TPU v3", tpu_generation="v3")
S = jax.ShapeDtypeStruct
I32 = jnp.int32


def _decode_call(b: int = 3, hq: int = 4, hkv: int = 2, d: int = 16, dtype: str = "float32", *, t: int = 1,
                 layout: str = "separate") -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A uniform call in the ragged form, as shapes."""
    pages = (b * 4 + 2, 4)
    cache: dict[str, Any] = (
        {"kv_pages": S((*pages, 2 * hkv, d), dtype)} if layout == "combined" else {}
    )
    k = None if layout == "combined" else S((*pages, hkv, d), dtype)
    args = (S((b * t, hq, d), dtype), k, k, S((b, 4), I32), S((b,), I32))
    return args, {"cu_q_lens": np.arange(b + 1, dtype=np.int32) * t, "num_seqs": np.asarray([b], np.int32),
                  "queries_per_seq": t, **cache}


# --- registration -----------------------------------------------------------------------


def test_registration_and_listing_import_no_kernel() -> None:
    # A fresh interpreter: this one has long imported the kernels.
    script = textwrap.dedent(
        """
        import sys
        import jaxattn_pallas.plugin
        assert "jax" not in sys.modules, "the entry-point module imported jax"
        import jaxattn
        rows = {(r.name, r.distribution): r for r in jaxattn.list_impls() if r.kind == "paged"}
        ragged = rows["ragged_page_attention_v3", "jaxattn-pallas"]
        decode = rows["page_attention", "jaxattn-pallas"]
        assert ragged.platforms == ("tpu",) and ragged.priority == 100, ragged
        assert ragged.aliases == ("ragged_page_attention_v2", "ragged_page_attention"), ragged
        assert decode.platforms == ("tpu",) and decode.priority == 50, decode
        assert rows["vanilla_paged", "jaxattn-vanilla"].priority == 0
        import jax, numpy as np
        q = jax.ShapeDtypeStruct((3, 4, 16), "float32")
        k = jax.ShapeDtypeStruct((14, 4, 2, 16), "float32")
        args = (q, k, k, jax.ShapeDtypeStruct((3, 4), "int32"), jax.ShapeDtypeStruct((3,), "int32"))
        kw = dict(cu_q_lens=np.arange(4, dtype=np.int32), num_seqs=np.asarray([3], np.int32), queries_per_seq=1)
        tpu = jaxattn.AttentionMetadata(platform="tpu")  # a TPU's checks (this host: only "no TPU here")
        for name in ("page_attention", "ragged_page_attention_v3"):
            reasons = jaxattn.get_impl(name, tpu).supports(*args, **kw)
            assert len(reasons) == 1 and "interpret=True" in reasons[0], (name, reasons)
        pallas = [m for m in sys.modules if m.startswith("jax.experimental.pallas")]
        assert not pallas, pallas
        # In interpret mode the ragged kernel's rules ask Pallas's own interpreter whether it
        # runs the kernel (jaxattn_pallas.ragged.rules.interpreter_runs_kernel): Pallas loads,
        # still no kernel.
        md = jaxattn.AttentionMetadata(platform="tpu", interpret=True)
        assert jaxattn.get_impl("page_attention", md).supports(*args, **kw) == []
        assert len(jaxattn.get_impl("ragged_page_attention_v2", md).supports(*args, **kw)) == 1
        explained = jaxattn.explain_paged(q, k, k, args[3], args[4], metadata=md)
        assert explained.chosen == "page_attention", explained
        kernels = [m for m in sys.modules if m.startswith("jax.experimental.pallas.ops")]
        assert not kernels, kernels
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_each_name_has_one_provider_per_platform() -> None:
    reg = registry()
    kernels = {"page_attention": PallasPagedDecode, "ragged_page_attention_v3": PallasRaggedPagedAttention,
               "ragged_page_attention_v2": PallasRaggedPagedAttention,
               "ragged_page_attention": PallasRaggedPagedAttention}
    for name, pallas in kernels.items():
        providers = reg.providers_of(name)
        assert all(not list(reg.conflicting(p)) for p in providers)
        tpu = reg.resolve(name, "tpu", None)
        assert tpu.origin == "jaxattn-pallas" and tpu.kind == "paged" and tpu.load() is pallas
        assert tpu.priority == pallas.priority  # the ImplRef agrees with the class
        assert reg.resolve(name, "cpu", None).origin == "jaxattn-vanilla"


def test_names_resolve_to_the_kernels_on_a_tpu_and_the_references_on_a_cpu() -> None:
    assert type(jaxattn.get_impl("page_attention", INTERPRET)) is PallasPagedDecode
    assert type(jaxattn.get_impl("ragged_page_attention_v2", INTERPRET)) is PallasRaggedPagedAttention
    assert type(jaxattn.get_impl("page_attention")) is PagedReference
    assert type(jaxattn.get_impl("ragged_page_attention_v3")) is PagedReference
    assert type(jaxattn.get_impl("vanilla_paged", INTERPRET)) is PagedReference
    # On a TPU host (as jaxattn sees it), both kernels take a plain decode step.
    md = jaxattn.AttentionMetadata()
    args, kw = _decode_call(dtype="bfloat16", layout="combined")
    for name, cls in (("page_attention", PallasPagedDecode), ("ragged_page_attention_v3", PallasRaggedPagedAttention)):
        impl = new_impl(name, md, V5E)
        assert type(impl) is cls and impl.platform == "tpu"
        assert impl.supports(*args, **kw) == []


# --- what "auto" picks ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeTpu:
    device_kind: str
    id: int = 0
    platform: str = "tpu"


@pytest.fixture
def fake_tpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], DeviceInfo]]:
    """``use(kind)`` makes jax report TPUs of ``kind``; restored afterwards."""

    def use(kind: str) -> DeviceInfo:
        monkeypatch.setattr(jax, "devices", lambda *a, **k: [FakeTpu(kind, i) for i in range(4)])
        return jaxattn.detect_device(refresh=True)

    yield use
    monkeypatch.undo()
    jaxattn.detect_device(refresh=True)


def _explain(metadata: jaxattn.AttentionMetadata | None = None, **changes: Any) -> jaxattn.Explanation:
    args, kw = _decode_call(**changes)
    q, k, v, table, lengths = args
    kv = {"kv_pages": kw["kv_pages"]} if "kv_pages" in kw else {}
    if kw["queries_per_seq"] != 1:
        b = table.shape[0]
        q = S((b, kw["queries_per_seq"], *q.shape[1:]), q.dtype)
    return jaxattn.explain_paged(q, k, v, table, lengths, metadata=metadata, **kv)


def test_auto_runs_the_ragged_kernel_first_on_a_tpu(fake_tpus: Callable[[str], DeviceInfo]) -> None:
    fake_tpus("TPU v5 lite")
    decode = _explain(dtype="bfloat16")
    assert decode.chosen == "ragged_page_attention_v3"
    ranked = [c.name for c in decode.candidates if c.accepted]
    assert ranked[:2] == ["ragged_page_attention_v3", "page_attention"]
    assert _explain(dtype="bfloat16", t=3).chosen == "ragged_page_attention_v3"  # page_attention declines T > 1
    # TPU v3: neither kernel (upstream runs both from v4); each says so.
    fake_tpus("TPU v3")
    rows = {c.name: c for c in _explain(dtype="bfloat16").candidates if c.origin == "jaxattn-pallas"}
    assert any("TPU v4 or newer" in r for r in rows["ragged_page_attention_v3"].reasons)
    assert any("TPU v4 or newer" in r for r in rows["page_attention"].reasons)


def test_auto_runs_page_attention_in_interpret_mode() -> None:
    explained = _explain(INTERPRET)
    assert explained.chosen == "page_attention"
    ragged = next(c for c in explained.candidates if c.name == "ragged_page_attention_v3" and c.here)
    assert len(ragged.reasons) == 1 and "interpret mode" in ragged.reasons[0]
    chosen = next(c for c in explained.candidates if c.chosen)
    assert any("copies the whole KV cache per call" in n for n in chosen.notes)


# --- declines -----------------------------------------------------------------------------


def test_page_attention_declines_what_its_kernel_lacks_with_a_way_out() -> None:
    impl = jaxattn.get_impl("page_attention", INTERPRET)
    args, kw = _decode_call(t=3)
    (reason,) = impl.supports(*args, **kw)
    assert "3 queries per sequence" in reason and "ragged_page_attention_v3" in reason
    assert "impl='vanilla_paged'" in reason
    args, kw = _decode_call()
    reasons = impl.supports(*args, **kw, sliding_window=2, softmax_aux=S((4,), "float32"))
    assert len(reasons) == 2
    assert "sliding window" in reasons[1] and "ragged_page_attention_v3" in reasons[1]
    assert "sinks" in reasons[0] and "jaxattn-vanilla" in reasons[0]
    ragged = dict(kw, cu_q_lens=np.asarray([0, 1, 3, 4], np.int32), queries_per_seq=None)
    (reason,) = impl.supports(S((4, 4, 16), "float32"), *args[1:], **ragged)
    assert "ragged batches" in reason and "impl='vanilla_paged'" in reason
    wide = jaxattn.get_impl("page_attention", INTERPRET.replace(softmax_dtype="float64"))
    assert any("softmax_dtype='float64'" in r for r in wide.supports(*args, **kw))
    # A call raises one error with every reason, before any kernel runs.
    q = jnp.zeros((3, 4, 16))
    cache = jnp.zeros((14, 4, 2, 16))
    with pytest.raises(UnsupportedError) as err:
        jaxattn.paged_attention(q[:, None].repeat(2, 1), cache, cache, jnp.zeros((3, 4), I32), jnp.ones((3,), I32),
                                sliding_window=1, impl=impl)
    assert len(err.value.reasons) == 2


def test_ragged_declines_with_reasons() -> None:
    args, kw = _decode_call(dtype="bfloat16", layout="combined")
    on_tpu = PallasRaggedPagedAttention(jaxattn.AttentionMetadata(), V5E)
    assert on_tpu.supports(*args, **kw) == []
    (sinks,) = on_tpu.supports(*args, **kw, softmax_aux=S((4,), "float32"))
    assert "sinks" in sinks and "impl='vanilla_paged'" in sinks
    half = _decode_call(dtype="float16")
    (dtype,) = on_tpu.supports(*half[0], **half[1])
    assert "float16" in dtype and "jaxattn-vanilla" in dtype
    (old,) = PallasRaggedPagedAttention(jaxattn.AttentionMetadata(), V3).supports(*args, **kw)
    assert "TPU v4 or newer" in old
    (interpret,) = jaxattn.get_impl("ragged_page_attention_v3", INTERPRET).supports(*args, **kw)
    assert "interpret mode of jax" in interpret and "'page_attention'" in interpret
    # Declared on a TPU only: on this CPU host without the override it is not the name's provider,
    # and built directly it says where it runs.
    (cpu,) = PallasRaggedPagedAttention().supports(*args, **kw)
    assert "runs on tpu" in cpu


def test_notes_say_what_each_call_copies() -> None:
    decode = PallasPagedDecode(INTERPRET)
    for dtype, layout, expect in (("float32", "separate", "split into 3 bfloat16 terms"),
                                  ("bfloat16", "combined", "de-interleaved from the combined layout")):
        args, kw = _decode_call(dtype=dtype, layout=layout)
        notes = decode.notes(decode.validate(*args, **kw).problem)
        assert "copies the whole KV cache per call" in notes[0] and expect in notes[0], notes
    ragged = PallasRaggedPagedAttention(jaxattn.AttentionMetadata(), V5E)
    for layout, d, expect in (("combined", 128, "reads the combined KV cache in place"),
                              ("separate", 128, "interleaved"), ("combined", 64, "zero-padded from 64 to 128")):
        args, kw = _decode_call(dtype="bfloat16", layout=layout, d=d, hkv=8, hq=8)
        (copy, _) = ragged.notes(ragged.validate(*args, **kw).problem)
        assert expect in copy, copy


# --- the decode wrapper -----------------------------------------------------------------------


def test_bf16_terms_carry_float32_and_float16() -> None:
    rng = np.random.default_rng(0)
    x32 = jnp.asarray(rng.standard_normal(4096) * 10.0 ** rng.integers(-6, 6, 4096), jnp.float32)
    total = sum(t.astype(jnp.float32) for t in reversed(bf16_terms(x32, 3)))
    np.testing.assert_array_equal(np.asarray(total), np.asarray(x32))
    x16 = jnp.clip(x32, -6e4, 6e4).astype(jnp.float16)
    total16 = sum(t.astype(jnp.float32) for t in reversed(bf16_terms(x16, 2)))
    np.testing.assert_array_equal(np.asarray(total16), np.asarray(x16.astype(jnp.float32)))
    assert all(t.dtype == jnp.bfloat16 for t in bf16_terms(x32, 3))
    # Non-finite values stay in the first term, and so does one past bfloat16's range (as inf).
    odd = jnp.asarray([jnp.inf, -jnp.inf, jnp.nan, 3.4e38], jnp.float32)
    hi, mid, lo = (np.asarray(t.astype(jnp.float32)) for t in bf16_terms(odd, 3))
    np.testing.assert_array_equal(hi[:3], np.asarray(odd)[:3])
    assert np.isinf(hi[3]) and not mid.any() and not lo.any()


def test_tilings() -> None:
    tiling = paged_decode_rules.paged_kernel_tiling(dtype="bfloat16", num_kv_heads=2, head_dim=128, v_head_dim=128,
                                                page_size=16, num_pages=100, pages_per_seq=64)
    assert (tiling.terms, tiling.head_dim, tiling.pages_per_compute_block, tiling.pages_per_seq) == (1, 128, 32, 64)
    assert tiling.cache_copy_bytes == 2 * 2 * 100 * 16 * 128 * 2
    # A prime table width is padded to whole blocks; float32 takes three terms, padded to 128 lanes.
    odd = paged_decode_rules.paged_kernel_tiling(dtype="float32", num_kv_heads=1, head_dim=40, v_head_dim=24,
                                               page_size=16, num_pages=9, pages_per_seq=37)
    assert (odd.terms, odd.head_dim, odd.pages_per_compute_block, odd.pages_per_seq) == (3, 128, 32, 64)
    small = paged_decode_rules.paged_kernel_tiling(dtype="float16", num_kv_heads=1, head_dim=100, v_head_dim=100,
                                                 page_size=4, num_pages=9, pages_per_seq=5,
                                                 pages_per_compute_block=2)
    assert (small.terms, small.head_dim, small.pages_per_compute_block, small.pages_per_seq) == (2, 256, 2, 6)
    with pytest.raises(ValueError, match="float64"):
        paged_decode_rules.paged_kernel_tiling(dtype="float64", num_kv_heads=1, head_dim=8, v_head_dim=8, page_size=4,
                                             num_pages=2, pages_per_seq=1)


def test_wrapper_clamps_bad_indices_under_jit_and_honours_num_seqs() -> None:
    # float16 (two bfloat16 terms), a value head dim of its own, a soft cap, and under jit: a
    # length past the table (clamped to it), table entries out of the pool (clamped into it),
    # a sequence of length 0 and a row past num_seqs (zeros).
    rng = np.random.default_rng(1)
    b, hq, hkv, d, dv, num_pages, page_size, per_seq = 4, 4, 1, 24, 8, 7, 4, 3
    q = rng.standard_normal((b, hq, d))
    k = rng.standard_normal((num_pages, page_size, hkv, d))
    v = rng.standard_normal((num_pages, page_size, hkv, dv))
    table = np.asarray([[2, -5, 99], [0, 1, 2], [6, 5, 4], [3, 3, 3]], np.int32)
    lengths = np.asarray([40, 0, 9, 5], np.int32)
    f16 = [np.asarray(jnp.asarray(x, jnp.float16).astype(jnp.float32), np.float64) for x in (q, k, v)]
    run = jax.jit(lambda *a: paged_attention_decode(*a, softmax_scale=0.4, logits_soft_cap=3.0, interpret=True))
    got = run(*(jnp.asarray(x, jnp.float16) for x in (q, k, v)), jnp.asarray(table), jnp.asarray(lengths),
              jnp.asarray([3], I32))
    assert got.shape == (b, hq, dv) and got.dtype == jnp.float16
    clamped = np.clip(table, 0, num_pages - 1)
    want = oracle.paged_attention(*f16, clamped, np.minimum(lengths, per_seq * page_size),
                                  np.arange(b + 1, dtype=np.int32), np.asarray([3], np.int32), softmax_scale=0.4,
                                  logits_soft_cap=3.0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=3e-3, rtol=3e-3)
    assert not np.asarray(got[1]).any() and not np.asarray(got[3]).any()
    assert np.asarray(got[0]).any() and np.asarray(got[2]).any()


def test_nothing_to_compute_gives_zeros_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any, **kwargs: Any) -> jax.Array:
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(pa_kernel, "paged_attention", never)
    z = jnp.zeros
    no_rows = paged_attention_decode(z((0, 2, 8)), z((3, 2, 1, 8)), z((3, 2, 1, 5)), z((0, 2), I32), z((0,), I32),
                                     softmax_scale=1.0)
    assert no_rows.shape == (0, 2, 5)
    no_pages = paged_attention_decode(jnp.ones((2, 2, 8)), z((3, 2, 1, 8)), z((3, 2, 1, 5)), z((2, 0), I32),
                                      z((2,), I32), softmax_scale=1.0)
    assert no_pages.shape == (2, 2, 5) and not no_pages.any()


def _lower_for_tpu(fn: Callable[..., jax.Array], *args: Any) -> str:
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return str(jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module())


@pytest.mark.parametrize(("dtype", "layout", "hq", "hkv", "d", "dv"), [
    ("bfloat16", "combined", 32, 8, 128, 128),
    ("float32", "separate", 8, 1, 64, 32),
])
def test_decode_wrapper_lowers_for_tpu(dtype: str, layout: str, hq: int, hkv: int, d: int, dv: int) -> None:
    # The real kernel, lowered to Mosaic for a TPU from this host, at serving-like sizes.
    def combined(q: jax.Array, kv: jax.Array, table: jax.Array, lengths: jax.Array) -> jax.Array:
        return paged_attention_decode(q, None, None, table, lengths, kv_pages=kv, softmax_scale=0.1,
                                      logits_soft_cap=30.0)

    def separate(q: jax.Array, k: jax.Array, v: jax.Array, table: jax.Array, lengths: jax.Array) -> jax.Array:
        return paged_attention_decode(q, k, v, table, lengths, softmax_scale=0.1)

    decode: Callable[..., jax.Array] = combined if layout == "combined" else separate
    caches = ([S((64, 16, 2 * hkv, d), dtype)] if layout == "combined"
              else [S((64, 16, hkv, d), dtype), S((64, 16, hkv, dv), dtype)])
    text = _lower_for_tpu(decode, S((8, hq, d), dtype), *caches, S((8, 40), I32), S((8,), I32))
    assert "tpu_custom_call" in text and "paged_flash_attention_kernel" in text


def test_the_advice_of_a_decline_runs_the_call() -> None:
    # Sinks: both kernels decline and point to jaxattn-vanilla's reference, by its own name
    # (under the TPU override the mechanism names resolve to the kernels); auto finds it too.
    rng = np.random.default_rng(2)
    q, cache = rng.standard_normal((3, 4, 16)), rng.standard_normal((14, 4, 2, 16))
    table, lengths, sinks = np.arange(12, dtype=np.int32).reshape(3, 4), np.asarray([3, 9, 16], np.int32), np.ones(4)
    args = (jnp.asarray(q, jnp.float32), jnp.asarray(cache, jnp.float32), jnp.asarray(cache, jnp.float32),
            jnp.asarray(table), jnp.asarray(lengths))
    with pytest.raises(UnsupportedError, match="impl='vanilla_paged'"):
        jaxattn.paged_attention(*args, softmax_aux=jnp.asarray(sinks, jnp.float32), impl="page_attention",
                                metadata=INTERPRET)
    want = oracle.paged_attention(q, cache, cache, table, lengths, np.arange(4, dtype=np.int32),
                                  np.asarray([3], np.int32), softmax_aux=sinks)
    for impl in ("vanilla_paged", "auto"):
        out = jaxattn.paged_attention(*args, softmax_aux=jnp.asarray(sinks, jnp.float32), impl=impl,
                                      metadata=INTERPRET)
        np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-5, rtol=1e-5)
