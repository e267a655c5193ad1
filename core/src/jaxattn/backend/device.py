"""Device detection: what jaxattn will run on. Lazy (jax is imported on first call), cached."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["DeviceInfo", "detect_device", "device_info_from", "tpu_generation", "tpu_version_check"]

# Ordered oldest to newest: the index is the generation's rank.
TPU_GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p", "v6e", "v7x")


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """The local accelerator as jaxattn sees it."""

    platform: str  # "cpu", "gpu" or "tpu"
    vendor: str | None = None  # "cuda" or "rocm" on a GPU
    device_kind: str = ""
    compute_capability: str | None = None  # "9.0" on an H100/H200
    tpu_generation: str | None = None  # one of TPU_GENERATIONS
    device_count: int = 1
    process_count: int = 1

    @property
    def label(self) -> str:
        """A short human description: ``gpu/cuda (NVIDIA H100, sm_90) x1``."""
        parts = [self.platform + (f"/{self.vendor}" if self.vendor else "")]
        detail = [self.device_kind] if self.device_kind and self.device_kind != self.platform else []
        if self.compute_capability:
            detail.append("sm_" + self.compute_capability.replace(".", ""))
        if self.tpu_generation:
            detail.append(f"TPU {self.tpu_generation}")
        if detail:
            parts.append(f"({', '.join(detail)})")
        parts.append(f"x{self.device_count}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tpu_generation(device_kind: str) -> str | None:
    """Map a TPU ``device_kind`` ("TPU v5 lite", "TPU v6e", "TPU7x", ...) to a generation name."""
    kind = device_kind.lower()
    if "tpu" not in kind:
        return None
    if re.search(r"tpu\s*7|v7", kind):
        return "v7x"
    match = re.search(r"v(\d)\s*(lite|e|p)?", kind)
    if not match:
        return None
    major, suffix = match.group(1), match.group(2)
    if major in ("5", "6"):
        if suffix in ("lite", "e"):
            return f"v{major}e"
        return "v5p" if major == "5" else "v6e"  # v6 shipped only as the lite (e) part
    return f"v{major}"


def device_info_from(devices: Sequence[Any], platform_version: str = "", process_count: int = 1) -> DeviceInfo:
    """Build a ``DeviceInfo`` from jax device objects (real ones, or fakes in tests)."""
    if not devices:
        return DeviceInfo(platform="cpu", device_count=0)
    dev = devices[0]
    platform = str(getattr(dev, "platform", "cpu")).lower()
    kind = str(getattr(dev, "device_kind", ""))
    vendor: str | None = None
    capability = None
    if platform in ("gpu", "cuda", "rocm"):
        capability = getattr(dev, "compute_capability", None)
        if platform == "rocm" or "rocm" in platform_version.lower() or "amd" in kind.lower():
            vendor = "rocm"
        else:
            vendor = "cuda"
        platform = "gpu"
    return DeviceInfo(
        platform=platform,
        vendor=vendor,
        device_kind=kind,
        compute_capability=None if capability is None else str(capability),
        tpu_generation=tpu_generation(kind) if platform == "tpu" else None,
        device_count=len(devices),
        process_count=process_count,
    )


@functools.lru_cache(maxsize=1)
def _detect() -> DeviceInfo:
    import jax

    devices = jax.devices()  # honours JAX_PLATFORMS / jax_platforms like every jax program
    version = ""
    try:
        version = str(devices[0].client.platform_version)
    except Exception:  # platform_version is informative only
        version = ""
    return device_info_from(devices, version, jax.process_count())


def detect_device(refresh: bool = False) -> DeviceInfo:
    """The default jax device's platform, vendor, kind, capability, TPU generation and count."""
    if refresh:
        _detect.cache_clear()
    return _detect()


def tpu_version_check(version: str = "v4", device: DeviceInfo | None = None) -> bool:
    """Whether this host runs TPUs of the family ``version`` ("v4", "v5" matches v5e and v5p, "v5e", ...)."""
    info = device or detect_device()
    if info.platform != "tpu" or info.tpu_generation is None:
        return False
    wanted = version.lower().strip().removeprefix("tpu").strip()
    if not wanted.startswith("v") and not wanted.startswith("7"):
        wanted = "v" + wanted
    if re.fullmatch(r"v\d", wanted):  # a family: "v5" is v5e and v5p
        return info.tpu_generation.startswith(wanted)
    return tpu_generation(f"tpu {wanted}") == info.tpu_generation
