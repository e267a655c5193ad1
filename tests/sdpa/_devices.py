"""What the test host has, and fake devices for checking cuDNN's limits without a GPU."""

from __future__ import annotations

from jaxattn.backend.device import DeviceInfo, detect_device

__all__ = ["A100", "H100", "ON_CUDA", "T4"]

_here = detect_device()
#: Whether this host has an NVIDIA GPU (the `gpu`-marked tests need one).
ON_CUDA = _here.platform == "gpu" and _here.vendor == "cuda"

H100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
A100 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
T4 = DeviceInfo(platform="gpu", vendor="cuda", device_kind="Tesla T4", compute_capability="7.5")
