"""``PartitionSpec``s of every operand of an attention call, derived from the metadata's axes.

Layout BTHD: q ``(B, T, Hq, D)``, k/v ``(B, S, Hkv, D)``; mask and bias are rank 4
``(B|1, Hq|1, T|1, S|1)``; segment ids ``(B, T)`` / ``(B, S)``; ``softmax_aux`` ``(Hq,)``.
A dimension of size 1 that broadcasts is never sharded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import PartitionSpec as P

from .axes import MeshAxes

__all__ = ["AttentionSpecs", "Entry"]

Entry = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class AttentionSpecs:
    """Spec entries per logical dimension; methods give each operand's full spec."""

    batch: Entry = None
    heads: Entry = None
    kv_heads: Entry = None
    seq_q: Entry = None
    seq_k: Entry = None

    @classmethod
    def from_axes(cls, axes: MeshAxes, *, shard_kv_heads: bool = True, shard_sequence: bool = False) -> AttentionSpecs:
        heads = axes.spec_entry(axes.heads)
        seq = axes.spec_entry(axes.sequence) if shard_sequence else None
        return cls(batch=axes.spec_entry(axes.batch), heads=heads, kv_heads=heads if shard_kv_heads else None,
                   seq_q=seq, seq_k=seq)

    @property
    def q(self) -> P:
        return P(self.batch, self.seq_q, self.heads, None)

    @property
    def kv(self) -> P:
        return P(self.batch, self.seq_k, self.kv_heads, None)

    @property
    def out(self) -> P:
        return P(self.batch, self.seq_q, self.heads, None)

    @property
    def weights(self) -> P:
        return P(self.batch, self.heads, self.seq_q, self.seq_k)

    @property
    def lse(self) -> P:
        return P(self.batch, self.heads, self.seq_q)

    @property
    def q_ids(self) -> P:
        return P(self.batch, self.seq_q)

    @property
    def kv_ids(self) -> P:
        return P(self.batch, self.seq_k)

    @property
    def lengths(self) -> P:
        return P(self.batch)

    @property
    def aux(self) -> P:
        return P(self.heads)

    def broadcast(self, x: Any, full: tuple[int, int, int, int], *, shard_keys: bool = True) -> P | None:
        """Spec of a rank-4 mask or bias: full-size dims sharded like the call, size-1 dims replicated.

        ``shard_keys=False`` keeps the key dim whole on every device (ring attention slices
        it per step instead, as the keys travel).
        """
        if x is None:
            return None
        entries = (self.batch, self.heads, self.seq_q, self.seq_k if shard_keys else None)
        return P(*(e if dim == size and dim != 1 else None
                   for e, dim, size in zip(entries, x.shape, full, strict=True)))
