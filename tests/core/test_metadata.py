"""``AttentionMetadata`` checks every field at construction, with jaxattn's error types naming the
field, and takes EasyDeL's field names as aliases (docs/contract.md, "Metadata")."""

from __future__ import annotations

import pickle
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from jaxattn import AttentionMetadata, InvalidInputError, InvalidTypeError
from jaxattn.backend.metadata import EASYDEL_ALIASES

BAD_VALUES = [  # (field values, error type, text the message holds)
    ({"softmax_dtype": "bogus"}, InvalidInputError, "AttentionMetadata.softmax_dtype"),
    ({"softmax_dtype": "int8"}, InvalidInputError, "must be a floating dtype"),
    ({"softmax_dtype": "bool"}, InvalidInputError, "AttentionMetadata.softmax_dtype"),
    ({"softmax_dtype": None}, InvalidTypeError, "AttentionMetadata.softmax_dtype"),
    ({"softmax_dtype": 3}, InvalidTypeError, "AttentionMetadata.softmax_dtype"),
    ({"runtime_dtype": "bogus"}, InvalidInputError, "AttentionMetadata.runtime_dtype"),
    ({"runtime_dtype": jnp.int32}, InvalidInputError, "AttentionMetadata.runtime_dtype"),
    ({"mesh": "garbage"}, InvalidTypeError, "AttentionMetadata.mesh"),
    ({"allow_fallback": "no"}, InvalidTypeError, "AttentionMetadata.allow_fallback"),
    ({"interpret": "yes"}, InvalidTypeError, "AttentionMetadata.interpret"),
    ({"extra": {"ring_comm": ["ppermute"]}}, InvalidTypeError, "extra['ring_comm']"),
    ({"extra": {1: "x"}}, InvalidTypeError, "AttentionMetadata.extra"),
    ({"extra": "ring_comm=ppermute"}, InvalidTypeError, "AttentionMetadata.extra"),
    ({"platform": "xpu"}, InvalidInputError, "did you mean"),
    ({"platform": 3}, InvalidTypeError, "AttentionMetadata.platform"),
    ({"block_q": 0}, InvalidInputError, "AttentionMetadata.block_q"),
    ({"block_k": "64"}, InvalidTypeError, "AttentionMetadata.block_k"),
    ({"num_warps": True}, InvalidTypeError, "AttentionMetadata.num_warps"),
    ({"head_axis": 3}, InvalidTypeError, "AttentionMetadata.head_axis"),
    ({"batch_axis": "x", "head_axis": "x"}, InvalidInputError, "already used by batch_axis"),
    ({"softmax_scale": "0.1"}, InvalidTypeError, "AttentionMetadata.softmax_scale"),
    ({"dropout_prob": 1.0}, InvalidInputError, "AttentionMetadata.dropout_prob"),
    ({"blok_q": 64}, InvalidInputError, "did you mean 'block_q'"),
    ({"blocksize_b": 0}, InvalidInputError, "AttentionMetadata.blocksize_b"),
    ({"scan_ring_attention": "yes"}, InvalidTypeError, "AttentionMetadata.scan_ring_attention"),
    ({"soft_cap": 30.0, "logits_soft_cap": 50.0}, InvalidInputError, "AttentionMetadata.soft_cap"),
    ({"soft_cap": -1.0}, InvalidInputError, "AttentionMetadata.logits_soft_cap"),
    ({"backend": "xpu"}, InvalidInputError, "AttentionMetadata.platform"),
]


@pytest.mark.parametrize(("fields", "error", "text"), BAD_VALUES, ids=[str(f) for f, _, _ in BAD_VALUES])
def test_every_field_is_checked_at_construction(fields: dict[str, Any], error: type[Exception], text: str) -> None:
    with pytest.raises(error) as info:
        AttentionMetadata(**fields)
    assert text in str(info.value)
    assert type(info.value) is error  # InvalidInputError exactly, or InvalidTypeError


