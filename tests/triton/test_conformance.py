"""``flash_attn2`` (Triton) against the conformance suite.

* On any host: the impl class re-declared for the CPU and run through the Triton
  interpreter (``interpret = True``: the JAX path calls the same kernels through a host
  callback), so the suite checks this plugin's contract (features, declines, outputs,
  log-sum-exp, gradients) in CI. float32 and float16 over the whole default matrix,
  bfloat16 on a subset (the interpreter's bf16 dot needs the patch in ``_env``).
* On an NVIDIA GPU (marked ``gpu``): the registered impl itself, bf16 and fp16.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest

from jaxattn.backend.call import AttentionCall
from jaxattn.backend.output import AttentionOutput
from jaxattn.testing.cases import Case, Level
from jaxattn.testing.conformance import ConformanceSuite
from jaxattn_triton.flash.impl import TritonFlashAttention

from ._env import BF16_DOT_OK, ON_CUDA, needs_interpreter


class InterpretedTritonFlash(TritonFlashAttention):
    """The same impl on a CPU host, kernels interpreted (never registered: tests only)."""

    platforms: ClassVar[frozenset[str]] = frozenset({"cpu"})
    dtypes: ClassVar[frozenset[str]] = frozenset({"float32", "float16", "bfloat16"})
    interpret: ClassVar[bool] = True

    def forward_cpu(self, call: AttentionCall) -> AttentionOutput:
        return self.forward_cuda(call)


BF16_CASES = {"causal_t_lt_s", "mqa_causal", "mask_per_head", "sinks", "combined"}


@needs_interpreter
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
class TestTritonFlashInterpreted(ConformanceSuite):
    impl_class = InterpretedTritonFlash
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16")


@needs_interpreter
@pytest.mark.skipif(not BF16_DOT_OK, reason="this triton's interpreter multiplies bf16 bits as ints")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
class TestTritonFlashInterpretedBfloat16(ConformanceSuite):
    impl_class = InterpretedTritonFlash
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16",)
    # Eagerly in float32 above (the same code); here under jax.jit, both programs.
    eager_dtypes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def cases(cls, level: Level) -> Sequence[Case]:
        every = super().cases(level)
        if level == "full":
            return every
        return [c for c in every if c.name in BF16_CASES]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU (the Triton kernels run natively)")
class TestTritonFlashGpu(ConformanceSuite):
    impl_name = "flash_attn2"
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16")
