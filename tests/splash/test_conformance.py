"""splash on TPU runs the conformance suite in TPU interpret mode on any host.

Splash tiles by the 128-lane width and hands head dims that are not multiples of 128 to
vanilla (as the seed does), so the matrix's small head dims are raised to 128 here (and a
distinct value head dim to 256); the decode case still exercises that fallback. Forward
and gradients against the float64 oracle: every case in float32, a subset in bfloat16
(``JAXATTN_CONFORMANCE=full`` runs everything in both). Masks, biases and dropout are
declined, which the suite checks too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from jaxattn.backend.metadata import AttentionMetadata
from jaxattn.testing.cases import Case, Level
from jaxattn.testing.conformance import ConformanceSuite
from jaxattn.testing.mod_cases import MOD_CASES, ModCase

INTERPRET = AttentionMetadata(platform="tpu", interpret=True)

# Everything splash supports at once: causal with T < S, a causal window, packed
# segments, soft cap, sinks and grouped heads.
COMBINED = Case(
    "combined_splash",
    b=2,
    t=6,
    s=9,
    hq=4,
    hkv=2,
    d=128,
    causal=True,
    sliding_window=(5, 0),
    segments=True,
    logits_soft_cap=3.0,
    sinks=True,
    q_gain=2.0,
)

BF16_CASES = {"causal_t_lt_s", "mqa_causal", "window_causal_cross", "segment_ids", "soft_cap", "sinks"}
BF16_GRAD_CASES = {"causal_t_lt_s", "window_causal_cross", "sinks"}


def lane_sized(case: Case) -> Case:
    """The case with head dims splash runs itself (multiples of 128)."""
    if case.d % 128 == 0 and case.value_dim % 128 == 0:
        return case
    return dataclasses.replace(case, d=128, dv=None if case.dv is None else 256)


def splash_cases(level: Level, base: Sequence[Case]) -> list[Case]:
    return [lane_sized(c) for c in base] + [COMBINED]


class TestSplashConformance(ConformanceSuite):
    impl_name = "splash"
    metadata = INTERPRET
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    # Static mask_mods run in splash's own mask objects; those of b or of traced arrays, and
    # score_mods, are declined (checked).
    mod_cases: ClassVar[tuple[ModCase, ...]] = tuple(dataclasses.replace(c, base=lane_sized(c.base))
                                                     for c in MOD_CASES)

    @classmethod
    def cases(cls, level: Level) -> Sequence[Case]:
        return splash_cases(level, super().cases(level))


class TestSplashConformanceBfloat16(ConformanceSuite):
    impl_name = "splash"
    metadata = INTERPRET
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16",)
    # Eagerly in float32 above (the same code); here under jax.jit, both programs.
    eager_dtypes: ClassVar[tuple[str, ...]] = ()
    mod_cases: ClassVar[tuple[ModCase, ...]] = ()  # float32 above: the mask translation is dtype-blind

    @classmethod
    def cases(cls, level: Level) -> Sequence[Case]:
        every = splash_cases(level, super().cases(level))
        if level == "full":
            return every
        subset = [c for c in every if c.name in BF16_CASES]
        return [dataclasses.replace(c, grad=c.grad and c.name in BF16_GRAD_CASES) for c in subset]
