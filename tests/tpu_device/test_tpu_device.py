"""Device detection, TPU version checks and the optimal config on every TPU generation.

``jax.devices`` is replaced by fake device objects carrying the ``device_kind`` strings real
TPUs report, so the whole path (``detect_device`` -> ``tpu_version_check`` /
``get_optimal_config`` -> the TPU plugins' rankings) runs on any host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import pytest

import jaxattn

# device_kind as jax reports it on each generation, and what jaxattn must make of it.
TPU_KINDS = {
    "TPU v2": "v2",
    "TPU v3": "v3",
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU7x": "v7x",
}


@dataclasses.dataclass(frozen=True)
class FakeTpu:
    device_kind: str
    id: int = 0
    platform: str = "tpu"


@pytest.fixture
def fake_tpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., jaxattn.DeviceInfo]]:
    """``use(kind, count)`` makes jax report ``count`` TPUs of ``kind``; restored afterwards."""

    def use(kind: str, count: int = 4) -> jaxattn.DeviceInfo:
        monkeypatch.setattr(jax, "devices", lambda *a, **k: [FakeTpu(kind, i) for i in range(count)])
        return jaxattn.detect_device(refresh=True)

    yield use
    monkeypatch.undo()
    jaxattn.detect_device(refresh=True)


@pytest.mark.parametrize(("kind", "generation"), TPU_KINDS.items())
def test_detect_device(fake_tpus: Callable[..., jaxattn.DeviceInfo], kind: str, generation: str) -> None:
    info = fake_tpus(kind, 8)
    assert (info.platform, info.vendor, info.device_kind) == ("tpu", None, kind)
    assert (info.tpu_generation, info.device_count, info.compute_capability) == (generation, 8, None)
    assert f"TPU {generation}" in info.label and "x8" in info.label
    assert jaxattn.detect_device() is info  # cached until refreshed


@pytest.mark.parametrize(("kind", "generation"), TPU_KINDS.items())
def test_tpu_version_check(fake_tpus: Callable[..., jaxattn.DeviceInfo], kind: str, generation: str) -> None:
    fake_tpus(kind)
    family = generation[:2]  # "v5" covers v5e and v5p
    assert jaxattn.tpu_version_check(generation)
    assert jaxattn.tpu_version_check(family)
    assert jaxattn.tpu_version_check(kind)  # the device_kind itself names the generation
    others = {g for g in TPU_KINDS.values() if g[:2] != family}
    assert not any(jaxattn.tpu_version_check(other) for other in others)
    if generation in ("v5e", "v5p"):
        assert not jaxattn.tpu_version_check("v5p" if generation == "v5e" else "v5e")


def test_tpu_version_check_is_false_off_tpu() -> None:
    assert jaxattn.detect_device(refresh=True).platform == "cpu"
    assert not any(jaxattn.tpu_version_check(g) for g in TPU_KINDS.values())


@pytest.mark.parametrize(("kind", "generation"), TPU_KINDS.items())
def test_get_optimal_config(fake_tpus: Callable[..., jaxattn.DeviceInfo], kind: str, generation: str) -> None:
    fake_tpus(kind)
    name, dtype = jaxattn.get_optimal_config()
    # The seed's rule: the Pallas flash kernel in float32 on v2/v3 (no fast bfloat16
    # path there), splash in bfloat16 from v4 on.
    if generation in ("v2", "v3"):
        assert (name, dtype) == ("flash_attn2", jnp.float32)
    else:
        assert (name, dtype) == ("splash", jnp.bfloat16)
