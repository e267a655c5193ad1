"""Registration, declared capabilities, declines and import laziness of mosaic_flash (no kernel
runs here: Mosaic GPU does not run on a CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxattn.device import DeviceInfo
from jaxattn.metadata import AttentionMetadata
from jaxattn.problem import AttentionProblem
from jaxattn.registry import Provider
from jaxattn_mosaic import plugin
from jaxattn_mosaic.impl import MosaicFlashAttention

H100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
A100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")


def _problem(**kw: object) -> AttentionProblem:
    base: dict[str, object] = {
        "batch": 2, "seq_q": 4096, "seq_k": 4096, "heads_q": 32, "heads_kv": 8,
        "head_dim": 128, "head_dim_v": 128, "dtype": "bfloat16",
    }  # fmt: skip
    base.update(kw)
    return AttentionProblem(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("imports", "banned"), [
    # Discovery imports the entry-point module only: no jax at all.
    ("jaxattn_mosaic, jaxattn_mosaic.plugin", ("jax", "jaxattn_mosaic.kernel")),
    # The impl class (loaded on first use) imports no kernel: the Pallas dialect waits for a call.
    ("jaxattn_mosaic.impl", ("jaxattn_mosaic.kernel", "jax.experimental.pallas", "jax.experimental.mosaic")),
])  # fmt: skip
def test_registration_imports_no_kernel(imports: str, banned: tuple[str, ...]) -> None:
    code = (
        f"import sys, {imports}; import jaxattn_mosaic.plugin as p; p.jaxattn_register_impls();"
        f"bad = [m for m in {banned!r} if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_implref_matches_the_class() -> None:
    refs = plugin.jaxattn_register_impls()
    assert refs == [plugin.MOSAIC_FLASH]
    cls = Provider.from_source(refs[0], "mosaic", "jaxattn-mosaic", "0.1.0").load()
    assert cls is MosaicFlashAttention
    assert (refs[0].names, refs[0].priority) == (cls.names(), cls.priority)
    assert MosaicFlashAttention.name() == "mosaic_flash"


def test_discovered_by_the_registry() -> None:
    import jaxattn

    info = [i for i in jaxattn.list_impls() if i.name == "mosaic_flash"]
    assert len(info) == 1, info
    assert info[0].distribution == "jaxattn-mosaic"
    assert info[0].platforms == ("cuda",)


def test_declines_on_cpu_saying_mosaic_gpu_does_not_run_there() -> None:
    reasons = MosaicFlashAttention(AttentionMetadata(), DeviceInfo(platform="cpu")).not_supported_reasons(_problem())
    assert any("does not run on cpu" in r for r in reasons), reasons
    assert any("cuda" in r and "cpu" in r for r in reasons), reasons  # the core's platform reason


def test_declines_before_hopper() -> None:
    reasons = MosaicFlashAttention(AttentionMetadata(), A100).not_supported_reasons(_problem())
    assert any("8.0" in r and "Hopper" in r for r in reasons), reasons


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("t", "s", "hkv", "d", "dtype"), [
    (4096, 4096, 8, 128, "bfloat16"), (333, 517, 32, 64, "float16"), (1, 77, 1, 256, "bfloat16"),
    (517, 129, 4, 128, "float16"),
])  # fmt: skip
def test_accepts_what_it_declares_on_an_h100(causal: bool, t: int, s: int, hkv: int, d: int, dtype: str) -> None:
    problem = _problem(seq_q=t, seq_k=s, heads_kv=hkv, head_dim=d, head_dim_v=d, dtype=dtype, causal=causal)
    assert MosaicFlashAttention(AttentionMetadata(), H100).not_supported_reasons(problem) == []


def test_declines_every_missing_feature_with_all_reasons() -> None:
    problem = _problem(
        causal=True, mask_shape=(2, 1, 4096, 4096), bias_shape=(1, 32, 4096, 4096), sliding_window=(64, 0),
        segment_ids=True, logits_soft_cap=30.0, sinks=True, needs_grad=True, dropout_prob=0.1,
        head_dim_v=64, dtype="float32",
    )  # fmt: skip
    reasons = MosaicFlashAttention(AttentionMetadata(softmax_dtype="bfloat16"), H100).not_supported_reasons(problem)
    text = "\n".join(reasons)
    for word in ("mask", "bias", "sliding window", "segment ids", "soft cap", "sinks", "dropout",
                 "head dim", "float32", "softmax_dtype"):
        assert word in text, (word, reasons)


@pytest.mark.parametrize(("problem", "metadata", "expected"), [
    (_problem(head_dim=96, head_dim_v=96), AttentionMetadata(), "96"),
    (_problem(), AttentionMetadata(block_q=48), "multiples of 64"),
    (_problem(), AttentionMetadata(num_stages=1), "2 stages"),
    (_problem(needs_grad=True, causal=True, seq_q=1024, seq_k=2048), AttentionMetadata(), "need T == S"),
    (_problem(needs_grad=True, seq_q=333, seq_k=517), AttentionMetadata(), "even T and S"),
])  # fmt: skip
def test_declines_with_a_reason(problem: AttentionProblem, metadata: AttentionMetadata, expected: str) -> None:
    reasons = MosaicFlashAttention(metadata, H100).not_supported_reasons(problem)
    assert any(expected in r for r in reasons), reasons


def test_differentiates_through_cudnns_backward_where_cudnn_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its gradients are cuDNN's backward at its residuals: accepted wherever cuDNN's backward runs
    # the call (here a cuDNN is pretended: this machine has none), declined with cuDNN's reasons else.
    import jaxattn_sdpa.cudnn

    impl = MosaicFlashAttention(AttentionMetadata(), H100)
    full, causal = _problem(needs_grad=True), _problem(needs_grad=True, causal=True)
    assert any("cuDNN is not available" in r for r in impl.not_supported_reasons(full))
    monkeypatch.setattr(jaxattn_sdpa.cudnn, "cudnn_version", lambda: 91000)
    assert impl.not_supported_reasons(full) == [] and impl.not_supported_reasons(causal) == []
    assert "backward: cuDNN's" in " ".join(impl.notes(full))
