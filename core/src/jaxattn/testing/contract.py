"""What third-party backends get wrong, checked on their own: the form of the forward, and what
it returns (an ``AttentionOutput`` whose ``attention_outputs`` has the call's shape and dtype).

The core checks both too (the form when the class is loaded, the output after every kernel) and
auto declines a backend that fails either; the conformance suites run these so that a plugin's
own CI says which rule it broke, rather than finding auto running something else.
"""

from __future__ import annotations

from typing import Any

from jaxattn.backend.base import Backend
from jaxattn.backend.forms import ACCEPTED, forward_problems
from jaxattn.backend.output import AttentionOutput

__all__ = ["assert_forward_form", "assert_output_contract"]


def assert_forward_form(impl: Backend[Any]) -> None:
    """Every forward ``type(impl)`` overrides has an accepted form and takes what it declares."""
    problems = forward_problems(type(impl), Backend)
    assert not problems, f"{impl!r}: {'; '.join(problems)}. A forward takes one of two forms: {ACCEPTED}"


def assert_output_contract(impl: Backend[Any], call: Any, label: str) -> None:
    """The routed forward of ``impl`` (no checks around it) on a validated, accepted ``call``
    returns an ``AttentionOutput`` of the call's output shape, in the call's compute dtype."""
    out = impl.route()(call)
    assert isinstance(out, AttentionOutput), (
        f"{label}: {impl!r} returned {type(out).__name__}, not an AttentionOutput "
        "(return jaxattn.backend.AttentionOutput(attention_outputs=...))")
    values = out.attention_outputs
    shape, dtype = impl.output_shape(call.problem), impl.compute_dtype(call.problem)
    assert tuple(values.shape) == shape, f"{label}: attention_outputs has shape {tuple(values.shape)}, not {shape}"
    assert str(values.dtype) == dtype, (f"{label}: attention_outputs is {values.dtype} for a {dtype} call "
                                        "(the output is in the call's compute dtype)")
