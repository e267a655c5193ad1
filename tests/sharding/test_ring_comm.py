"""Ring's choice of how K/V travel (``jaxattn_ring.comm``): what "auto" picks, and why it says so.

The choice is arithmetic on the call's sizes, the device and its memory; the numerics of both
ways are checked on the host mesh (multidevice/check_ring.py) and on GPUs (ring_bench's check).
"""

from __future__ import annotations

import dataclasses

import pytest

import jaxattn
from jaxattn.backend.device import DeviceInfo
from jaxattn.backend.problem import AttentionProblem
from jaxattn.sharding.compat import abstract_mesh
from jaxattn_ring import comm
from jaxattn_ring.impl import RingAttention

GPU = DeviceInfo(platform="gpu", vendor="cuda", device_kind="NVIDIA H200", compute_capability="9.0", device_count=4)
GIB = 2**30
# One device's share of a causal 128k-token call on 4 devices: B=1, H=Hkv=16, D=128, bf16.
LOCAL = AttentionProblem(batch=1, seq_q=32768, seq_k=32768, heads_q=16, heads_kv=16, head_dim=128, head_dim_v=128,
                         dtype="bfloat16", causal=True)


def test_gathered_bytes_are_kv_and_float32_grads_of_the_whole_sequence() -> None:
    # 131072 keys x 16 heads x (128 + 128) values x (2 bytes of K/V + 4 of float32 dK/dV) = 3 GiB.
    assert comm.gathered_bytes(LOCAL, 4) == 3 * GIB
    assert comm.gathered_bytes(dataclasses.replace(LOCAL, dtype="float32"), 4) == 4 * GIB


@pytest.mark.parametrize(("requested", "n", "device", "memory", "want", "said"), [
    ("ppermute", 8, GPU, 141 * GIB, "ppermute", "asked"),
    ("all_gather", 2, DeviceInfo(platform="cpu"), None, "all_gather", "asked"),
    ("auto", 4, DeviceInfo(platform="cpu"), None, "ppermute", "measured on GPUs only, this is cpu"),
    ("auto", 4, DeviceInfo(platform="tpu"), None, "ppermute", "this is tpu"),
    ("auto", 2, GPU, 141 * GIB, "ppermute", "2 devices (the all-gather measured faster from 4)"),
    ("auto", 4, GPU, None, "ppermute", "does not report its memory"),
    ("auto", 4, GPU, 47 * GIB, "ppermute", "would take 3.0 GiB, more than 1/16 of the device's 47.0 GiB"),
    ("auto", 4, GPU, 48 * GIB, "all_gather", "take 3.0 GiB, at most 1/16 of the device's 48.0 GiB"),
    ("auto", 8, GPU, 141 * GIB, "all_gather", "auto: 8 devices"),
])  # fmt: skip
def test_choose_comm(requested: str, n: int, device: DeviceInfo, memory: int | None, want: str, said: str) -> None:
    got, why = comm.choose_comm(requested, n, device, comm.gathered_bytes(LOCAL, 4), memory)
    assert got == want and said in why, (got, why)


def test_auto_on_a_gpu_says_why_in_explain(monkeypatch: pytest.MonkeyPatch) -> None:
    # A ring of 4 on H200s (faked: an abstract mesh, a device description and its memory).
    import jaxattn_ring.impl

    monkeypatch.setattr(jaxattn_ring.impl, "device_memory", lambda: 141 * GIB)
    md = jaxattn.AttentionMetadata(mesh=abstract_mesh((("seq", 4),)), sequence_axis="seq")
    problem = dataclasses.replace(LOCAL, seq_q=131072, seq_k=131072)
    notes = " ".join(RingAttention(md, GPU).notes(problem))
    assert "K/V all-gathered" in notes and "(auto: 4 devices; gathered K/V and float32 dK/dV take 3.0 GiB" in notes
    long = dataclasses.replace(problem, seq_q=8 * 131072, seq_k=8 * 131072)  # 24 GiB: more than 1/16
    assert "K/V passed around the ring (auto: gathered K/V" in " ".join(RingAttention(md, GPU).notes(long))
    cpu = " ".join(RingAttention(md, DeviceInfo(platform="cpu")).notes(problem))
    assert "K/V passed around the ring (auto: the all-gather was measured on GPUs only" in cpu
