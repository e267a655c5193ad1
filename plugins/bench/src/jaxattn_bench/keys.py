"""What a measurement is valid for: the environment it was taken in and the problem it timed.

A tuning result answers "which backend is fastest for calls like this one, here". "Here" is
the :class:`Environment` (platform, device kind, jax and jaxlib versions): a measurement from
another GPU or another jax is not used. "Calls like this one" is the :func:`problem_key`
(the core's ``jaxattn.selection.tuning.problem_key``, which shipped priors are keyed by too): dtype,
head dims, a power-of-two bucket of each sequence length, and the features the call needs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from typing import TYPE_CHECKING, Any

from jaxattn.backend import problem_key, seq_bucket

if TYPE_CHECKING:
    from jaxattn.backend import DeviceInfo

__all__ = ["Environment", "current_environment", "problem_key", "seq_bucket"]


@dataclasses.dataclass(frozen=True)
class Environment:
    """Where measurements were taken. Two environments share measurements only when equal."""

    platform: str
    device_kind: str
    jax: str
    jaxlib: str

    @property
    def fingerprint(self) -> str:
        return f"{self.platform}|{self.device_kind}|jax {self.jax}|jaxlib {self.jaxlib}"

    def describe(self) -> str:
        return f"{self.device_kind or self.platform} with jax {self.jax} / jaxlib {self.jaxlib}"

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Environment:
        if not isinstance(data, dict):
            raise ValueError(f"environment must be an object, got {type(data).__name__}")
        values = [data.get(f.name) for f in dataclasses.fields(cls)]
        if not all(isinstance(v, str) for v in values):
            raise ValueError(f"environment fields must be strings: {data!r}")
        return cls(*(str(v) for v in values))


@functools.lru_cache(maxsize=1)
def _versions() -> tuple[str, str]:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    return version("jax"), version("jaxlib")


def current_environment(device: DeviceInfo | None = None) -> Environment:
    """This process's environment (the detected device unless one is given)."""
    from jaxattn.backend import detect_device

    info = device or detect_device()
    jax_version, jaxlib_version = _versions()
    platform = info.platform + (f"/{info.vendor}" if info.vendor else "")
    return Environment(platform=platform, device_kind=info.device_kind or info.platform,
                       jax=jax_version, jaxlib=jaxlib_version)
