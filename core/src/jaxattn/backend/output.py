"""``AttentionOutput``: what every backend returns."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

__all__ = ["AttentionOutput"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionOutput:
    """The result of one attention call.

    ``attention_outputs`` is ``(B, T, Hq, Dv)``; ``attention_weights`` is ``(B, Hq, T, S)``
    probabilities or None where a kernel never forms them; ``softmax_lse`` is ``(B, Hq, T)``
    float32 log-sum-exp of the final logits over real keys (sink excluded, ``-inf`` for rows
    with nothing to attend to) or None where the kernel does not expose it.
    """

    attention_outputs: Any
    attention_weights: Any = None
    softmax_lse: Any = None
