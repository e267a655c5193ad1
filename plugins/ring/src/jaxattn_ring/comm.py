"""How K/V travel between the ring's devices: passed around the ring, or all-gathered.

``extra["ring_comm"]`` names one, or ``"auto"`` (the default) chooses by what was measured
(docs/bench.md, "Multi-GPU"): on 4 H200s (NVLink between every pair) at 128k tokens the
all-gather ran causal forward+backward 1.7-5.0% faster than the ring's own transfers, on 2 of
them 0.7-1.6% slower. The all-gather holds every device's K/V at once, and in the backward
float32 dK/dV of the whole sequence: transient memory that grows with S, where the ring's stays
``O(S/n)``. So "auto" gathers on GPUs from :data:`GATHER_FROM` devices, when those arrays take
at most ``1 /`` :data:`MEMORY_SHARE` of a device's memory; elsewhere (TPUs and CPUs: not
measured) it passes K/V around the ring.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from jaxattn.backend import AttentionProblem, DeviceInfo

__all__ = [
    "COMMS",
    "GATHER_FROM",
    "MEMORY_SHARE",
    "Comm",
    "choose_comm",
    "describe",
    "device_memory",
    "gathered_bytes",
    "requested_comm",
]

Comm = Literal["ppermute", "all_gather"]
COMMS: tuple[str, ...] = ("auto", "ppermute", "all_gather")
GATHER_FROM = 4
MEMORY_SHARE = 16


def gathered_bytes(local: AttentionProblem, n: int) -> int:
    """Bytes the all-gather holds at once on a device: the gathered K and V, and the float32
    dK and dV of the whole sequence (counted whether or not a backward follows)."""
    import numpy as np

    rows = local.batch * local.heads_kv * local.seq_k * n
    return rows * (local.head_dim + local.head_dim_v) * (np.dtype(local.dtype).itemsize + 4)


def device_memory() -> int | None:
    """The first local device's memory limit in bytes (None where jax does not report one)."""
    import jax

    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # platforms without memory statistics
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def choose_comm(requested: str, n: int, device: DeviceInfo, needed: int, memory: int | None) -> tuple[Comm, str]:
    """``(comm, why)``: ``requested`` when it names one, else the measured rule (module docstring)."""
    if requested != "auto":
        return requested, "asked"  # type: ignore[return-value]  # validated against COMMS by the caller
    if device.platform != "gpu":
        return "ppermute", f"auto: the all-gather was measured on GPUs only, this is {device.platform}"
    if n < GATHER_FROM:
        return "ppermute", f"auto: {n} devices (the all-gather measured faster from {GATHER_FROM})"
    if memory is None:
        return "ppermute", "auto: the device does not report its memory, which the gathered K/V must fit"
    if needed * MEMORY_SHARE > memory:
        return "ppermute", (f"auto: gathered K/V and float32 dK/dV would take {_gib(needed)}, more than 1/"
                            f"{MEMORY_SHARE} of the device's {_gib(memory)}")
    return "all_gather", (f"auto: {n} devices; gathered K/V and float32 dK/dV take {_gib(needed)}, at most 1/"
                          f"{MEMORY_SHARE} of the device's {_gib(memory)}")


def describe(comm: Comm, why: str) -> str:
    """The note ``explain`` shows."""
    what = ("K/V all-gathered (every device holds all S keys during the call), dK/dV reduce-scattered"
            if comm == "all_gather" else "K/V passed around the ring")
    return what if why == "asked" else f"{what} ({why})"


def requested_comm(extra: Mapping[str, Any]) -> str:
    """``extra["ring_comm"]`` as given ("auto" when absent)."""
    return str(extra.get("ring_comm", "auto"))
