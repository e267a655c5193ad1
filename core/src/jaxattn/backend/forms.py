"""The two forms a backend's forward takes, told apart when its class is loaded.

* **the call form**, the one to write: ``forward(self, call) -> AttentionOutput`` (or, to split
  by platform, ``forward_<platform>(self, call)``), reading the validated ``AttentionCall`` or
  ``PagedCall``;
* **the seed's form**, as EasyDeL writes its attention operators, for dense backends:
  ``forward_<platform>(self, q, k, v, mask=None, bias=None, init_bias=None, causal=False, **ignore)``.
  The core adapts it (``seed_forward``): the call's arrays go in as arguments, and each feature
  the class declares as the keyword(s) of ``SEED_KEYWORDS``, which its forward must name (a
  declared feature swallowed by ``**ignore`` would be computed wrong, silently).

A forward of neither form is refused when the class is loaded
(``Registry`` records a ``DeclarationError`` naming the impl and both forms), so no call ever
meets a ``TypeError`` from inside it.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

from .capabilities import Feature

__all__ = ["ACCEPTED", "FORWARDS", "SEED_KEYWORDS", "form_of", "forward_problems", "seed_forward"]

#: The methods a backend may override to run calls (``forward`` first: it wins).
FORWARDS = ("forward", "forward_native", "forward_cpu", "forward_tpu", "forward_gpu", "forward_cuda", "forward_rocm")

#: Both accepted forms, as the refusal of any other says them.
ACCEPTED = ("forward(self, call) -> AttentionOutput (or forward_<platform>(self, call)) reading the validated call; "
            "or, for a dense impl, the seed's forward_<platform>(self, q, k, v, mask=None, bias=None, init_bias=None, "
            "causal=False, **ignore)")

#: The call's fields a seed-form forward receives, by name, for each feature its class declares.
SEED_KEYWORDS: dict[Feature, tuple[str, ...]] = {
    Feature.MASK: ("mask",), Feature.BIAS: ("bias",), Feature.CAUSAL: ("causal",),
    Feature.SLIDING_WINDOW: ("sliding_window",), Feature.SEGMENT_IDS: ("q_segment_ids", "kv_segment_ids"),
    Feature.SOFT_CAP: ("logits_soft_cap",), Feature.SINKS: ("softmax_aux",),
    Feature.DROPOUT: ("dropout_prob", "dropout_rng"), Feature.KV_LENGTHS: ("kv_lengths",),
    Feature.QUANTIZED_KV: ("k_scale", "v_scale"),
}

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _parameters(cls: type, name: str) -> list[inspect.Parameter] | None:
    """``cls.name``'s parameters after ``self`` (None when it has no readable signature)."""
    raw = inspect.getattr_static(cls, name)
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    return params if isinstance(raw, staticmethod) else params[1:]


def form_of(cls: type, name: str) -> str | None:
    """"call" (one required positional argument), "seed" (q, k, v, then optional ones) or None.

    A method that only passes its arguments on, ``(self, *args, **kwargs)`` (the seed's
    ``forward_cpu`` calling ``forward_native``), has the form of the class's other forwards:
    "seed" where one of them is, else "call".
    """
    params = _parameters(cls, name)
    if params is None:
        return None
    if any(p.kind == inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty for p in params):
        return None
    required = [p for p in params if p.kind in _POSITIONAL and p.default is inspect.Parameter.empty]
    if not required and any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        seeds = (n for n in FORWARDS if n != name and getattr(cls, n, None) is not None and _own(cls, n))
        return "seed" if any(_fixed_form(cls, n) == "seed" for n in seeds) else "call"
    if len(required) == 1:
        return "call"
    if len(required) == 3:
        return "seed"
    return None


def _own(cls: type, name: str) -> bool:
    """Whether ``cls`` (or a base other than the core's) overrides forward ``name``."""
    return any(name in vars(c) for c in cls.__mro__ if not c.__module__.startswith("jaxattn."))


