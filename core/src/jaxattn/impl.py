"""``AttentionImpl``: the contract every backend implements.

Capabilities are class attributes (declared, not probed); ``not_supported_reasons`` returns
*every* reason a call cannot run; ``__call__`` validates, checks, then routes to the
``forward_<platform>`` method for the device, vLLM style.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from .capabilities import Feature, describe_features, head_dim_reason, platform_matches
from .device import DeviceInfo, detect_device
from .errors import PluginError, UnsupportedError
from .metadata import DEFAULT_METADATA, AttentionMetadata
from .problem import AttentionProblem
from .validation import CallSpec, resolve_call

if TYPE_CHECKING:
    from .output import AttentionOutput

__all__ = ["DIRECT", "AttentionImpl", "Call", "DirectRunner", "Forward", "Runner", "sequence_reasons"]


_FEATURE_TEXT = {
    Feature.CAUSAL: "causal masking",
    Feature.MASK: "a boolean mask",
    Feature.BIAS: "an additive bias",
    Feature.GQA: "grouped/multi-query heads (Hq != Hkv)",
    Feature.CROSS: "different query and key lengths (T != S)",
    Feature.DECODE: "decode steps (T == 1)",
    Feature.VALUE_DIM: "a value head dim different from the query/key head dim",
    Feature.SLIDING_WINDOW: "a sliding window",
    Feature.SEGMENT_IDS: "segment ids",
    Feature.SOFT_CAP: "a logits soft cap",
    Feature.SINKS: "attention sinks (softmax_aux)",
    Feature.DROPOUT: "dropout",
    Feature.GRAD: "gradients",
}

def _resolve_platform(metadata: AttentionMetadata, device: DeviceInfo) -> tuple[str, str | None]:
    override = metadata.platform
    if override is None:
        return device.platform, device.vendor
    if override in ("cuda", "rocm"):
        return "gpu", override
    if override == "gpu":
        return "gpu", device.vendor or "cuda"
    return override, None


#: Array arguments a forward takes besides q, k and v.
ARRAY_ARGUMENTS = ("mask", "bias", "q_segment_ids", "kv_segment_ids", "softmax_aux", "dropout_rng")

#: Features whose description is plural (for the grammar of decline reasons).
_PLURAL = frozenset({Feature.GQA, Feature.CROSS, Feature.DECODE, Feature.SEGMENT_IDS, Feature.SINKS, Feature.GRAD})


def _refuse_gradients(
    forward: Callable[..., AttentionOutput], name: str, reasons: list[str]
) -> Callable[..., AttentionOutput]:
    """Wrap a forward so that differentiating it raises ``UnsupportedError`` with ``reasons``
    instead of failing deep inside a kernel (or, worse, differentiating something that is not
    the kernel's math).

    The error comes from the custom VJP's forward rule, which JAX traces only when the call is
    differentiated: an undifferentiated call runs the plain forward (the wrapper is transparent
    in the compiled program).
    """
    import jax

    def run(q: Any, k: Any, v: Any, **kwargs: Any) -> AttentionOutput:
        arrays = {n: kwargs.pop(n) for n in ARRAY_ARGUMENTS}

        @jax.custom_vjp
        def call(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> AttentionOutput:
            return forward(q, k, v, **arrays, **kwargs)

        def fwd(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> tuple[AttentionOutput, None]:
            raise UnsupportedError(name, reasons, gradient=True)

        def bwd(_: None, __: Any) -> Any:  # never reached: fwd raises
            raise UnsupportedError(name, reasons, gradient=True)

        call.defvjp(fwd, bwd)
        return call(q, k, v, arrays)

    run.__name__ = getattr(forward, "__name__", "forward")
    return run


def sequence_reasons(impl_name: str, sequence_parallel: bool, metadata: AttentionMetadata) -> list[str]:
    """Why an impl cannot honour ``metadata.sequence_axis`` (empty when it can or none is set)."""
    if metadata.sequence_axis is None or sequence_parallel:
        return []
    return [
        f"metadata.sequence_axis={metadata.sequence_axis!r} shards the sequence, but {impl_name} runs whole "
        "sequences on each device (shard_map over batch and heads only); use impl='ring' (which runs a "
        "per-block kernel such as vanilla), or leave sequence_axis unset"
    ]


Forward = Callable[..., "AttentionOutput"]


@dataclasses.dataclass(frozen=True)
class Call:
    """One accepted call, validated and normalised: what a ``forward_*`` method receives.

    ``kwargs`` holds mask and bias at rank 4 (or None), ``init_bias=None``, ``causal`` and every
    feature keyword (window pair, segment ids, float scale, soft cap, sinks, dropout).
    """

    q: Any
    k: Any
    v: Any
    kwargs: dict[str, Any]


class Runner(Protocol):
    """How a call that an impl accepted runs: passed down by whoever built the impl.

    ``jaxattn.get_impl`` builds impls with a runner that hands calls to ``fallback_impl`` and
    wraps kernels in ``shard_map`` when the metadata carries a mesh (``jaxattn.compose``); an
    impl constructed directly runs its own kernel on the arrays it is given (``DIRECT``).
    """

    def reasons(self, impl: AttentionImpl, problem: AttentionProblem) -> list[str]:
        """Why this runner cannot run ``problem`` with ``impl`` (beyond the impl's own reasons)."""
        ...

    def run(self, impl: AttentionImpl, problem: AttentionProblem, call: Call) -> AttentionOutput:
        """Run an accepted call."""
        ...


class DirectRunner:
    """The runner of an impl built directly: its own kernel, on the arrays given, nothing around it."""

    def reasons(self, impl: AttentionImpl, problem: AttentionProblem) -> list[str]:
        reasons = []
        md = impl.metadata
        if md.mesh is not None and (md.batch_axis or md.head_axis) and not impl.sequence_parallel:
            reasons.append(
                f"metadata.mesh shards the batch or heads, but this {type(impl).__name__} was constructed "
                "directly, so nothing wraps its kernel in shard_map; build it with jaxattn.get_impl(name, metadata)"
            )
        if md.allow_fallback:
            reasons += [f"{r} (would hand the call to {impl.fallback_impl}, which only an impl built by "
                        "jaxattn.get_impl can do)" for r in impl.fallback_reasons(problem)]
        return reasons

    def run(self, impl: AttentionImpl, problem: AttentionProblem, call: Call) -> AttentionOutput:
        return impl.run_kernel(problem, call)


#: The runner of impls that were constructed directly.
DIRECT = DirectRunner()


class AttentionImpl:
    """Base class of attention backends. Subclass it, declare capabilities, override forwards."""

    #: Platform tokens this impl runs on: "cpu", "gpu", "tpu", or a GPU vendor "cuda" / "rocm".
    platforms: ClassVar[frozenset[str]] = frozenset({"cpu", "gpu", "tpu"})
    #: Compute dtypes accepted (after ``metadata.runtime_dtype`` is applied).
    dtypes: ClassVar[frozenset[str]] = frozenset({"float32", "bfloat16", "float16"})
    #: Head dims accepted: an inclusive ``(lo, hi)`` range or a set of sizes.
    head_dims: ClassVar[tuple[int, int] | frozenset[int]] = (1, 1 << 16)
    #: Features beyond plain attention this impl runs exactly (see ``Feature``).
    features: ClassVar[frozenset[Feature]] = frozenset()
    #: Higher wins, both for "auto" and among providers of one name on one platform.
    priority: ClassVar[int] = 0
    #: Name of the impl this one hands calls to when ``fallback_reasons`` is non-empty.
    fallback_impl: ClassVar[str | None] = None
    #: One line for listings.
    description: ClassVar[str] = ""
    #: True for impls that shard the sequence themselves (ring): the core then neither wraps
    #: their forward in ``shard_map`` nor declines ``metadata.sequence_axis`` for them.
    sequence_parallel: ClassVar[bool] = False
    #: How an accepted call runs; ``jaxattn.get_impl`` sets its own on the instances it builds.
    runner: Runner = DIRECT

    def __init__(self, metadata: AttentionMetadata | None = None, device: DeviceInfo | None = None) -> None:
        self.metadata = metadata if metadata is not None else DEFAULT_METADATA
        self.device = device if device is not None else detect_device()
        self.platform, self.vendor = _resolve_platform(self.metadata, self.device)
        self._grad_reasons: dict[AttentionProblem, tuple[str, ...]] = {}

    # -- identity ---------------------------------------------------------------------------
    @classmethod
    def get_impl_name(cls) -> str | tuple[str, ...]:
        """The name, or a tuple whose first item is the name and the rest aliases."""
        raise NotImplementedError(f"{cls.__qualname__} must define get_impl_name()")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        raw = cls.get_impl_name()
        names = (raw,) if isinstance(raw, str) else tuple(raw)
        return tuple(str(n).lower() for n in names)

    @classmethod
    def name(cls) -> str:
        return cls.names()[0]

    def get_impl_metadata(self) -> AttentionMetadata:
        """The metadata this instance was bound with."""
        return self.metadata

    @classmethod
    def priority_for(cls, device: DeviceInfo) -> int:
        """Priority on ``device``; override to rank by hardware generation."""
        return cls.priority

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """The declared capabilities, as plain data (for listings and ``--json``)."""
        dims = cls.head_dims
        return {
            "platforms": sorted(cls.platforms),
            "dtypes": sorted(cls.dtypes),
            "head_dims": list(dims) if isinstance(dims, tuple) else sorted(dims),
            "features": sorted(str(f) for f in cls.features),
            "priority": cls.priority,
            "fallback_impl": cls.fallback_impl,
        }

    # -- what can run -----------------------------------------------------------------------
    def compute_dtype(self, problem: AttentionProblem) -> str:
        return self.metadata.runtime_dtype or problem.dtype

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        """Every reason this impl cannot run ``problem`` here; empty when it can.

        Subclasses extend it: ``reasons = super().not_supported_reasons(problem)``.
        """
        reasons: list[str] = []
        name = self.name()
        where = self.platform + (f"/{self.vendor}" if self.platform == "gpu" and self.vendor else "")
        if not platform_matches(self.platforms, self.platform, self.vendor):
            reasons.append(f"runs on {describe_features(self.platforms)}; this platform is {where}")
        elif self.platform not in ("cpu", self.device.platform):
            if self.platform == "tpu" and self.metadata.interpret:
                pass  # Pallas TPU kernels in interpret mode run on any host
            elif self.platform == "tpu":
                reasons.append(
                    f"metadata.platform='tpu' but this host is {self.device.label}; "
                    "set AttentionMetadata(interpret=True) to run TPU kernels in interpret mode"
                )
            else:
                reasons.append(f"metadata.platform={self.metadata.platform!r} but this host is {self.device.label}")
        dtype = self.compute_dtype(problem)
        if dtype not in self.dtypes:
            reasons.append(
                f"dtype {dtype} is not supported (supported: {describe_features(self.dtypes)}); "
                "cast the inputs or set AttentionMetadata(runtime_dtype=...)"
            )
        for label, dim in (("head dim", problem.head_dim), ("value head dim", problem.head_dim_v)):
            why = head_dim_reason(label, dim, self.head_dims)
            if why:
                reasons.append(why)
        missing = sorted(problem.required_features() - self.features, key=str)
        reasons += [f"{_FEATURE_TEXT.get(f, str(f))} {'are' if f in _PLURAL else 'is'} not supported by {name}"
                    for f in missing]
        reasons += sequence_reasons(name, self.sequence_parallel, self.metadata)
        return reasons

    def notes(self, problem: AttentionProblem) -> list[str]:
        """How this impl would run an accepted ``problem`` here (shown by ``explain``)."""
        return []

    def fallback_reasons(self, problem: AttentionProblem) -> list[str]:
        """Why this impl would hand ``problem`` to ``fallback_impl`` instead of its own kernel."""
        return []

    def supports(
        self,
        q: Any,
        k: Any,
        v: Any,
        mask: Any = None,
        bias: Any = None,
        init_bias: Callable[[], Any] | None = None,
        causal: bool = False,
        *,
        needs_grad: bool = False,
        **features: Any,
    ) -> list[str]:
        """Every reason this impl cannot run the call (arrays or ShapeDtypeStructs); [] if it can."""
        spec = resolve_call(q, k, v, mask=mask, bias=bias, init_bias=init_bias, causal=causal,
                            metadata=self.metadata, **features)
        problem = self.problem(q, k, v, mask, spec, features.get("softmax_aux"), needs_grad)
        return self.reasons_to_decline(problem) + self.runner.reasons(self, problem)

    def reasons_to_decline(self, problem: AttentionProblem) -> list[str]:
        """``not_supported_reasons``, plus the fallback conditions when fallback is not allowed."""
        reasons = self.not_supported_reasons(problem)
        if not self.metadata.allow_fallback:
            reasons += [f"{r} (would fall back to {self.fallback_impl}, but allow_fallback=False)"
                        for r in self.fallback_reasons(problem)]
        return reasons

    def grad_reasons(self, problem: AttentionProblem) -> list[str]:
        """Every reason this impl cannot differentiate ``problem`` (empty when its backward runs it).

        A forward cannot know whether a gradient will follow; the call checks this once and
        arms a guard that raises these reasons if the call is differentiated.
        """
        key = dataclasses.replace(problem, needs_grad=True)
        cached = self._grad_reasons.get(key)
        if cached is None:
            cached = self._grad_reasons[key] = tuple(self.reasons_to_decline(key))
        return list(cached)

    def problem(
        self, q: Any, k: Any, v: Any, mask: Any, spec: CallSpec, softmax_aux: Any = None, needs_grad: bool = False
    ) -> AttentionProblem:
        return AttentionProblem.from_inputs(
            q, k, v, mask=mask, bias=spec.bias, causal=spec.causal, sliding_window=spec.sliding_window,
            q_segment_ids=spec.q_segment_ids, kv_segment_ids=spec.kv_segment_ids,
            logits_soft_cap=spec.logits_soft_cap, softmax_aux=softmax_aux, dropout_prob=spec.dropout_prob,
            needs_grad=needs_grad, dtype=self.metadata.runtime_dtype or q.dtype,
        )

    # -- running ----------------------------------------------------------------------------
    def __call__(
        self,
        q: Any,
        k: Any,
        v: Any,
        mask: Any = None,
        bias: Any = None,
        init_bias: Callable[[], Any] | None = None,
        causal: bool = False,
        **features: Any,
    ) -> AttentionOutput:
        """Validate, check support (one error with every reason), then run on this device."""
        softmax_aux = features.pop("softmax_aux", None)
        dropout_rng = features.pop("dropout_rng", None)
        spec = resolve_call(q, k, v, mask=mask, bias=bias, init_bias=init_bias, causal=causal,
                            softmax_aux=softmax_aux, dropout_rng=dropout_rng, metadata=self.metadata, **features)
        problem = self.problem(q, k, v, mask, spec, softmax_aux)
        reasons = self.reasons_to_decline(problem) + self.runner.reasons(self, problem)
        if reasons:
            raise UnsupportedError(self.name(), reasons)
        return self.runner.run(self, problem, self.prepare(q, k, v, mask, spec, softmax_aux, dropout_rng))

    def prepare(self, q: Any, k: Any, v: Any, mask: Any, spec: CallSpec, softmax_aux: Any,
                dropout_rng: Any) -> Call:
        """The normalised call: inputs in ``metadata.runtime_dtype``, mask and bias at rank 4."""
        import jax.numpy as jnp

        if self.metadata.runtime_dtype is not None:
            dtype = jnp.dtype(self.metadata.runtime_dtype)
            q, k, v = (x.astype(dtype) for x in (q, k, v))
        mask = None if mask is None else jnp.reshape(mask, (1,) * (4 - mask.ndim) + tuple(mask.shape))
        bias = spec.bias
        bias = None if bias is None else jnp.reshape(bias, (1,) * (4 - bias.ndim) + tuple(bias.shape))
        return Call(q, k, v, {
            "mask": mask, "bias": bias, "init_bias": None, "causal": spec.causal,
            "sliding_window": spec.sliding_window, "q_segment_ids": spec.q_segment_ids,
            "kv_segment_ids": spec.kv_segment_ids, "softmax_scale": spec.softmax_scale,
            "logits_soft_cap": spec.logits_soft_cap, "softmax_aux": softmax_aux,
            "dropout_prob": spec.dropout_prob, "dropout_rng": dropout_rng,
        })

    def route(self) -> Forward:
        """The ``forward_*`` method for the effective platform."""
        if self.platform == "cpu":
            return self.forward_cpu
        if self.platform == "tpu":
            return self.forward_tpu
        if self.platform == "gpu":
            return self.forward_rocm if self.vendor == "rocm" else self.forward_cuda
        return self.forward_native

    def run_kernel(self, problem: AttentionProblem, call: Call,
                   wrap: Callable[[AttentionImpl, Forward], Forward] | None = None) -> AttentionOutput:
        """Run this impl's own forward for the platform on an accepted call.

        ``wrap`` (from the runner) wraps the forward, e.g. in ``shard_map``. Differentiating a
        call whose backward this impl cannot run raises its ``grad_reasons``.
        """
        forward = self.route()
        if wrap is not None:
            forward = wrap(self, forward)
        grad_reasons = self.grad_reasons(problem)
        if grad_reasons:  # after the wrap, so that a sharded call refuses too
            forward = _refuse_gradients(forward, self.name(), grad_reasons)
        out = forward(call.q, call.k, call.v, **call.kwargs)
        b, t, hq, _ = call.q.shape
        want = (b, t, hq, call.v.shape[-1])
        got = tuple(out.attention_outputs.shape)
        if got != want:
            raise PluginError(f"impl {self.name()!r} returned attention_outputs of shape {got}, expected {want}")
        return out

    # -- per-platform forwards (override the ones you have) ---------------------------------
    def forward_native(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                       init_bias: Callable[[], Any] | None = None, causal: bool = False,
                       **features: Any) -> AttentionOutput:
        """Portable path; the default target of every other forward."""
        raise NotImplementedError(
            f"impl {self.name()!r} has no forward for platform {self.platform!r} and no forward_native"
        )

    def forward_cpu(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                    init_bias: Callable[[], Any] | None = None, causal: bool = False,
                    **features: Any) -> AttentionOutput:
        return self.forward_native(q, k, v, mask, bias, init_bias, causal, **features)

    def forward_tpu(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                    init_bias: Callable[[], Any] | None = None, causal: bool = False,
                    **features: Any) -> AttentionOutput:
        return self.forward_native(q, k, v, mask, bias, init_bias, causal, **features)

    def forward_gpu(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                    init_bias: Callable[[], Any] | None = None, causal: bool = False,
                    **features: Any) -> AttentionOutput:
        return self.forward_native(q, k, v, mask, bias, init_bias, causal, **features)

    def forward_cuda(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                     init_bias: Callable[[], Any] | None = None, causal: bool = False,
                     **features: Any) -> AttentionOutput:
        return self.forward_gpu(q, k, v, mask, bias, init_bias, causal, **features)

    def forward_rocm(self, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
                     init_bias: Callable[[], Any] | None = None, causal: bool = False,
                     **features: Any) -> AttentionOutput:
        return self.forward_gpu(q, k, v, mask, bias, init_bias, causal, **features)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name()!r} on {self.platform}>"
