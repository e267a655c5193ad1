"""The paged mechanisms on TPU (op kind "paged"): ``ragged_page_attention_v3`` (alias ``_v2``) on
the Pallas TPU ragged paged-attention kernel, and ``page_attention`` (decode steps) on JAX's TPU
``paged_attention`` kernel.

What each copies per call, and why:

* ``ragged_page_attention_v3`` (:mod:`jaxattn_pallas.ragged`): the combined layout
  ``(num_pages, page_size, 2 * Hkv, D)`` is the kernel's own and is read in place when D is a
  multiple of 128 and ``2 * Hkv`` tiles the dtype's layout; otherwise (the separate layout, or
  padding of heads or head dims) the whole cache is copied once per call into that layout.
  q is padded (small). ``notes()`` says which, per call;
* ``page_attention`` (:mod:`jaxattn_pallas.paged_kernel`): always copies the whole cache, as the
  kernel reads K and V as ``(Hkv, num_pages, page_size, D)``, a layout neither of the
  contract's is; a float32 or float16 cache is split into bfloat16 terms in that copy, since
  the kernel rounds pages to bfloat16 (``notes()`` gives the bytes).

Ranking on a TPU: the ragged kernel (priority 100) is the faster one for decode steps too (no
transpose of the pool per step, no extra terms for float32) and takes every call shape, so
"auto" runs it first; ``page_attention`` (priority 50) serves that name, and "auto" in TPU
interpret mode (where the ragged kernel cannot run on jax <= 0.11.2) picks it for decode steps.
Both rank above jaxattn-vanilla's pure-JAX references (priority 0), which provide the same names
on every platform. Neither imports a Pallas module until a call runs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

from jaxattn.capabilities import Feature
from jaxattn.output import AttentionOutput
from jaxattn.paged_impl import PagedAttentionImpl
from jaxattn.problem import PagedProblem

from . import paged_rules
from .paged_kernel_rules import plan_paged_kernel

__all__ = ["PallasPagedDecode", "PallasRaggedPagedAttention"]

_REFERENCE = "impl='vanilla_paged' (jaxattn-vanilla's pure-JAX reference) runs it, and impl='auto' picks it"
_INTERPRET = (
    "in TPU interpret mode use 'page_attention' for decode steps (JAX's paged_attention kernel, which interprets; "
    "impl='auto' picks it), or drop the TPU override: on a CPU this name runs jaxattn-vanilla's pure-JAX reference"
)


def _generation(platform: str, device: Any, interpret: bool) -> int | None:
    """The TPU generation number (4 for v4, 5 for v5e/v5p...) of a real TPU host, else None."""
    gen = getattr(device, "tpu_generation", None)
    if platform != "tpu" or interpret or getattr(device, "platform", None) != "tpu" or not gen:
        return None
    match = re.match(r"v(\d+)", gen)
    return int(match.group(1)) if match else None


class _PallasPaged(PagedAttentionImpl):
    """What both share: platform, dtypes, the float32 softmax, the advice on a decline."""

    platforms: ClassVar[frozenset[str]] = frozenset({"tpu"})
    #: Why JAX's kernel does not read jaxattn's quantized caches (Feature.QUANTIZED_KV is not declared).
    quantized_why: ClassVar[str] = ""

    def instead(self) -> str:
        """Where a call this backend declines runs: jaxattn-vanilla's reference."""
        return "instead: " + _REFERENCE

    def kernel_reasons(self, problem: PagedProblem) -> list[str]:
        """The kernel's own limits beyond the declarations (each with its own advice)."""
        return []

    def not_supported_reasons(self, problem: PagedProblem) -> list[str]:
        declared = self.declared_reasons(problem)
        # The base class starts from the declarations and adds the op kind's own rules (the mesh).
        rest = super().not_supported_reasons(problem)[len(declared):]
        own = []
        if self.metadata.softmax_dtype != "float32":
            own.append(f"the kernel computes the softmax in float32; softmax_dtype={self.metadata.softmax_dtype!r} "
                       "cannot be honoured")
        if problem.kv_dtype is not None and self.quantized_why:
            own.append(f"a cache of dtype {problem.kv_dtype}: {self.quantized_why}")
        mine = [f"{r}; {self.instead()}" for r in declared + own]
        return mine + self.kernel_reasons(problem) + rest

    def generation(self) -> int | None:
        return _generation(self.platform, self.device, self.metadata.interpret)