def _fixed_form(cls: type, name: str) -> str | None:
    """``form_of`` for a method with fixed parameters (None for one that passes them on)."""
    params = _parameters(cls, name) or []
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    required = [p for p in params if p.kind in _POSITIONAL and p.default is inspect.Parameter.empty]
    return "seed" if len(required) == 3 else None


def _named(params: list[inspect.Parameter]) -> set[str]:
    return {p.name for p in params if p.kind in (*_POSITIONAL, inspect.Parameter.KEYWORD_ONLY)}


def _shown(cls: type, name: str) -> str:
    try:
        return f"{name}{inspect.signature(inspect.getattr_static(cls, name))}"
    except (TypeError, ValueError):
        return name


def forward_problems(cls: Any, base: type) -> list[str]:
    """What is wrong with the forwards of ``cls`` (a subclass of ``base``, ``Backend``): empty
    when each one it overrides has an accepted form and takes what its class declares."""
    # A class that overrides none is not refused: its calls raise "has no forward" (a declaration-only
    # class is a fine thing to list), and auto declines it for such calls with that reason.
    mine = [n for n in FORWARDS if getattr(cls, n, None) is not getattr(base, n)]
    out = []
    for name in mine:
        form = form_of(cls, name)
        if form is None:
            out.append(f"{_shown(cls, name)} has neither form")
        elif form == "seed" and (name == "forward" or cls.kind != "dense"):
            out.append(f"{_shown(cls, name)} takes q, k, v, which only a dense impl's forward_<platform> may")
        elif form == "seed" and _fixed_form(cls, name) == "seed":  # one passing its arguments on is not asked
            named = _named(_parameters(cls, name) or [])
            missing = [f"{kw} (it declares Feature.{f.name})" for f in sorted(cls.features, key=str)
                       for kw in SEED_KEYWORDS.get(f, ()) if kw not in named]
            if missing:
                out.append(f"{_shown(cls, name)} takes no argument {', '.join(missing)}: a declared feature must be "
                           "a named parameter, or **ignore would drop it")
    if mine and cls.kind == "paged" and Feature.SLIDING_WINDOW in cls.features and cls.window_pair is None:
        out.append("it declares Feature.SLIDING_WINDOW but not which call.sliding_window its forward reads: set "
                   "window_pair = True for the (left, 0) pair, or window_pair = False for the int left window "
                   "(PagedAttentionImpl.window_pair)")
    return out


def seed_forward(impl: Any, name: str) -> Callable[[Any], Any]:
    """``impl``'s seed-form method ``name`` as a forward of the call form.

    The call's arrays go in positionally; ``mask``, ``bias``, ``init_bias`` (None: the bias is
    already built) and ``causal`` by keyword where the method takes them; the fields of each
    declared feature (``SEED_KEYWORDS``) by name. The softmax scale goes in as ``softmax_scale``
    when the method names it; otherwise the method reads it from ``self.metadata``, as EasyDeL's
    operators do, so it runs on a copy of ``impl`` whose metadata holds the call's scale.
    """
    params = _parameters(type(impl), name) or []
    named = _named(params)
    anything = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    fields = [kw for kw in ("mask", "bias", "causal") if kw in named or anything]
    fields += [kw for f in impl.features for kw in SEED_KEYWORDS.get(f, ()) if kw not in fields]
    none = ["init_bias"] if "init_bias" in named or anything else []
    scale_by_name = "softmax_scale" in named
    scale_passed = scale_by_name or anything
    copies: dict[float, Any] = {}

    def seeded(call: Any) -> Any:
        target = impl
        if not scale_by_name and impl.metadata.softmax_scale != call.softmax_scale:
            target = copies.get(call.softmax_scale)
            if target is None:
                target = copies[call.softmax_scale] = copy.copy(impl)
                target.metadata = impl.metadata.replace(softmax_scale=call.softmax_scale)
        kwargs = {kw: getattr(call, kw) for kw in fields} | dict.fromkeys(none)
        if scale_passed:
            kwargs["softmax_scale"] = call.softmax_scale
        return getattr(target, name)(call.q, call.k, call.v, **kwargs)

    seeded.__name__ = name
    return seeded