def test_replace_checks_too() -> None:
    with pytest.raises(InvalidTypeError, match="allow_fallback"):
        AttentionMetadata().replace(allow_fallback="no")
    with pytest.raises(InvalidInputError, match="did you mean 'block_k'"):
        AttentionMetadata().replace(blcok_k=3)


def test_mesh_axes_outside_the_mesh_name_the_field() -> None:
    mesh = jax.sharding.AbstractMesh((2,), ("seq",))
    with pytest.raises(InvalidInputError, match=r"AttentionMetadata.sequence_axis: .*did you mean 'seq'"):
        AttentionMetadata(mesh=mesh, sequence_axis="sq")
    assert AttentionMetadata(mesh=mesh, sequence_axis="seq").sequence_axis == "seq"


def test_valid_values_still_pass() -> None:
    md = AttentionMetadata(softmax_dtype=jnp.float64, runtime_dtype="bf16", allow_fallback=jnp.bool_(False).item(),
                           extra={"ring_comm": "ppermute", "sizes": (1, 2)}, platform="CPU", block_q=64)
    assert (md.softmax_dtype, md.runtime_dtype, md.platform) == ("float64", "bfloat16", "cpu")
    assert hash(md) == hash(AttentionMetadata(**{f: getattr(md, f) for f in ("softmax_dtype", "runtime_dtype",
                                                  "allow_fallback", "extra", "platform", "block_q")}))


def test_easydel_names_map_onto_jaxattn_fields() -> None:
    md = AttentionMetadata(runtime_dtype=jnp.bfloat16, runtime_softmax_dtype=jnp.float32, soft_cap=30.0,
                           blocksize_q=128, blocksize_k=256, sequence_axis_name="sp", backend="cpu",
                           softmax_scale=0.125, dropout_prob=0.0)
    assert md == AttentionMetadata(runtime_dtype="bfloat16", softmax_dtype="float32", logits_soft_cap=30.0,
                                   block_q=128, block_k=256, sequence_axis="sp", platform="cpu", softmax_scale=0.125)
    assert set(EASYDEL_ALIASES) == {"runtime_softmax_dtype", "soft_cap", "blocksize_q", "blocksize_k", "blocksize_b",
                                    "sequence_axis_name", "partition_axis", "partition_manager", "base_config",
                                    "scan_ring_attention", "backend"}


def test_easydel_names_without_a_jaxattn_meaning_are_recorded() -> None:
    class PartitionAxis:  # EasyDeL's holds mesh axis names per logical dimension; unhashable is fine here
        __hash__ = None  # type: ignore[assignment]

    config, paxis = object(), PartitionAxis()
    md = AttentionMetadata(blocksize_b=1, partition_axis=paxis, partition_manager=None, base_config=config,
                           scan_ring_attention=True)
    assert dict(md.easydel) == {"blocksize_b": 1, "partition_axis": paxis, "base_config": config,
                                "scan_ring_attention": True}
    # They change nothing jaxattn computes: equal to, and hashed as, the metadata without them.
    assert md == AttentionMetadata() and hash(md) == hash(AttentionMetadata())
    assert md.replace(block_q=64).easydel["base_config"] is config
    with pytest.raises(TypeError):
        md.easydel["blocksize_b"] = 2  # type: ignore[index]
    back = pickle.loads(pickle.dumps(AttentionMetadata(blocksize_b=2, scan_ring_attention=False)))
    assert dict(back.easydel) == {"blocksize_b": 2, "scan_ring_attention": False}


def test_easydel_not_given_markers() -> None:
    # EasyDeL passes ... for "not set" and None for its defaults: both leave jaxattn's default.
    md = AttentionMetadata(runtime_softmax_dtype=None, soft_cap=None, blocksize_q=..., sequence_axis_name=...,
                           backend=None, base_config=None)
    assert md == AttentionMetadata() and not md.easydel


def test_easydel_backend_enum_members() -> None:
    import enum

    class EasyDeLBackends(enum.StrEnum):
        CPU = "cpu"

    assert AttentionMetadata(backend=EasyDeLBackends.CPU).platform == "cpu"