class PallasRaggedPagedAttention(_PallasPaged):
    """Ragged paged attention on TPU (jax.experimental.pallas.ops.tpu.ragged_paged_attention)."""

    dtypes: ClassVar[frozenset[str]] = frozenset(paged_rules.SUPPORTED_DTYPES)
    features: ClassVar[frozenset[Feature]] = frozenset({
        Feature.GQA, Feature.VALUE_DIM, Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.MULTI_TOKEN,
        Feature.RAGGED,
    })
    # Above page_attention (50) and the pure-JAX references (0): the TPU's fastest paged kernel.
    priority: ClassVar[int] = 100
    quantized_why: ClassVar[str] = (
        "JAX's ragged_paged_attention takes k_scale and v_scale as Python floats (one static scale per tensor), "
        "never an array of scales per head or token, nor one traced under jit")
    description: ClassVar[str] = "Pallas TPU ragged paged attention (mixed prefill and decode, window, soft cap)"

    @classmethod
    def get_impl_name(cls) -> tuple[str, ...]:
        return ("ragged_page_attention_v3", "ragged_page_attention_v2")

    def _facts(self, problem: PagedProblem) -> dict[str, Any]:
        # An unsupported dtype is the declarations' to decline; the kernel's other rules do not
        # depend on it, so they are asked with a dtype it takes (one reason, not three).
        dtype = self.compute_dtype(problem)
        dtype = dtype if dtype in paged_rules.SUPPORTED_DTYPES else "float32"
        return {
            "q_dtype": dtype, "kv_dtype": dtype, "num_q_heads": problem.heads_q, "num_kv_heads": problem.heads_kv,
            "head_dim": problem.head_dim, "v_head_dim": problem.head_dim_v, "layout": problem.kv_layout,
            "page_size": problem.page_size,
        }

    def kernel_reasons(self, problem: PagedProblem) -> list[str]:
        # Sinks are declined by the declarations (no Feature.SINKS), so not asked again here.
        asked = {**self._facts(problem), "window_left": problem.sliding_window,
                 "logits_soft_cap": problem.logits_soft_cap, "tpu_generation": self.generation()}
        reasons = paged_rules.ragged_reasons(**asked)
        interpret = self.platform == "tpu" and self.metadata.interpret
        broken = [r for r in paged_rules.ragged_reasons(**asked, interpret=interpret) if r not in reasons]
        return [f"{r}; {self.instead()}" for r in reasons] + [f"{r}; {_INTERPRET}" for r in broken]

    def notes(self, problem: PagedProblem) -> list[str]:
        facts = self._facts(problem)
        plan = paged_rules.plan_ragged(**facts, pages_per_seq=problem.pages_per_seq, num_tokens=problem.num_tokens,
                                       window_left=problem.sliding_window)
        copy = (f"copies the whole KV cache per call ({plan.cache_copy})" if plan.cache_copy
                else "reads the combined KV cache in place")
        return [copy, f"blocks: {plan.num_queries_per_block} query rows x {plan.num_kv_pages_per_block} pages"]

    def forward_tpu(self, q: Any, k_pages: Any, v_pages: Any, **features: Any) -> AttentionOutput:
        import jax.numpy as jnp

        from jaxattn.tracing import traced_under, x64_off

        from .ragged import ragged_paged_attention

        combined = features["kv_layout"] == "combined"
        kv = k_pages if combined else None
        k, v = (None, None) if combined else (k_pages, v_pages)

        def run(q: Any, k: Any, v: Any, kv: Any, table: Any, lengths: Any, cu: Any, n: Any) -> Any:
            return ragged_paged_attention(
                q, k, v, table, lengths, cu, n, kv_pages=kv, softmax_scale=features["softmax_scale"],
                logits_soft_cap=features["logits_soft_cap"], window_left=features["sliding_window"],
                sinks=features["softmax_aux"], interpret=self.metadata.interpret,
            )

        # The kernel and the wrapper's index arithmetic run in int32 with x64 off (Pallas TPU
        # kernels break under jax_enable_x64); the indices are cast before, under the caller's mode.
        names = ("page_table", "kv_lengths", "cu_q_lens", "num_seqs")
        ints = [jnp.asarray(features[n]).astype(jnp.int32) for n in names]
        out = traced_under(run, x64_off)(q, k, v, kv, *ints)
        return AttentionOutput(attention_outputs=out)


