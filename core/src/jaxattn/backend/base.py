"""``Backend``: what every attention backend shares, whatever its op kind.

A backend declares what it can do as class attributes (platforms, dtypes, head dims,
features, priority), which a plugin's class takes from its one declaration, the ``ImplRef``
it binds to (``jaxattn.backend.declaration``); it answers *every* reason it cannot run a call, and
routes an accepted call to its ``forward_<platform>`` method for the device, vLLM style. Two kinds build on it:
``AttentionImpl`` (dense attention, ``jaxattn.backend.impl``) and ``PagedAttentionImpl`` (attention
over a paged KV cache, ``jaxattn.backend.paged_impl``); their calls and forwards differ, the rest
is here.

A call runs on a straight path: ``run(call)`` looks up the call's ``Plan``, decided once per
problem (``plan``: decline with every reason, fallback, sharding, the gradient guard, the routed
forward), and calls the forward on the call object (``jaxattn.backend.call``). Hand-off to
``fallback_impl`` and ``shard_map`` over a mesh are the ``composition`` that ``jaxattn.get_impl``
gives the instances it builds (``jaxattn.api.compose``); a backend constructed directly has none and
declines the calls that would need them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from ..errors import PluginError, UnsupportedError
from .capabilities import Feature, describe_features, head_dim_reason, platform_matches
from .declaration import DeclarationError, ImplRef
from .device import DeviceInfo, detect_device
from .forms import form_of, seed_forward
from .metadata import DEFAULT_METADATA, AttentionMetadata
from .names import normalize_name
from .problem import Problem

if TYPE_CHECKING:
    from .output import AttentionOutput

__all__ = ["Backend", "Composition", "Forward", "Plan", "refuse_gradients", "resolve_platform"]

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
    Feature.KV_LENGTHS: "per-sequence key lengths (kv_lengths)",
    Feature.LSE: "returning the log-sum-exp (return_lse)",
    Feature.MULTI_TOKEN: "several queries per sequence",
    Feature.RAGGED: "ragged batches (per-sequence query counts, cu_q_lens)",
    Feature.MASK_MOD: "a mask_mod (a mask as a function of b, h, q_idx, kv_idx)",
    Feature.SCORE_MOD: "a score_mod (a function rewriting the logits)",
    Feature.QUANTIZED_KV: "quantized KV caches (int8/float8 values with k_scale and v_scale; it reads float caches "
                          "only)",
}

#: Features whose description is plural (for the grammar of decline reasons).
_PLURAL = frozenset({Feature.GQA, Feature.CROSS, Feature.DECODE, Feature.SEGMENT_IDS, Feature.SINKS, Feature.GRAD,
                     Feature.KV_LENGTHS, Feature.MULTI_TOKEN, Feature.RAGGED, Feature.QUANTIZED_KV})

Forward = Callable[..., "AttentionOutput"]

#: The problem type of an op kind (``AttentionProblem`` or ``PagedProblem``).
P = TypeVar("P", bound=Problem)


def resolve_platform(metadata: AttentionMetadata, device: DeviceInfo) -> tuple[str, str | None]:
    """The effective ``(platform, GPU vendor)``: the metadata's override, else the device's."""
    override = metadata.platform
    if override is None:
        return device.platform, device.vendor
    if override in ("cuda", "rocm"):
        return "gpu", override
    if override == "gpu":
        return "gpu", device.vendor or "cuda"
    return override, None


def refuse_gradients(forward: Forward, name: str, reasons: list[str]) -> Forward:
    """Wrap a forward so that differentiating it raises ``UnsupportedError`` with ``reasons``
    instead of failing deep inside a kernel (or, worse, differentiating something that is not
    the kernel's math).

    The error comes from the custom VJP's forward rule, which JAX traces only when the call is
    differentiated: an undifferentiated call runs the plain forward (the wrapper is transparent
    in the compiled program). The call's arrays travel as primal inputs.
    """
    import jax

    def run(call: Any) -> AttentionOutput:
        @jax.custom_vjp
        def guarded(arrays: dict[str, Any]) -> AttentionOutput:
            return forward(call.replace(**arrays))

        def fwd(arrays: dict[str, Any]) -> tuple[AttentionOutput, None]:
            raise UnsupportedError(name, reasons, gradient=True)

        def bwd(_: None, __: Any) -> Any:  # never reached: fwd raises
            raise UnsupportedError(name, reasons, gradient=True)

        guarded.defvjp(fwd, bwd)
        return guarded(call.arrays())

    run.__name__ = getattr(forward, "__name__", "forward")
    return run


@dataclasses.dataclass(frozen=True)
class Plan:
    """How calls of one problem run, decided once (``Backend.plan``) and memoised per problem."""

    #: The forward to call on the call object: routed for the platform, maybe under
    #: ``shard_map``, maybe guarding against gradients, maybe another backend's (a fallback).
    forward: Forward
    #: The backend whose kernel runs (errors name it).
    name: str
    #: The shape ``attention_outputs`` must have (checked after every kernel).
    out_shape: tuple[int, ...]
    #: Its dtype: the call's compute dtype (``metadata.runtime_dtype``, else the inputs').
    out_dtype: str | None = None

    def checked(self, out: Any) -> AttentionOutput:
        """``out``, the forward's result, if it is an ``AttentionOutput`` of the right shape and
        dtype: else the backend broke its contract (``PluginError``, which auto answers by
        declining the backend for such calls and running the next one)."""
        values = getattr(out, "attention_outputs", None)
        if values is None or not hasattr(values, "shape"):
            raise PluginError(f"impl {self.name!r} returned {type(out).__name__}, not an AttentionOutput: a forward "
                              "returns jaxattn.backend.AttentionOutput(attention_outputs=...)")
        got = tuple(values.shape)
        if got != self.out_shape:
            raise PluginError(f"impl {self.name!r} returned attention_outputs of shape {got}, "
                              f"expected {self.out_shape}")
        if self.out_dtype is not None and str(values.dtype) != self.out_dtype:
            raise PluginError(f"impl {self.name!r} returned attention_outputs of dtype {values.dtype} for a "
                              f"{self.out_dtype} call: the output is in the call's compute dtype")
        return out  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class Composition:
    """What surrounds a kernel for the backends ``jaxattn.get_impl`` builds (``jaxattn.api.compose``).

    ``fallback(impl, problem, reasons)`` is the backend that runs a call ``impl`` falls back on its
    ``fallback_impl`` for (``reasons``: its ``fallback_reasons``); ``shard(impl)`` is ``impl``'s routed
    forward under ``shard_map`` over the batch and head axes of its metadata's mesh.
    """

    fallback: Callable[[Backend[Any], Any, list[str]], Backend[Any]]
    shard: Callable[[Backend[Any]], Forward]


class Backend(Generic[P]):
    """Declarations, reasons and routing, shared by every op kind (``P``: its problem type)."""

    #: The op kind ("dense" or "paged"): which calls it serves, which problems it is asked about.
    kind: ClassVar[str] = "dense"
    #: Platform tokens this backend runs on: "cpu", "gpu", "tpu", or a GPU vendor "cuda" / "rocm".
    platforms: ClassVar[frozenset[str]] = frozenset({"cpu", "gpu", "tpu"})
    #: Compute dtypes accepted (after ``metadata.runtime_dtype`` is applied).
    dtypes: ClassVar[frozenset[str]] = frozenset({"float32", "bfloat16", "float16"})
    #: Head dims accepted: an inclusive ``(lo, hi)`` range or a set of sizes.
    head_dims: ClassVar[tuple[int, int] | frozenset[int]] = (1, 1 << 16)
    #: Features beyond plain attention this backend runs exactly (see ``Feature``).
    features: ClassVar[AbstractSet[Feature]] = frozenset()
    #: Why a feature outside ``features`` is declined, and what runs it instead: added, after the
    #: generic reasons, for each missing feature it names (class-side text, not a declaration).
    why_not: ClassVar[Mapping[Feature, str]] = {}
    #: Higher wins, both for "auto" and among providers of one name on one platform.
    priority: ClassVar[int] = 0
    #: Name of the impl this one falls back on for calls when ``fallback_reasons`` is non-empty.
    fallback_impl: ClassVar[str | None] = None
    #: One line for listings.
    description: ClassVar[str] = ""
    #: True for impls that shard the sequence themselves (ring): nothing wraps their forward in
    #: ``shard_map``, and ``metadata.sequence_axis`` is theirs to honour.
    sequence_parallel: ClassVar[bool] = False
    #: The ``ImplRef`` this class binds to (``class X(AttentionImpl, declaration=REF)``), which
    #: states its names and the class attributes above; None for a class that declares them itself.
    declaration: ClassVar[ImplRef | None] = None
    #: Hand-off and sharding: set by ``jaxattn.get_impl`` on the instances it builds; None for a
    #: backend constructed directly, which declines the calls that would need them.
    composition: Composition | None = None

    def __init__(self, metadata: AttentionMetadata | None = None, device: DeviceInfo | None = None) -> None:
        self.metadata = metadata if metadata is not None else DEFAULT_METADATA
        self.device = device if device is not None else detect_device()
        self.platform, self.vendor = resolve_platform(self.metadata, self.device)
        self._grad_reasons: dict[P, tuple[str, ...]] = {}
        self._plans: dict[P, Plan] = {}

    def __init_subclass__(cls, declaration: ImplRef | None = None, **kwargs: Any) -> None:
        """Bind the class to its ``declaration``: every class attribute it states is set from it.

        A value the class body sets itself is kept, and reported as a disagreement by
        ``jaxattn.discovery.plugins.problems()`` (``jaxattn list``, ``jaxattn info --strict``).
        """
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("features")
        if own is not None and not isinstance(own, frozenset):  # the seed's style: a set, of names too
            try:
                cls.features = frozenset(Feature(f) for f in own)
            except ValueError as err:
                raise DeclarationError(f"{cls.__qualname__}.features: {err}; features are Feature members") from None
        if declaration is None:
            return
        if declaration.kind != cls.kind:
            raise DeclarationError(f"{cls.__qualname__} is a {cls.kind} backend, but its declaration "
                                   f"{declaration.target!r} says kind {declaration.kind!r}")
        cls.declaration = declaration
        for field, value in declaration.class_values().items():
            if field not in cls.__dict__:
                setattr(cls, field, value)

    # -- identity ---------------------------------------------------------------------------
    @classmethod
    def get_impl_name(cls) -> str | tuple[str, ...]:
        """The name, or a tuple whose first item is the name and the rest aliases: the
        declaration's names; a class without one defines this method."""
        if cls.declaration is not None:
            return cls.declaration.names
        raise NotImplementedError(f"{cls.__qualname__} must bind to an ImplRef (declaration=) or define "
                                  "get_impl_name()")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        raw = cls.get_impl_name()
        names = (raw,) if isinstance(raw, str) else tuple(raw)
        return tuple(normalize_name(n, "get_impl_name()") for n in names)

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
            "kind": cls.kind,
            "platforms": sorted(cls.platforms),
            "dtypes": sorted(cls.dtypes),
            "head_dims": list(dims) if isinstance(dims, tuple) else sorted(dims),
            "features": sorted(str(f) for f in cls.features),
            "priority": cls.priority,
            "fallback_impl": cls.fallback_impl,
        }

    # -- what can run -----------------------------------------------------------------------
    def compute_dtype(self, problem: P) -> str:
        return self.metadata.runtime_dtype or problem.dtype

    def declared_reasons(self, problem: P) -> list[str]:
        """Every reason the declarations rule ``problem`` out here: platform, dtype, head dims,
        features. ``not_supported_reasons`` starts from these."""
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
        return reasons + [self.why_not[f] for f in missing if f in self.why_not]

    def not_supported_reasons(self, problem: P) -> list[str]:
        """Every reason this backend cannot run ``problem`` here; empty when it can.

        Subclasses extend it: ``reasons = super().not_supported_reasons(problem)``.
        """
        return self.declared_reasons(problem)

    def notes(self, problem: P) -> list[str]:
        """How this backend would run an accepted ``problem`` here (shown by ``explain``)."""
        return []

    def fallback_reasons(self, problem: P) -> list[str]:
        """Why this backend would hand ``problem`` to ``fallback_impl`` instead of its own kernel."""
        return []

    def reasons_to_decline(self, problem: P) -> list[str]:
        """``not_supported_reasons``, plus the fallback conditions when fallback is not allowed."""
        reasons = self.not_supported_reasons(problem)
        if not self.metadata.allow_fallback:
            reasons += [f"{r} (would fall back to {self.fallback_impl}, but allow_fallback=False)"
                        for r in self.fallback_reasons(problem)]
        return reasons

    def grad_reasons(self, problem: P) -> list[str]:
        """Every reason this backend cannot differentiate ``problem`` (empty when its backward runs it).

        A forward cannot know whether a gradient will follow; the call checks this once and
        arms a guard that raises these reasons if the call is differentiated.
        """
        key = dataclasses.replace(problem, needs_grad=True)
        cached = self._grad_reasons.get(key)
        if cached is None:
            cached = self._grad_reasons[key] = tuple(self.reasons_to_decline(key))
        return list(cached)

    def direct_reasons(self, problem: P) -> list[str]:
        """Why a backend constructed directly (no ``composition``) cannot run ``problem``: a mesh
        to shard over, or a fallback to ``fallback_impl``; empty for one ``jaxattn.get_impl`` built."""
        if self.composition is not None:
            return []
        reasons = []
        md = self.metadata
        if md.mesh is not None and (md.batch_axis or md.head_axis) and not self.sequence_parallel:
            reasons.append(
                f"metadata.mesh shards the batch or heads, but this {type(self).__name__} was constructed "
                "directly, so nothing wraps its kernel in shard_map; build it with jaxattn.get_impl(name, metadata)"
            )
        if md.allow_fallback:
            reasons += [f"{r} (would fall back on {self.fallback_impl}, which only an impl built by "
                        "jaxattn.get_impl can do)" for r in self.fallback_reasons(problem)]
        return reasons

    def check_call(self, problem: P) -> None:
        """Raise the ``InvalidInputError`` a call of ``problem`` would raise before this backend's
        kernel runs, though the backend accepts it (a length that does not split over the mesh
        the metadata names): ``plan`` runs it, and ``explain`` before it names this backend, so
        that it never names one whose call raises. The base class checks nothing."""

    def decline(self, problem: P) -> None:
        """Raise one ``UnsupportedError`` with every reason this call cannot run (fallback and mesh too)."""
        reasons = self.reasons_to_decline(problem) + self.direct_reasons(problem)
        if reasons:
            raise UnsupportedError(self.name(), reasons)

    # -- running ----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        """Validate, check support, run: each op kind defines its call (``AttentionImpl``,
        ``PagedAttentionImpl``)."""
        raise NotImplementedError(f"{type(self).__name__} is not an op kind's backend")

    def output_shape(self, problem: P) -> tuple[int, ...]:
        """The shape ``attention_outputs`` must have for ``problem`` (checked after every kernel)."""
        raise NotImplementedError

    def plan(self, problem: P) -> Plan:
        """Decide how calls of ``problem`` run here, once (``run`` memoises it per problem).

        Declines the call (one ``UnsupportedError`` with every reason), else: the forward of
        this backend, or of its ``fallback_impl`` for a call it falls back on (logged once); under
        ``shard_map`` when the metadata carries a mesh; guarded so that differentiating a call
        whose backward the backend cannot run raises its ``grad_reasons``.
        """
        self.decline(problem)
        self.check_call(problem)
        impl: Backend[Any] = self
        why = self.fallback_reasons(problem)
        if why and self.composition is not None:  # without one, decline() refused the call
            impl = self.composition.fallback(self, problem, why)
        forward = impl.route()
        if self.composition is not None and impl.metadata.mesh is not None and not impl.sequence_parallel:
            forward = self.composition.shard(impl)
        grad_reasons = impl.grad_reasons(problem)
        if grad_reasons:  # after the shard_map, so that a sharded call refuses too
            forward = refuse_gradients(forward, impl.name(), grad_reasons)
        return Plan(forward, impl.name(), self.output_shape(problem), impl.compute_dtype(problem))

    def run(self, call: Any) -> AttentionOutput:
        """Run a validated call (an ``AttentionCall`` or ``PagedCall``): its plan, then its forward.

        An output of the wrong shape is the backend's fault: ``PluginError``.
        """
        plan = self._plans.get(call.problem)
        if plan is None:
            plan = self._plans[call.problem] = self.plan(call.problem)
        return plan.checked(plan.forward(call))

    def route(self) -> Forward:
        """What runs a call here: ``forward`` when the class overrides it; else the ``forward_*``
        method for the effective platform, the most specific one the class overrides (cpu:
        ``forward_cpu``; tpu: ``forward_tpu``; an NVIDIA or AMD GPU: ``forward_cuda`` or
        ``forward_rocm``, then ``forward_gpu``), else ``forward_native``; a method of the seed's
        form adapted to take the call (``jaxattn.backend.forms``)."""
        cls = type(self)
        if cls.forward is not Backend.forward:
            return self.forward
        name = self.platform_forward()
        return seed_forward(self, name) if form_of(cls, name) == "seed" else getattr(self, name)

    def platform_forward(self) -> str:
        """The name of the ``forward_<platform>`` method that runs calls here (see ``route``)."""
        names: tuple[str, ...] = ()
        if self.platform == "cpu":
            names = ("forward_cpu",)
        elif self.platform == "tpu":
            names = ("forward_tpu",)
        elif self.platform == "gpu":
            names = ("forward_rocm" if self.vendor == "rocm" else "forward_cuda", "forward_gpu")
        cls = type(self)
        return next((name for name in names if getattr(cls, name) is not getattr(Backend, name)), "forward_native")

    # -- the forward: override ``forward``, or the per-platform ones you have -----------------
    # Each takes the call object of the backend's kind (``AttentionCall``, ``PagedCall``:
    # ``jaxattn.backend.call``) and returns an ``AttentionOutput``.
    def forward(self, call: Any) -> AttentionOutput:
        """Run a validated, accepted call: the one method a backend overrides (what varies by
        platform is its own business, or the ``forward_<platform>`` methods' below)."""
        return self.route()(call)

    # Typed ``(*args, **kwargs)`` so that both forms override them (``jaxattn.backend.forms``):
    # one call argument, or the seed's ``(q, k, v, mask=None, ...)``; each passes on what it got.
    def forward_native(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        """Portable path; the default target of every other forward."""
        raise NotImplementedError(
            f"impl {self.name()!r} has no forward for platform {self.platform!r} and no forward_native"
        )

    def forward_cpu(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        return self.forward_native(*args, **kwargs)

    def forward_tpu(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        return self.forward_native(*args, **kwargs)

    def forward_gpu(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        return self.forward_gpu(*args, **kwargs)

    def forward_rocm(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        return self.forward_gpu(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name()!r} on {self.platform}>"
