"""``Backend``: what every attention backend shares, whatever its op kind.

A backend declares what it can do as class attributes (platforms, dtypes, head dims,
features, priority), which a plugin's class takes from its one declaration, the ``ImplRef``
it binds to (``jaxattn.declaration``); it answers *every* reason it cannot run a call, and
routes an accepted call to its ``forward_<platform>`` method for the device, vLLM style. Two kinds build on it:
``AttentionImpl`` (dense attention, ``jaxattn.impl``) and ``PagedAttentionImpl`` (attention
over a paged KV cache, ``jaxattn.paged_impl``); their calls and forwards differ, the rest
is here.

What runs around the kernel is the backend's ``runner``, passed down by whoever built it:
``jaxattn.get_impl`` hands calls to ``fallback_impl`` and wraps kernels in ``shard_map`` over a
mesh (``jaxattn.compose``); a backend constructed directly runs its own kernel (``DIRECT``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from .capabilities import Feature, describe_features, head_dim_reason, platform_matches
from .declaration import DeclarationError, ImplRef
from .device import DeviceInfo, detect_device
from .errors import PluginError, UnsupportedError
from .metadata import DEFAULT_METADATA, AttentionMetadata
from .problem import Problem

if TYPE_CHECKING:
    from .output import AttentionOutput

__all__ = ["DIRECT", "Backend", "Call", "DirectRunner", "Forward", "Runner", "resolve_platform"]

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
    Feature.MULTI_TOKEN: "several queries per sequence",
    Feature.RAGGED: "ragged batches (per-sequence query counts, cu_q_lens)",
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


def _refuse_gradients(forward: Forward, name: str, reasons: list[str]) -> Forward:
    """Wrap a forward so that differentiating it raises ``UnsupportedError`` with ``reasons``
    instead of failing deep inside a kernel (or, worse, differentiating something that is not
    the kernel's math).

    The error comes from the custom VJP's forward rule, which JAX traces only when the call is
    differentiated: an undifferentiated call runs the plain forward (the wrapper is transparent
    in the compiled program). Keyword arguments that are arrays travel as primal inputs.
    """
    import jax

    def run(*args: Any, **kwargs: Any) -> AttentionOutput:
        arrays = {n: kwargs.pop(n) for n in list(kwargs) if hasattr(kwargs[n], "shape")}

        @jax.custom_vjp
        def call(args: tuple[Any, ...], arrays: dict[str, Any]) -> AttentionOutput:
            return forward(*args, **arrays, **kwargs)

        def fwd(args: tuple[Any, ...], arrays: dict[str, Any]) -> tuple[AttentionOutput, None]:
            raise UnsupportedError(name, reasons, gradient=True)

        def bwd(_: None, __: Any) -> Any:  # never reached: fwd raises
            raise UnsupportedError(name, reasons, gradient=True)

        call.defvjp(fwd, bwd)
        return call(args, arrays)

    run.__name__ = getattr(forward, "__name__", "forward")
    return run


def _jax_arrays(call: Call) -> Call:
    """``call`` with its NumPy arrays as JAX arrays: every argument that takes an array takes a
    NumPy one, but kernels index with traced values (``lax.map``, ``vmap``), which a NumPy array
    cannot take."""
    import jax.numpy as jnp
    import numpy as np

    def convert(x: Any) -> Any:
        return jnp.asarray(x) if isinstance(x, np.ndarray) else x

    return Call(tuple(convert(a) for a in call.args), {n: convert(x) for n, x in call.kwargs.items()})


@dataclasses.dataclass(frozen=True)
class Call:
    """One accepted call, validated and normalised: what a ``forward_*`` method receives.

    ``args`` are the positional arrays (q, k, v for dense attention); ``kwargs`` every other
    argument in its normalised form (see the kind's ``prepare``).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class Runner(Protocol):
    """How a call that a backend accepted runs: passed down by whoever built the backend."""

    def reasons(self, impl: Backend[Any], problem: Any) -> list[str]:
        """Why this runner cannot run ``problem`` with ``impl`` (beyond the impl's own reasons)."""
        ...

    def run(self, impl: Backend[Any], problem: Any, call: Call) -> AttentionOutput:
        """Run an accepted call."""
        ...


class DirectRunner:
    """The runner of a backend built directly: its own kernel, on the arrays given, nothing around it."""

    def reasons(self, impl: Backend[Any], problem: Any) -> list[str]:
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

    def run(self, impl: Backend[Any], problem: Any, call: Call) -> AttentionOutput:
        return impl.run_kernel(problem, call)


#: The runner of backends that were constructed directly.
DIRECT = DirectRunner()


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
    features: ClassVar[frozenset[Feature]] = frozenset()
    #: Higher wins, both for "auto" and among providers of one name on one platform.
    priority: ClassVar[int] = 0
    #: Name of the impl this one hands calls to when ``fallback_reasons`` is non-empty.
    fallback_impl: ClassVar[str | None] = None
    #: One line for listings.
    description: ClassVar[str] = ""
    #: True for impls that shard the sequence themselves (ring): nothing wraps their forward in
    #: ``shard_map``, and ``metadata.sequence_axis`` is theirs to honour.
    sequence_parallel: ClassVar[bool] = False
    #: The ``ImplRef`` this class binds to (``class X(AttentionImpl, declaration=REF)``), which
    #: states its names and the class attributes above; None for a class that declares them itself.
    declaration: ClassVar[ImplRef | None] = None
    #: How an accepted call runs; ``jaxattn.get_impl`` sets its own on the instances it builds.
    runner: Runner = DIRECT

    def __init__(self, metadata: AttentionMetadata | None = None, device: DeviceInfo | None = None) -> None:
        self.metadata = metadata if metadata is not None else DEFAULT_METADATA
        self.device = device if device is not None else detect_device()
        self.platform, self.vendor = resolve_platform(self.metadata, self.device)
        self._grad_reasons: dict[P, tuple[str, ...]] = {}

    def __init_subclass__(cls, declaration: ImplRef | None = None, **kwargs: Any) -> None:
        """Bind the class to its ``declaration``: every class attribute it states is set from it.

        A value the class body sets itself is kept, and reported as a disagreement by
        ``jaxattn.plugins.problems()`` (``jaxattn list``, ``jaxattn info --strict``).
        """
        super().__init_subclass__(**kwargs)
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
        return reasons

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

    def decline(self, problem: P) -> None:
        """Raise one ``UnsupportedError`` with every reason this call cannot run (runner's too)."""
        reasons = self.reasons_to_decline(problem) + self.runner.reasons(self, problem)
        if reasons:
            raise UnsupportedError(self.name(), reasons)

    # -- running ----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        """Validate, check support, run: each op kind defines its call (``AttentionImpl``,
        ``PagedAttentionImpl``)."""
        raise NotImplementedError(f"{type(self).__name__} is not an op kind's backend")

    def route(self) -> Forward:
        """The ``forward_*`` method for the effective platform."""
        forward: Forward
        if self.platform == "cpu":
            forward = self.forward_cpu
        elif self.platform == "tpu":
            forward = self.forward_tpu
        elif self.platform == "gpu":
            forward = self.forward_rocm if self.vendor == "rocm" else self.forward_cuda
        else:
            forward = self.forward_native
        return forward

    def output_shape(self, call: Call) -> tuple[int, ...]:
        """The shape ``attention_outputs`` must have for ``call`` (checked after every kernel)."""
        raise NotImplementedError

    def run_kernel(self, problem: P, call: Call,
                   wrap: Callable[[Backend[Any], Forward], Forward] | None = None) -> AttentionOutput:
        """Run this backend's own forward for the platform on an accepted call.

        ``wrap`` (from the runner) wraps the forward, e.g. in ``shard_map``. Differentiating a
        call whose backward this backend cannot run raises its ``grad_reasons``.
        """
        forward = self.route()
        if wrap is not None:
            forward = wrap(self, forward)
        grad_reasons = self.grad_reasons(problem)
        if grad_reasons:  # after the wrap, so that a sharded call refuses too
            forward = _refuse_gradients(forward, self.name(), grad_reasons)
        call = _jax_arrays(call)
        out = forward(*call.args, **call.kwargs)
        want = self.output_shape(call)
        got = tuple(out.attention_outputs.shape)
        if got != want:
            raise PluginError(f"impl {self.name()!r} returned attention_outputs of shape {got}, expected {want}")
        return out

    # -- per-platform forwards (a kind fixes their signature; override the ones you have) ----
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