class PallasPagedDecode(_PallasPaged):
    """``page_attention``: decode steps (T == 1) on TPU (jax.experimental.pallas.ops.tpu.paged_attention)."""

    # float32 and float16 are split into bfloat16 terms for the kernel, exactly (paged_kernel_rules).
    dtypes: ClassVar[frozenset[str]] = frozenset({"float32", "bfloat16", "float16"})
    # One query per sequence, no window, no sinks: the kernel has none of them.
    features: ClassVar[frozenset[Feature]] = frozenset({Feature.GQA, Feature.VALUE_DIM, Feature.SOFT_CAP})
    # Below the ragged kernel (100), which is faster on a TPU (see the module docstring); this
    # one serves the name ``page_attention`` and, in TPU interpret mode, "auto"'s decode steps.
    priority: ClassVar[int] = 50
    quantized_why: ClassVar[str] = (
        "JAX's paged_attention reads int8 only (no float8), as a QuantizedTensor whose scales it broadcasts to "
        "the head dim (float32: 4x the bytes of the int8 values, in the kernel's layout, which this backend "
        "already copies the whole cache into per call), so it would read more bytes than the float cache")
    description: ClassVar[str] = "Pallas TPU paged decode (JAX's paged_attention kernel; runs in interpret mode)"

    @classmethod
    def get_impl_name(cls) -> str:
        return "page_attention"

    def not_supported_reasons(self, problem: PagedProblem) -> list[str]:
        # What the ragged kernel runs on a TPU is declined here with that advice; the rest
        # (dtype, head dims, sinks, platform...) with the reference's.
        trimmed = dataclasses.replace(problem, queries_per_seq=1, sliding_window=None)
        reasons = super().not_supported_reasons(trimmed)
        ragged = (
            "instead: ragged_page_attention_v3 runs it on a TPU (impl='auto' picks it), but not in TPU interpret "
            "mode on jax <= 0.11.2, where "
        )
        decode = ragged + self.instead().removeprefix("instead: ")
        if problem.queries_per_seq is None:
            reasons.append("ragged batches (per-sequence query counts) are not supported by page_attention: JAX's "
                           "paged_attention kernel takes one query per sequence; "
                           + ragged + self.instead().removeprefix("instead: "))
        elif problem.queries_per_seq != 1:
            reasons.append(f"{problem.queries_per_seq} queries per sequence are not supported by page_attention: "
                           f"JAX's paged_attention kernel takes one query per sequence; {decode}")
        if problem.sliding_window is not None:
            reasons.append(f"a sliding window is not supported by page_attention: JAX's paged_attention kernel has "
                           f"none; {decode}")
        return reasons

    def kernel_reasons(self, problem: PagedProblem) -> list[str]:
        gen = self.generation()
        if gen is not None and gen < 4:
            return [f"JAX's TPU paged_attention kernel needs TPU v4 or newer (upstream skips below v4); "
                    f"{self.instead()}"]
        return []

    def _plan(self, problem: PagedProblem) -> Any:
        dtype = self.compute_dtype(problem)
        return plan_paged_kernel(dtype=dtype if dtype in self.dtypes else "float32", num_kv_heads=problem.heads_kv,
                                 head_dim=problem.head_dim, v_head_dim=problem.head_dim_v,
                                 page_size=problem.page_size, num_pages=problem.num_pages,
                                 pages_per_seq=problem.pages_per_seq)

    def notes(self, problem: PagedProblem) -> list[str]:
        plan = self._plan(problem)
        return [plan.describe_copy(self.compute_dtype(problem), problem.kv_layout),
                f"blocks of {plan.pages_per_compute_block} pages"]

    def forward_tpu(self, q: Any, k_pages: Any, v_pages: Any, **features: Any) -> AttentionOutput:
        from .paged_kernel import paged_attention_decode

        # Declined otherwise: one query per sequence, so row s is sequence s (cu_q_lens is arange).
        assert features["queries_per_seq"] == 1
        assert features["sliding_window"] is None
        assert features["softmax_aux"] is None
        combined = features["kv_layout"] == "combined"
        out = paged_attention_decode(
            q, None if combined else k_pages, None if combined else v_pages, features["page_table"],
            features["kv_lengths"], features["num_seqs"], kv_pages=k_pages if combined else None,
            softmax_scale=features["softmax_scale"], logits_soft_cap=features["logits_soft_cap"],
            interpret=self.metadata.interpret,
        )
        return AttentionOutput(attention_outputs=out)
