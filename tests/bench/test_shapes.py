"""``BenchShape``'s features (a sliding window, a soft cap): the call it stands for, its label,
and the FLOPs a window leaves, against brute force; the ``--window`` option's parsing."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from jaxattn_bench.cli import window_spec
from jaxattn_bench.shapes import BenchShape


@pytest.mark.parametrize(("t", "s", "causal", "window"), [
    (64, 64, False, (8, 8)), (64, 64, True, (8, 0)), (64, 64, True, (8, 3)), (33, 70, False, (0, 0)),
    (70, 33, True, (5, 200)), (70, 33, False, (100, 100)), (16, 16, False, None), (16, 16, True, None),
])  # fmt: skip
def test_pairs_are_the_query_key_pairs_a_window_leaves(t: int, s: int, causal: bool,
                                                       window: tuple[int, int] | None) -> None:
    shape = BenchShape(1, t, s, 2, 2, 8, causal, "float32", sliding_window=window)
    if window is None:  # the convention without a window: causal halves T * S
        assert shape.pairs() == t * s / (2 if causal else 1)
        return
    pos = np.arange(t)[:, None] + (s - t)
    key = np.arange(s)[None, :]
    sees = (key >= pos - window[0]) & (key <= pos + window[1])
    if causal:
        sees &= key <= pos
    assert shape.pairs() == sees.sum()
    assert shape.flops("fwd") == 4 * 2 * sees.sum() * 8
    assert shape.flops("fwdbwd") == 3.5 * shape.flops("fwd")


def test_a_shape_with_features_says_them_and_passes_them_on() -> None:
    plain = BenchShape(2, 64, 64, 4, 4, 32, True, "float32")
    assert plain.call_kwargs == {"causal": True} and plain.label == "B2 S64 H4 D32 causal"
    both = BenchShape(2, 64, 64, 4, 4, 32, False, "float32", sliding_window=(16, 4), soft_cap=30.0)
    assert both.call_kwargs == {"causal": False, "sliding_window": (16, 4), "logits_soft_cap": 30.0}
    assert both.label == "B2 S64 H4 D32 full window 16,4 cap 30"


def test_the_window_option_takes_one_side_or_two() -> None:
    assert window_spec("1024") == (1024, 1024)
    assert window_spec("1024,0") == (1024, 0)
    for bad in ("-1", "1,2,3", "a", "4,-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="W or L,R"):
            window_spec(bad)
