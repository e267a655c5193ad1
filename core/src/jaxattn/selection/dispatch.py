"""Choosing an implementation: "auto", ``explain``, ``use_impl`` and the name a call resolves to.

Precedence: ``impl=`` argument > ``use_impl(...)`` > ``$JAXATTN_IMPL`` > "auto". Choice happens
at trace time, so under ``jax.jit`` the compiled program is the chosen kernel's own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import textwrap
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, cast

from ..backend.base import Backend, Plan
from ..backend.call import AttentionCall, PagedCall
from ..backend.capabilities import ALL_FEATURES
from ..backend.device import detect_device
from ..backend.impl import AttentionImpl, resolve_platform
from ..backend.metadata import DEFAULT_METADATA, AttentionMetadata, as_metadata
from ..backend.names import AttentionMechanisms, normalize_name
from ..backend.output import AttentionOutput
from ..backend.paged_impl import PagedAttentionImpl
from ..backend.problem import AttentionProblem, Problem
from ..backend.validation import resolve_call
from ..discovery.plugins import registry
from ..discovery.registry import reraise_interrupts
from ..errors import InvalidInputError, JaxattnError, PluginError, UnsupportedError
from .candidates import Candidate
from .lookup import available_here, impl_for, provider_here
from .tuning import on_reload, refine

__all__ = [
    "AutoAttention",
    "AutoPagedAttention",
    "Candidate",
    "Explanation",
    "accepting",
    "call_impl_name",
    "choose",
    "clear_choices",
    "current_impl_name",
    "evaluate",
    "explain",
    "explain_problem",
    "get_optimal_config",
    "use_impl",
]

logger = logging.getLogger("jaxattn")

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxattn_impl", default=None)
_logged: set[Any] = set()


@contextlib.contextmanager
def use_impl(name: str | AttentionMechanisms) -> Iterator[None]:
    """Within this scope, calls that pass no ``impl=`` use ``name``."""
    token = _override.set(normalize_name(name))
    try:
        yield
    finally:
        _override.reset(token)


def current_impl_name(impl: str | AttentionMechanisms | None = None, kind: str = "dense") -> str:
    """The name a call of ``kind`` resolves to: argument, then ``use_impl``, then ``$JAXATTN_IMPL``,
    then auto.

    A scoped or environment name that is registered for the other op kind only (a paged impl
    while a dense call runs, or the reverse) does not apply to this call: it resolves to auto.
    """
    if impl is not None:
        return normalize_name(impl)
    scoped = _override.get()
    if scoped is None:
        env = os.environ.get("JAXATTN_IMPL", "").strip()
        scoped = normalize_name(env) if env else None
    if scoped is None or scoped == AttentionMechanisms.AUTO.value:
        return AttentionMechanisms.AUTO.value
    kinds = {p.kind for p in registry().providers_of(scoped)}
    return AttentionMechanisms.AUTO.value if kinds and kind not in kinds else scoped


def call_impl_name(impl: str | AttentionMechanisms | None = None, kind: str = "dense") -> str:
    """``current_impl_name`` for a call about to run: a name from ``use_impl`` or ``$JAXATTN_IMPL``
    that no installed plugin provides raises ``ImplNotFoundError`` naming where it came from (the
    caller never named it, so "unknown impl" alone would not say what to fix)."""
    name = current_impl_name(impl, kind)
    if impl is not None or name == AttentionMechanisms.AUTO.value or registry().providers_of(name):
        return name
    scoped = _override.get()
    source = f"use_impl({scoped!r})" if scoped is not None else f"$JAXATTN_IMPL={os.environ['JAXATTN_IMPL'].strip()!r}"
    try:
        provider_here(name, DEFAULT_METADATA)
    except JaxattnError as err:
        raise type(err)(f"{source}: {err} (unset it, or set it to 'auto' or a name from `jaxattn list`)") from None
    return name


def _rank_key(candidate: Candidate) -> tuple[int, int, str]:
    # A candidate that would fall back on another impl ranks after those that run it themselves.
    return (-candidate.priority, len(candidate.fallback) > 0, candidate.name)


def _evaluate(problem: Problem, metadata: AttentionMetadata) -> list[Candidate]:
    """Every provider's answer for ``problem`` (those of its op kind): ones for this platform first,
    best first."""
    device = detect_device()
    platform, vendor = resolve_platform(metadata, device)
    best_here = {id(p) for p in available_here(metadata, device, problem.kind)}
    faults = _faults.get(_fault_key(problem, metadata), {})
    rows: list[Candidate] = []
    for provider in registry().providers:
        if provider.kind != problem.kind:
            continue
        here = id(provider) in best_here
        broken = provider.error is not None and provider.runs_on(platform, vendor)
        if not here and provider.runs_on(platform, vendor) and not broken:
            continue  # a lower-priority provider of a name served here by another
        reasons: list[str] = []
        fallback: list[str] = []
        fallback_impl = None
        notes: list[str] = []
        priority = provider.priority
        if broken:  # refused when its class was loaded: listed, with why, never left out silently
            reasons.append(f"failed to load: {type(provider.error).__name__}: {provider.error}")
        elif not here:
            reasons.append(f"runs on {'/'.join(provider.platforms)}, not {platform}")
        else:
            try:
                impl = impl_for(provider.name, metadata)
                priority = impl.priority_for(device)
                reasons = impl.not_supported_reasons(problem)
                fallback = impl.fallback_reasons(problem)
                fallback_impl = impl.fallback_impl
                notes = impl.notes(problem) if not reasons else []
                if fallback and not metadata.allow_fallback:
                    reasons += [f"{r} (allow_fallback=False)" for r in fallback]
            except InvalidInputError as err:
                if err.argument.startswith("metadata"):
                    raise  # an option the backend reads is nonsense: the caller's error, whoever runs the call
                reasons.append(str(err))
            except JaxattnError as err:
                reasons.append(str(err))
            except ImportError as err:
                reasons.append(f"failed to import: {err}")
            except BaseException as err:  # a backend's own checks failed: it cannot take the call
                reraise_interrupts(err)
                reasons.append(f"raised {type(err).__name__} while checking the call: {err}")
            if provider.name in faults:
                reasons.append(faults[provider.name])
        rows.append(Candidate(
            name=provider.name, origin=provider.origin, priority=priority, platforms=provider.platforms,
            reasons=tuple(reasons), fallback=tuple(fallback), fallback_impl=fallback_impl, notes=tuple(notes),
            here=here or broken,
        ))
    return sorted(rows, key=lambda c: (not c.here, *_rank_key(c)))


def evaluate(problem: Problem, metadata: AttentionMetadata) -> list[Candidate]:
    """Every installed impl's answer for ``problem``, unmemoised: what ``choose`` asks once per
    call signature (tools that measure auto's cost call it)."""
    return _evaluate(problem, metadata)


# choose()'s results per (problem, metadata, device, registry state), and auto's plans per
# (auto instance, problem): a repeated call signature costs one dict lookup. Cleared when
# tuning records change (clear_choices).
_choices: dict[tuple[Any, ...], Any] = {}

# Backends that auto ran and that broke the contract on a call (a PluginError, e.g. an output
# of the wrong shape), per call signature: name -> reason. They are declined for that
# signature from then on (explain shows why), and the call runs the next candidate.
_faults: dict[tuple[Any, ...], dict[str, str]] = {}


def _fault_key(problem: Problem, metadata: AttentionMetadata) -> tuple[Any, ...]:
    # The forward broke: whether a gradient follows does not matter.
    return (dataclasses.replace(problem, needs_grad=False), metadata, detect_device(), registry().generation)


def _skip_fault(problem: Problem, metadata: AttentionMetadata, name: str, err: PluginError) -> None:
    """Decline ``name`` for calls like ``problem`` from now on, because running it raised ``err``."""
    reason = f"auto ran it on a call of this signature and it failed: {err}"
    _faults.setdefault(_fault_key(problem, metadata), {})[name] = reason
    logger.warning("jaxattn auto: %s failed on %s and is skipped for such calls: %s", name, problem.describe(), err)
    _choices.clear()  # memoised choices may name it


def clear_choices() -> None:
    """Forget memoised choices (after new tuning records, say)."""
    _choices.clear()


# New tuning records may change every choice.
on_reload(clear_choices)


def choose(problem: Problem, metadata: AttentionMetadata) -> tuple[str | None, list[Candidate]]:
    """Auto's pick for ``problem``: the best accepted candidate that runs the call itself.

    Rows come back in ranking order: auto's pool (refined by measurements) first, each with
    the reason for its place, then every other candidate.
    """
    reg = registry()
    key = (problem, metadata, detect_device(), reg.generation)
    memo = _choices.get(key)
    if memo is not None:
        return memo[0], list(memo[1])
    rows = _evaluate(problem, metadata)
    accepted = [c for c in rows if c.accepted]
    direct = [c for c in accepted if not c.fallback]
    pool = [dataclasses.replace(c, rank_reason=f"declared priority {c.priority}") for c in direct or accepted]
    pool = refine(pool, problem, metadata)  # measured ranking (jaxattn.selection.tuning)
    if pool and not problem.needs_grad and isinstance(problem, AttentionProblem):
        pool[0] = _with_backward(pool[0], problem, metadata)
    chosen = pool[0].name if pool else None
    ranked = {c.name for c in pool}
    rows = pool + [c for c in rows if not (c.here and c.name in ranked)]
    rows = [dataclasses.replace(c, chosen=c.name == chosen and c.here) for c in rows]
    _choices[key] = (chosen, rows)
    return chosen, list(rows)


def _with_backward(first: Candidate, problem: AttentionProblem, metadata: AttentionMetadata) -> Candidate:
    """``first`` with the impl that runs differentiated calls when its own backward cannot.

    A forward cannot know whether a gradient follows, so the backward is chosen on its own:
    the best impl that accepts the call with ``needs_grad``. Without one, ``grad_impl`` stays
    None and ``grad_reasons`` says why; differentiating the call then raises them.
    """
    reasons = tuple(impl_for(first.name, metadata).grad_reasons(problem))
    if not reasons:
        return first
    if first.grad_impl:  # measurements already picked a backward that accepts the call
        return dataclasses.replace(first, grad_reasons=reasons)
    grad_choice, grad_rows = choose(dataclasses.replace(problem, needs_grad=True), metadata)
    if grad_choice is None:
        refusal = tuple(f"{c.name}: {'; '.join(c.reasons)}" for c in grad_rows if c.here)
        return dataclasses.replace(first, grad_impl=None, grad_reasons=refusal or reasons)
    why = f"differentiated calls run {grad_choice}: {first.name}'s backward cannot ({'; '.join(reasons)})"
    return dataclasses.replace(first, grad_impl=grad_choice, grad_reasons=reasons,
                               rank_reason=f"{first.rank_reason}; {why}" if first.rank_reason else why)


def _log_choice(problem: Problem, metadata: AttentionMetadata, chosen: str, rows: list[Candidate]) -> None:
    # The registry generation is part of the key: new providers may change the choice.
    key = (problem.signature(), hash(metadata), registry().generation)
    if key in _logged:
        return
    _logged.add(key)
    rejected = "; ".join(f"{c.name}: {' / '.join(c.reasons)}" for c in rows if c.here and c.reasons)
    logger.info("jaxattn auto chose %s for %s%s", chosen, problem.describe(),
                f" (declined: {rejected})" if rejected else "")


#: Builds the impl that runs a chosen name (``jaxattn.get_impl``, passed down by ``jaxattn.api.calls``).
Resolve = Callable[[str, AttentionMetadata], AttentionImpl]
#: Builds "forward by one impl, differentiated by another (or refused with reasons)" (``SplitGradImpl``).
Combine = Callable[[AttentionImpl, AttentionImpl | None, Sequence[str]], AttentionImpl]


def _auto_run(auto: Backend[Any], call: AttentionCall | PagedCall) -> AttentionOutput:
    """Run ``call`` on auto's plan for its problem (memoised in ``_choices``); a chosen backend
    that breaks its contract (``PluginError``) is declined for such calls and the next one runs."""
    while True:  # each pass declines one more faulty backend: it ends
        key = (auto, call.problem)
        try:
            plan = _choices.get(key)
            if plan is None:
                plan = _choices[key] = auto.plan(call.problem)
            try:
                out = plan.forward(call)
            except JaxattnError:  # the call's own fault (bad values, a refused gradient): the caller's to see
                raise
            except Exception as err:  # a backend's kernel that raises on a call it accepted broke its contract
                raise PluginError(f"impl {plan.name!r} raised {type(err).__name__}: {err}") from err
            out = plan.checked(out)
        except PluginError as err:  # the chosen backend broke its contract: the next one runs
            _skip_fault(call.problem, auto.metadata, _chosen_name(call.problem, auto.metadata), err)
            continue
        return out


class _Auto(Backend[Any]):
    """Picks, per problem, the best implementation that supports the inputs on this device.

    Choosing is this module's job; building what runs the choice is the caller's: ``resolve``
    turns a name into a runnable impl and, for dense calls, ``combine`` joins a forward impl
    with the impl that differentiates the call, when they differ (see ``jaxattn.api.calls.get_impl``).
    The choice, and the chosen impl's plan, are made once per problem.
    """

    features: ClassVar = ALL_FEATURES
    priority: ClassVar[int] = -1

    def __init__(self, metadata: AttentionMetadata | None = None, *, resolve: Resolve,
                 combine: Combine | None = None) -> None:
        super().__init__(metadata)
        self.resolve, self.combine = resolve, combine

    @classmethod
    def get_impl_name(cls) -> str:
        return AttentionMechanisms.AUTO.value

    def select(self, problem: Problem) -> Any:
        """The impl that runs ``problem``: the chosen one, or its join with the impl that
        differentiates the call."""
        chosen, rows = choose(problem, self.metadata)
        if chosen is None:
            raise _no_choice(rows)
        _log_choice(problem, self.metadata, chosen, rows)
        row = next(c for c in rows if c.chosen)
        forward = self.resolve(chosen, self.metadata)
        if self.combine is not None and ((row.grad_impl and row.grad_impl != chosen) or row.grad_reasons):
            backward = self.resolve(row.grad_impl, self.metadata) if row.grad_impl else None
            return self.combine(forward, backward, row.grad_reasons)
        return forward

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        chosen, rows = choose(problem, self.metadata)
        return [] if chosen is not None else _no_choice(rows).reasons

    def plan(self, problem: Problem) -> Plan:
        return cast("Plan", self.select(problem).plan(problem))

    def run(self, call: AttentionCall | PagedCall) -> AttentionOutput:
        return _auto_run(self, call)

    def memoised_plan(self, problem: Problem) -> Plan | None:
        """The plan a call of ``problem`` runs on, if one has run: the one lookup auto adds to a
        named impl's path once warm."""
        return cast("Plan | None", _choices.get((self, problem)))


class AutoAttention(_Auto, AttentionImpl):
    """"auto" for dense calls."""


class AutoPagedAttention(_Auto, PagedAttentionImpl):
    """"auto" for calls over a paged KV cache: per problem, the best paged backend that accepts it."""


def _no_choice(rows: list[Candidate]) -> UnsupportedError:
    reasons = [f"{c.name}: {'; '.join(c.reasons)}" for c in rows if c.here]
    return UnsupportedError("auto", reasons or ["no attention impl is installed for this platform"],
                            hint="install a backend (pip install 'jaxattn[cpu]') or change the inputs")


def _chosen_name(problem: Problem, metadata: AttentionMetadata) -> str:
    chosen, _ = choose(problem, metadata)  # memoised: what select() just ran
    assert chosen is not None
    return chosen


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What each implementation says about one call, and which one runs it."""

    problem: Problem
    requested: str
    chosen: str | None
    candidates: tuple[Candidate, ...]
    device: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "problem": dataclasses.asdict(self.problem), "requested": self.requested,
            "chosen": self.chosen, "candidates": [c.to_dict() for c in self.candidates],
        }

    def __str__(self) -> str:
        chosen = next((c for c in self.candidates if c.chosen), None)
        grad = ""
        if chosen is not None and chosen.grad_impl:
            grad = f" (differentiated: {chosen.grad_impl})"
        elif chosen is not None and chosen.grad_reasons:
            grad = " (differentiated: no impl here can)"
        lines = [f"device: {self.device}", f"call:   {self.problem.describe()}",
                 f"impl:   {self.requested} -> {self.chosen or 'nothing can run this call'}" + grad]
        # Columns as wide as the longest name; reasons wrapped at spaces to 80 columns.
        width = max((len(c.name) for c in self.candidates), default=0)

        def wrapped(prefix: str, text: str) -> list[str]:
            return textwrap.wrap(text, 80, initial_indent=prefix, subsequent_indent=" " * len(prefix),
                                 break_long_words=False, break_on_hyphens=False) or [prefix]

        for c in self.candidates:
            mark = "*" if c.chosen else " "
            lines.append(f" {mark} {c.name:<{width}}  {c.status:<15} prio {c.priority:<4} {c.origin}")
            if c.rank_reason:
                lines += wrapped("       rank: ", c.rank_reason)
            lines += [line for r in c.reasons for line in wrapped("       - ", r)]
            lines += [line for n in c.notes for line in wrapped("       . ", n)]
            if c.fallback and not c.reasons:
                lines += [line for r in c.fallback
                          for line in wrapped("       ~ ", f"falls back on {c.fallback_impl}: {r}")]
        return "\n".join(lines)


def explain(
    q: Any, k: Any, v: Any, *, impl: str | AttentionMechanisms | None = None,
    metadata: AttentionMetadata | None = None, needs_grad: bool = False, **features: Any,
) -> Explanation:
    """Per implementation: accepted, or every reason it is not; and which one would run.

    ``q``, ``k``, ``v`` (and mask/bias/segment ids) may be ``jax.ShapeDtypeStruct``s.
    """
    md = as_metadata(metadata)
    problem = resolve_call(q, k, v, metadata=md, **features).problem
    if problem.mask_mod and problem.block_sparsity is None:  # show the tiles a mask_mod leaves
        from ..masks import with_sparsity

        problem = with_sparsity(problem, features["mask_mod"], md.block_q, md.block_k)
    if needs_grad:
        problem = dataclasses.replace(problem, needs_grad=True)
    return explain_problem(problem, impl=impl, metadata=md)


def explain_problem(problem: Problem, *, impl: str | AttentionMechanisms | None = None,
                    metadata: AttentionMetadata | None = None) -> Explanation:
    """``explain`` for a problem built by hand (``AttentionProblem`` or ``PagedProblem``)."""
    md = as_metadata(metadata)
    requested = call_impl_name(impl, problem.kind)
    auto_choice, rows = choose(problem, md)
    if requested == AttentionMechanisms.AUTO.value:
        chosen = auto_choice
    else:
        kinds = {p.kind for p in registry().providers_of(requested)}
        if kinds and problem.kind not in kinds:  # "nothing can run this call" would hide why
            raise InvalidInputError(
                "impl", f"{requested!r} is a {'/'.join(sorted(kinds))} impl; this is a {problem.kind} call",
                "explain_paged describes the calls of paged_attention and ragged_paged_attention"
                if problem.kind == "dense" else "explain describes the calls of attention")
        # The provider this name resolves to here, as get_impl builds it (an alias may name another
        # platform's kernel first: on a CPU page_attention is jaxattn-vanilla's vanilla_paged).
        try:
            name = provider_here(requested, md).name
        except JaxattnError:  # not served here, or two providers conflict: no row here matches
            name = requested
        match = [c for c in rows if c.here and c.name == name]
        chosen = name if match and match[0].accepted else None
        rows = [dataclasses.replace(c, chosen=c.here and c.name == chosen) for c in rows]
    if chosen is not None:  # the checks its call runs before the kernel: never name one whose call raises
        impl_for(chosen, md).check_call(problem)
    return Explanation(problem, requested, chosen, tuple(rows), detect_device().label)


def accepting(problem: Problem, metadata: AttentionMetadata) -> list[str]:
    """Names of the impls here that accept ``problem``, best first."""
    return [c.name for c in _evaluate(problem, metadata) if c.accepted]


def get_optimal_config(metadata: AttentionMetadata | None = None) -> tuple[str, Any]:
    """``(impl name, dtype)`` that "auto" uses for a default shape on this device.

    The default shape is B=1, T=S=2048, 32 heads, D=128, causal, in the platform's preferred
    dtype (float32 on CPUs and on TPU v2/v3, bfloat16 elsewhere). Raises ``UnsupportedError``
    (saying what to install) when no installed backend runs it: there is no built-in fallback.
    """
    import jax
    import jax.numpy as jnp

    md = metadata or DEFAULT_METADATA
    device = detect_device()
    platform, _ = resolve_platform(md, device)
    old_tpu = platform == "tpu" and device.tpu_generation in ("v2", "v3")
    dtype = jnp.float32 if platform == "cpu" or old_tpu else jnp.bfloat16
    shape = jax.ShapeDtypeStruct((1, 2048, 32, 128), dtype)
    problem = AttentionProblem.from_inputs(shape, shape, shape, causal=True)
    chosen, rows = choose(problem, md)
    if chosen is None:
        raise _no_choice(rows)
    return chosen, dtype
