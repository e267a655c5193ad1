"""Mesh axes, specs and error messages: the parts of sharding that need no second device."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn.backend.impl import sequence_reasons
from jaxattn.backend.metadata import axis_tuple
from jaxattn.errors import InvalidInputError
from jaxattn.sharding.axes import kv_head_repeat, mesh_axes
from jaxattn.sharding.specs import AttentionSpecs


def one_device_mesh(*names: str) -> Mesh:
    return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names)


def test_axis_names_normalise() -> None:
    assert axis_tuple(None) == ()
    assert axis_tuple("data") == ("data",)
    assert axis_tuple(("data", "fsdp")) == ("data", "fsdp")


def test_an_axis_used_twice_is_rejected() -> None:
    with pytest.raises(ValueError, match="head_axis: mesh axis 'x' is already used by batch_axis"):
        jaxattn.AttentionMetadata(batch_axis=("d", "x"), head_axis="x")


def test_axes_missing_from_the_mesh_are_named() -> None:
    with pytest.raises(ValueError, match=r"mesh axes \['seq'\] \(sequence_axis\).*axes are \['data', 'model'\]"):
        jaxattn.AttentionMetadata(mesh=one_device_mesh("data", "model"), batch_axis="data", sequence_axis="seq")


def test_axis_names_must_be_strings() -> None:
    with pytest.raises(ValueError, match=r"AttentionMetadata\.batch_axis"):
        jaxattn.AttentionMetadata(batch_axis=3)  # type: ignore[arg-type]


def test_axes_without_a_mesh_are_allowed() -> None:
    # Inside the caller's own shard_map the axes are bound but there is no mesh to pass.
    md = jaxattn.AttentionMetadata(sequence_axis="seq")
    assert mesh_axes(md) is None


def test_sizes_of_single_and_tuple_axes() -> None:
    md = jaxattn.AttentionMetadata(mesh=one_device_mesh("a", "b", "c"), batch_axis=("a", "b"), head_axis="c")
    axes = mesh_axes(md)
    assert axes is not None
    assert (axes.batch, axes.heads, axes.sequence) == (("a", "b"), ("c",), ())
    assert (axes.batch_size, axes.head_size, axes.sequence_size) == (1, 1, 1)
    assert axes.spec_entry(axes.batch) == ("a", "b") and axes.spec_entry(axes.heads) == "c"


def test_divisibility_error_names_dimension_axis_and_sizes() -> None:
    axes = mesh_axes(jaxattn.AttentionMetadata(mesh=one_device_mesh("data"), batch_axis="data"))
    assert axes is not None
    fake = axes.__class__(batch=("data",), heads=(), sequence=(), sizes=(("data", 4),))
    with pytest.raises(InvalidInputError, match=r"q: batch size B 6 is not divisible by mesh axis 'data' of size 4"):
        fake.check_divides("batch size B", "q", 6, fake.batch, "batch_axis")
    fake.check_divides("batch size B", "q", 8, fake.batch, "batch_axis")


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 6, 8])
def test_kv_head_repeat_keeps_every_group_inside_its_shard(parts: int) -> None:
    for hkv, group in itertools.product(range(1, 9), range(1, 9)):
        hq = hkv * group
        if hq % parts:
            continue
        r = kv_head_repeat(hq, hkv, parts)
        assert (hkv * r) % parts == 0 and group % r == 0
        new_group = hq // (hkv * r)
        for h in range(hq):
            kv = h // new_group
            assert kv // r == h // group, "a query head must read the copy of its own K/V head"
            assert h // (hq // parts) == kv // (hkv * r // parts), "and that copy must live on its shard"
        assert r == 1 or hkv % parts, "no copies when the K/V heads split already"


def test_specs_shard_full_dims_and_replicate_broadcast_ones() -> None:
    specs = AttentionSpecs(batch="data", heads="model", kv_heads="model")
    assert specs.q == P("data", None, "model", None)
    assert specs.lse == P("data", "model", None)
    key_padding = jax.ShapeDtypeStruct((4, 1, 1, 32), bool)
    assert specs.broadcast(key_padding, (4, 8, 16, 32)) == P("data", None, None, None)
    shared_bias = jax.ShapeDtypeStruct((1, 8, 16, 32), np.float32)
    assert specs.broadcast(shared_bias, (4, 8, 16, 32)) == P(None, "model", None, None)
    ring_specs = AttentionSpecs(seq_q="seq", seq_k="seq")
    full_mask = jax.ShapeDtypeStruct((1, 1, 16, 32), bool)
    assert ring_specs.broadcast(full_mask, (4, 8, 16, 32), shard_keys=False) == P(None, None, "seq", None)


def test_impls_that_are_not_sequence_parallel_decline_a_sequence_axis() -> None:
    md = jaxattn.AttentionMetadata(mesh=one_device_mesh("seq"), sequence_axis="seq")
    assert sequence_reasons("vanilla", True, md) == []
    assert "use impl='ring'" in sequence_reasons("vanilla", False, md)[0]
    q = jax.ShapeDtypeStruct((1, 8, 2, 4), np.float32)
    reasons = jaxattn.get_impl("vanilla", md).supports(q, q, q)
    assert any("sequence_axis='seq' shards the sequence" in r for r in reasons)
