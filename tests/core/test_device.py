"""Device detection from (fake) jax device objects."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import jaxattn
from jaxattn.backend.device import DeviceInfo, device_info_from, tpu_generation, tpu_version_check


@dataclass
class FakeDevice:
    platform: str
    device_kind: str
    compute_capability: str | None = None


def test_cpu_host_is_detected() -> None:
    info = jaxattn.detect_device()
    assert info.platform == "cpu" and info.vendor is None and info.device_count >= 1


def test_nvidia_gpu() -> None:
    info = device_info_from([FakeDevice("gpu", "NVIDIA H100 80GB HBM3", "9.0")] * 2, "PJRT C API\ncuda 12080")
    assert (info.platform, info.vendor, info.compute_capability, info.device_count) == ("gpu", "cuda", "9.0", 2)
    assert "sm_90" in info.label


def test_amd_gpu() -> None:
    info = device_info_from([FakeDevice("gpu", "AMD Instinct MI300X")], "rocm 6.2")
    assert (info.platform, info.vendor) == ("gpu", "rocm")


@pytest.mark.parametrize(
    ("kind", "generation"),
    [
        ("TPU v2", "v2"), ("TPU v3", "v3"), ("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"),
        ("TPU v5", "v5p"), ("TPU v5p", "v5p"), ("TPU v6 lite", "v6e"), ("TPU v6e", "v6e"), ("TPU7x", "v7x"),
        ("TPU 7x", "v7x"), ("cpu", None),
    ],
)
def test_tpu_generations(kind: str, generation: str | None) -> None:
    assert tpu_generation(kind) == generation


def test_tpu_version_check() -> None:
    v5e = device_info_from([FakeDevice("tpu", "TPU v5 lite")] * 4)
    assert v5e.tpu_generation == "v5e" and v5e.device_count == 4
    assert tpu_version_check("v5", v5e) and tpu_version_check("v5e", v5e) and tpu_version_check("v5 lite", v5e)
    assert not tpu_version_check("v4", v5e) and not tpu_version_check("v5p", v5e)
    assert not tpu_version_check("v4", DeviceInfo("cpu"))
    assert tpu_version_check("TPU v4", device_info_from([FakeDevice("tpu", "TPU v4")]))
