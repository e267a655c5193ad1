"""The Triton serving backends against the conformance suites, through the Triton interpreter.

* ``ragged_page_attention_v3`` and ``page_attention`` (kind "paged") against
  ``PagedConformanceSuite``: every paged case, under jit, uniform ones through
  ``jaxattn.paged_attention`` too, x64 indices, and the mask_mod cases (``page_attention``
  declines them);
* ``autoregressive_decodeattn`` (dense) against ``ConformanceSuite``: decode, GQA, cross,
  kv_lengths, window, soft cap, sinks, value dim, with gradients (the flash backward on the
  split-K forward's output), and declines (masks, bias, segments, T > 16).

Each impl class is re-declared for the CPU with ``interpret = True`` (its ``forward_cpu`` runs
``forward_cuda``, whose launches go through a host callback to the Triton interpreter), as
``test_conformance`` does for flash_attn2, with float32 added: the interpreter multiplies
float32 exactly, where a GPU's tensor cores would use TF32 (the registered classes decline it).
On an NVIDIA GPU (marked ``gpu``) the registered impls themselves run, bf16 and fp16.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest

from jaxattn.backend.call import AttentionCall, PagedCall
from jaxattn.backend.output import AttentionOutput
from jaxattn.testing.cases import Case, Level, cases_for
from jaxattn.testing.conformance import ConformanceSuite
from jaxattn.testing.paged_cases import PAGED_MOD_CASES, PagedCase
from jaxattn.testing.paged_conformance import PagedConformanceSuite
from jaxattn_triton.decode.impl import MAX_DECODE_QUERIES, TritonDecodeAttention
from jaxattn_triton.paged.impl import TritonPagedDecode, TritonRaggedPagedAttention

from ._env import BF16_DOT_OK, ON_CUDA, needs_interpreter

_CPU = frozenset({"cpu"})
_INTERPRETED_DTYPES = frozenset({"float32", "float16", "bfloat16"})


class InterpretedRaggedPaged(TritonRaggedPagedAttention):
    """ragged_page_attention_v3 on a CPU host, kernels interpreted (never registered: tests only)."""

    platforms: ClassVar[frozenset[str]] = _CPU
    dtypes: ClassVar[frozenset[str]] = _INTERPRETED_DTYPES
    interpret: ClassVar[bool] = True

    def forward_cpu(self, call: PagedCall) -> AttentionOutput:
        return self.forward_cuda(call)


class InterpretedPagedDecode(TritonPagedDecode):
    """page_attention on a CPU host, kernels interpreted (tests only)."""

    platforms: ClassVar[frozenset[str]] = _CPU
    dtypes: ClassVar[frozenset[str]] = _INTERPRETED_DTYPES
    interpret: ClassVar[bool] = True

    def forward_cpu(self, call: PagedCall) -> AttentionOutput:
        return self.forward_cuda(call)


class InterpretedDecode(TritonDecodeAttention):
    """autoregressive_decodeattn on a CPU host, kernels interpreted (tests only)."""

    platforms: ClassVar[frozenset[str]] = _CPU
    dtypes: ClassVar[frozenset[str]] = _INTERPRETED_DTYPES
    interpret: ClassVar[bool] = True

    def forward_cpu(self, call: AttentionCall) -> AttentionOutput:
        return self.forward_cuda(call)


# -- paged --------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
class TestTritonRaggedPagedInterpreted(PagedConformanceSuite):
    impl_class = InterpretedRaggedPaged
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
class TestTritonPagedDecodeInterpreted(PagedConformanceSuite):
    impl_class = InterpretedPagedDecode
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
class TestTritonRaggedPagedInterpretedFloat16(PagedConformanceSuite):
    impl_class = InterpretedRaggedPaged
    dtypes: ClassVar[tuple[str, ...]] = ("float16",)
    # Eagerly in float32 (TestTritonRaggedPagedInterpreted, the same code); here under jax.jit.
    eager_dtypes: ClassVar[tuple[str, ...]] = ()


# A subset in bfloat16: the layouts, GQA, sinks, window and soft cap, ragged and uniform.
_BF16_PAGED = {"decode_gqa_8to1_permuted", "speculative", "ragged_mixed", "combined_everything"}


@needs_interpreter
@pytest.mark.skipif(not BF16_DOT_OK, reason="this triton's interpreter multiplies bf16 bits as ints")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
class TestTritonRaggedPagedInterpretedBfloat16(PagedConformanceSuite):
    impl_class = InterpretedRaggedPaged
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16",)
    # Eagerly in float32 (TestTritonRaggedPagedInterpreted, the same code); here under jax.jit.
    eager_dtypes: ClassVar[tuple[str, ...]] = ()

    # One mask_mod case: the draft tree in a ragged batch (every one runs in float32 and float16).
    mod_cases: ClassVar[Sequence[PagedCase]] = [c for c in PAGED_MOD_CASES if c.name == "mm_tree"]

    @classmethod
    def cases(cls, level: Level) -> Sequence[PagedCase]:
        every = super().cases(level)
        return every if level == "full" else [c for c in every if c.name in _BF16_PAGED]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU (the Triton kernels run natively)")
class TestTritonRaggedPagedGpu(PagedConformanceSuite):
    impl_name = "ragged_page_attention_v3"
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU (the Triton kernels run natively)")
class TestTritonPagedDecodeGpu(PagedConformanceSuite):
    impl_name = "page_attention"
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16")


# -- dense decode ---------------------------------------------------------------------------------


def _decode_cases(level: Level) -> list[Case]:
    """The default matrix plus the full level's decode-shaped cases (T <= 16, no mask, bias or
    segments): kv_lengths with an empty sequence, a window, sinks and a soft cap; MQA decode
    with a window; odd head dims; D = 128."""
    every = list(cases_for("full"))
    if level == "full":
        return every
    default = {c.name for c in cases_for("default")}
    extra = [c for c in every if c.name not in default and c.t <= MAX_DECODE_QUERIES and c.mask is None
             and c.bias is None and not c.segments]
    return [*cases_for("default"), *extra]


@needs_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
class TestTritonDecodeInterpreted(ConformanceSuite):
    impl_class = InterpretedDecode
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16")

    @classmethod
    def cases(cls, level: Level) -> Sequence[Case]:
        return _decode_cases(level)


_BF16_DECODE = {"decode", "mqa_causal", "kv_lengths_decode", "kv_lengths_spec", "kv_lengths_sinks_cap", "sinks"}


@needs_interpreter
@pytest.mark.skipif(not BF16_DOT_OK, reason="this triton's interpreter multiplies bf16 bits as ints")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
class TestTritonDecodeInterpretedBfloat16(ConformanceSuite):
    impl_class = InterpretedDecode
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16",)
    # Eagerly in float32 (TestTritonDecodeInterpreted, the same code); here under jax.jit.
    eager_dtypes: ClassVar[tuple[str, ...]] = ()
    # The lengths sweep ran in float32 above; here the cases only.
    backward_lengths: ClassVar[tuple[tuple[int, int], ...]] = ((1, 1),)

    @classmethod
    def cases(cls, level: Level) -> Sequence[Case]:
        every = _decode_cases(level)
        return every if level == "full" else [c for c in every if c.name in _BF16_DECODE]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU (the Triton kernels run natively)")
class TestTritonDecodeGpu(ConformanceSuite):
    impl_name = "autoregressive_decodeattn"
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16")
