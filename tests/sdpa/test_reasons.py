"""What ``cudnn`` and ``sdpa`` decline, and why, for GPUs this host does not have.

Impls take a ``DeviceInfo``, so an H100, an A100 or a T4 is described rather than needed;
the cuDNN version is patched in (on this host jax has no CUDA plugin, which is itself a
reason that one test checks).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backend.device import DeviceInfo
from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.backend.problem import AttentionProblem
from jaxattn.backend.validation import resolve_call
from jaxattn.errors import ImplNotFoundError
from jaxattn_sdpa import impl as impl_module
from jaxattn_sdpa.impl import CudnnAttention, SdpaAttention

from ._devices import A100, H100, ON_CUDA, T4


def sds(*shape: int, dtype: Any = jnp.bfloat16) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


QKV = tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]


def qkv(b: int = 2, t: int = 8, s: int = 8, hq: int = 4, hkv: int = 2, d: int = 64, dtype: Any = jnp.bfloat16) -> QKV:
    return sds(b, t, hq, d, dtype=dtype), sds(b, s, hkv, d, dtype=dtype), sds(b, s, hkv, d, dtype=dtype)


@pytest.fixture
def cudnn_9_10(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(impl_module, "cudnn_version", lambda: 91000)


def cudnn(device: DeviceInfo = H100, **md: Any) -> CudnnAttention:
    return CudnnAttention(AttentionMetadata(**md), device)


def joined(reasons: list[str]) -> str:
    return " | ".join(reasons)


@pytest.mark.usefixtures("cudnn_9_10")
class TestCudnnDeclines:
    def test_accepts_what_cudnn_runs(self) -> None:
        q, k, v = qkv()
        mask = sds(2, 1, 8, 8, dtype=jnp.bool_)
        assert cudnn().supports(q, k, v) == []
        assert cudnn().supports(q, k, v, causal=True, needs_grad=True) == []
        assert cudnn().supports(q, k, v, mask=mask, sliding_window=(3, 0), causal=True, needs_grad=True) == []
        assert cudnn().supports(*qkv(t=1, s=33), causal=True) == []  # decode
        assert cudnn(A100).supports(*qkv(d=128), needs_grad=True) == []

    def test_float32_with_the_way_out(self) -> None:
        reasons = cudnn().supports(*qkv(dtype=jnp.float32))
        assert len(reasons) == 1 and "float32" in reasons[0] and "runtime_dtype" in reasons[0]
        # ... which works: the metadata's runtime dtype is what cuDNN sees.
        assert cudnn(runtime_dtype="bfloat16").supports(*qkv(dtype=jnp.float32)) == []

    @pytest.mark.parametrize(
        ("device", "d", "fragment"),
        [
            (H100, 20, "multiple of 8"),
            (H100, 264, "8..256"),
            (A100, 192, "at most 128 before sm_90"),
        ],
    )
    def test_head_dims(self, device: DeviceInfo, d: int, fragment: str) -> None:
        assert fragment in joined(cudnn(device).supports(*qkv(d=d)))

    def test_old_gpu(self) -> None:
        assert "sm_80 (Ampere) or newer" in joined(cudnn(T4).supports(*qkv()))

    def test_features_jax_nn_lacks(self) -> None:
        q, k, v = qkv()
        why = joined(cudnn().supports(q, k, v, logits_soft_cap=30.0))
        assert "soft cap" in why and "no mask or bias expresses it exactly" in why
        why = joined(cudnn().supports(q, k, v, dropout_prob=0.1, dropout_rng=jax.random.key(0)))
        assert "no dropout" in why
        why = joined(cudnn().supports(q, k, sds(2, 8, 2, 32)))
        assert "v to have k's shape" in why
        assert "softmax in float32" in joined(cudnn(softmax_dtype="bfloat16").supports(q, k, v))

    def test_backward_needs_even_lengths(self) -> None:
        q, k, v = qkv(t=7, s=7)
        mask = sds(1, 1, 7, 7, dtype=jnp.bool_)
        assert cudnn().supports(q, k, v, mask=mask) == []  # forward only: fine
        assert "even T and S" in joined(cudnn().supports(q, k, v, mask=mask, needs_grad=True))
        # T != S causal is spelled out as a mask on cuDNN, so it counts too ...
        assert "even T and S" in joined(cudnn().supports(*qkv(t=3, s=8), causal=True, needs_grad=True))
        # ... and so does T == S causal, native and without a bias: jax's cuDNN backward refused
        # odd lengths there too on an H200 (jax 0.11.2), whatever its Python guard says.
        assert "even T and S" in joined(cudnn().supports(q, k, v, causal=True, needs_grad=True))
        assert cudnn().supports(*qkv(t=8, s=8), causal=True, needs_grad=True) == []

    def test_backward_refused_where_causal_leaves_queries_without_keys(self) -> None:
        assert cudnn().supports(*qkv(t=12, s=8), causal=True) == []  # forward only: fine
        assert "see no key" in joined(cudnn().supports(*qkv(t=12, s=8), causal=True, needs_grad=True))
        assert cudnn().supports(*qkv(t=8, s=12), causal=True, needs_grad=True) == []

    def test_bias_gradient_only_for_a_batch_shared_bias(self) -> None:
        q, k, v = qkv()
        shared, batched = sds(1, 4, 8, 8), sds(2, 4, 8, 8)
        assert cudnn().supports(q, k, v, bias=shared, needs_grad=True) == []
        assert cudnn().supports(q, k, v, bias=batched) == []  # forward only: fine
        assert "shared across the batch" in joined(cudnn().supports(q, k, v, bias=batched, needs_grad=True))
        # A batched mask widens the bias tensor over the batch too (sinks ride in it as well).
        mask = sds(2, 1, 8, 8, dtype=jnp.bool_)
        aux = sds(4, dtype=jnp.float32)
        extras: list[dict[str, Any]] = [{"bias": shared}, {"softmax_aux": aux}]
        for extra in extras:
            assert "shared across the batch" in joined(cudnn().supports(q, k, v, mask=mask, needs_grad=True, **extra))

    def test_kv_lengths(self) -> None:
        lengths = sds(2, dtype=jnp.int32)
        # Decode over a cache: kv_seqlen alone, no bias tensor; forward only (T = 1 is odd).
        assert cudnn().supports(*qkv(t=1, s=64), causal=True, kv_lengths=lengths) == []
        why = joined(cudnn().supports(*qkv(t=1, s=64), causal=True, kv_lengths=lengths, needs_grad=True))
        assert "even T and S" in why and "the bias carries" not in why
        # Causal with T > 1 follows each length: a per-sequence mask, which cuDNN differentiates ...
        assert cudnn().supports(*qkv(t=4, s=64), causal=True, kv_lengths=lengths, needs_grad=True) == []
        why = joined(cudnn().supports(*qkv(t=3, s=64), causal=True, kv_lengths=lengths, needs_grad=True))
        assert "per-sequence mask" in why
        # ... but then its bias tensor varies over the batch: no gradient for a bias or sinks.
        q, k, v = qkv(t=4, s=64)
        aux = sds(4, dtype=jnp.float32)
        assert cudnn().supports(q, k, v, causal=True, kv_lengths=lengths, softmax_aux=aux) == []
        why = joined(cudnn().supports(q, k, v, causal=True, kv_lengths=lengths, softmax_aux=aux, needs_grad=True))
        assert "shared across the batch" in why and "per-sequence mask" in why
        # Without causal or a window the lengths are kv_seqlen: a shared bias keeps its gradient.
        assert cudnn().supports(q, k, v, kv_lengths=lengths, bias=sds(1, 4, 4, 64), needs_grad=True) == []

    def test_every_reason_at_once(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(impl_module, "cudnn_version", lambda: None)
        reasons = cudnn(T4).supports(*qkv(d=20, dtype=jnp.float32), logits_soft_cap=5.0)
        for fragment in ("float32", "multiple of 8", "sm_80", "soft cap", "cuDNN is not available"):
            assert fragment in joined(reasons), fragment


@pytest.mark.skipif(ON_CUDA, reason="checks the answer on a host without an NVIDIA GPU")
def test_cudnn_on_a_cpu_says_where_it_runs() -> None:
    for name in ("cudnn", "cuda_flash_attn2"):
        with pytest.raises(ImplNotFoundError, match="runs on cuda") as info:
            jaxattn.get_impl(name)
        assert "sdpa" in str(info.value)  # what this host has instead
    rows = {row.name: row for row in jaxattn.list_impls()}
    assert "NVIDIA GPU with cuDNN" in rows["cudnn"].description
    assert not rows["cudnn"].usable_here and rows["sdpa"].usable_here


@pytest.mark.skipif(ON_CUDA, reason="runs the H100's XLA branch on the CPU")
@pytest.mark.usefixtures("cudnn_9_10")
class TestSdpaChoosesAPath:
    def test_notes(self) -> None:
        sdpa = SdpaAttention(AttentionMetadata(), H100)
        q, k, v = qkv()

        def notes(q: Any, k: Any, v: Any, **features: Any) -> str:
            return joined(sdpa.notes(resolve_call(q, k, v, metadata=sdpa.metadata, **features).problem))

        assert "through cuDNN" in notes(q, k, v, causal=True)
        assert "through XLA" in notes(*qkv(dtype=jnp.float32)) and "float32" in notes(*qkv(dtype=jnp.float32))
        # Judged as if a gradient followed: a batched bias would leave cuDNN without dbias.
        batched = notes(q, k, v, bias=sds(2, 4, 8, 8))
        assert "through XLA" in batched and "shared across the batch" in batched
        assert "runs only on NVIDIA GPUs" in joined(SdpaAttention().notes(AttentionProblem.from_inputs(q, k, v)))

    def test_logs_its_choice_once(self, caplog: pytest.LogCaptureFixture) -> None:
        sdpa = SdpaAttention(AttentionMetadata(), H100)  # float32 goes to XLA, which runs here
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.normal(size=(1, 4, 2, 8)), jnp.float32)
        with caplog.at_level(logging.INFO, logger="jaxattn"):
            sdpa(q, q, q, causal=True)
            sdpa(q, q, q, causal=True)
        lines = [r.getMessage() for r in caplog.records if "sdpa runs" in r.getMessage()]
        assert len(lines) == 1 and "through XLA" in lines[0] and "float32" in lines[0]

    def test_float16_declined_where_xla_cannot_compile_it(self) -> None:
        why = joined(SdpaAttention().supports(*qkv(dtype=jnp.float16)))
        assert "F16_F16_F32" in why
        assert SdpaAttention(AttentionMetadata(), H100).supports(*qkv(dtype=jnp.float16)) == []


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU with cuDNN")
def test_this_gpu_runs_cudnn() -> None:
    """On the GPU host cuDNN must be found: otherwise every cudnn case would skip as declined."""
    from jaxattn_sdpa.cudnn import cudnn_version

    assert cudnn_version() is not None
    q, k, v = qkv(d=128)
    assert jaxattn.get_impl("cudnn").supports(q, k, v, causal=True, needs_grad=True) == []
    sdpa = jaxattn.get_impl("sdpa")
    assert isinstance(sdpa, SdpaAttention)
    assert sdpa.cudnn_declines(AttentionProblem.from_inputs(q, k, v, causal=True)) == []
