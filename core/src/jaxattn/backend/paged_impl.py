"""``PagedAttentionImpl``: the contract of backends that attend over a paged KV cache (serving).

One op kind covers the seed's cached mechanisms: a decode step (``page_attention``, T queries
per sequence) and a ragged batch mixing prefill chunks and decode steps
(``ragged_page_attention_v3`` / ``_v2``). Every call reaches a backend in the ragged form:

    forward_<platform>(call: PagedCall) -> AttentionOutput

with the call's fields ``q (num_tokens, Hq, D)``, ``k_pages``, ``v_pages``, ``page_table``,
``kv_lengths``, ``cu_q_lens``, ``num_seqs``, ``kv_layout``, ``queries_per_seq``, ``softmax_scale``,
``logits_soft_cap``, ``sliding_window``, ``softmax_aux``, ``k_scale``, ``v_scale`` (``jaxattn.backend.call``).

``k_pages``/``v_pages`` are ``(num_pages, page_size, Hkv, D|Dv)`` with ``kv_layout="separate"``;
with ``kv_layout="combined"`` ``k_pages`` is JAX's TPU layout ``(num_pages, page_size, 2*Hkv, D)``
(K head h at 2h, V head h at 2h + 1) and ``v_pages`` is None. A quantized cache (int8/float8,
``Feature.QUANTIZED_KV``) arrives as it is, with ``k_scale`` and ``v_scale`` float32 of rank 3
broadcastable against ``(num_pages, page_size, Hkv)`` (``jaxattn.backend.quantize``); other calls have no
scales. ``num_seqs`` is an int32 array of shape (1,), its value also ``static_num_seqs``
when known before tracing; ``queries_per_seq`` is T when every sequence has T queries
(cu_q_lens = arange * T), None for a ragged batch; ``sliding_window`` (on the call and on its
``problem``) is None or the pair ``(left, 0)`` (``PagedAttentionImpl.window_pair``). The output
is ``(num_tokens, Hq, Dv)``; rows past ``cu_q_lens[num_seqs]`` and rows that see no key are
zeros. Semantics: docs/contract.md.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

from .base import Backend, Forward
from .call import PagedCall
from .metadata import axis_tuple, describe_axes
from .paged_validation import resolve_paged_call
from .problem import PagedProblem

if TYPE_CHECKING:
    from .output import AttentionOutput

__all__ = ["PagedAttentionImpl", "PagedCall"]

#: The methods of a backend that are handed a problem first (``not_supported_reasons``, ``notes``,
#: ``fallback_reasons``, ``check_call``...): those a ``window_pair = False`` class overrides are
#: asked with the int left window. Read off ``Backend``, so that a hook added there is covered.
_PROBLEM_HOOKS = tuple(name for name, f in vars(Backend).items()
                       if inspect.isfunction(f) and list(inspect.signature(f).parameters)[1:2] == ["problem"])


def _left_window(problem: PagedProblem) -> PagedProblem:
    """``problem`` as a ``window_pair = False`` backend reads it: its window the int left."""
    window = problem.sliding_window  # None, or already the int (a hook calling another): as it is
    # Outside the field's annotation on purpose: the form those hooks were written against.
    return dataclasses.replace(problem, sliding_window=cast(Any, window[0])) if isinstance(window, tuple) else problem


def _asked_with_left_window(hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(hook)
    def asked(self: PagedAttentionImpl, problem: PagedProblem, *args: Any, **kwargs: Any) -> Any:
        return hook(self, _left_window(problem), *args, **kwargs)

    return asked


class PagedAttentionImpl(Backend[PagedProblem]):
    """Base class of backends over a paged KV cache. Subclass it, declare capabilities, override forwards."""

    kind = "paged"
    #: Which ``sliding_window`` the backend reads, said by one that declares
    #: ``Feature.SLIDING_WINDOW``: True, the ``(left, 0)`` pair that the call and its problem hold;
    #: False, the int left (a compatibility form: ``route`` hands the forward a copy of the call,
    #: and of its problem, holding the int, and the problem hooks the class overrides are asked
    #: about such a copy). Left None with the feature declared, the class is refused when it loads
    #: (``backend.forms``).
    window_pair: ClassVar[bool | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.window_pair is False:  # hooks written against the int window keep reading one
            for name in _PROBLEM_HOOKS:
                if inspect.isfunction(hook := vars(cls).get(name)):
                    setattr(cls, name, _asked_with_left_window(hook))

    def not_supported_reasons(self, problem: PagedProblem) -> list[str]:
        reasons = self.declared_reasons(problem)
        md, heads = self.metadata, axis_tuple(self.metadata.head_axis)
        if md.batch_axis or md.sequence_axis:
            reasons.append("paged attention shards only the KV heads (AttentionMetadata.head_axis): its sequences "
                           "share one page pool, so batch_axis and sequence_axis are declined")
        n = math.prod(dict(md.mesh.shape)[a] for a in heads) if md.mesh is not None else 1
        if problem.heads_kv % n:
            reasons.append(f"Hkv={problem.heads_kv} KV heads do not split over mesh axis {describe_axes(heads)} of "
                           f"size {n} (AttentionMetadata.head_axis): each device must hold whole KV heads' pages")
        return reasons

    def route(self) -> Forward:
        """``Backend.route``; for ``window_pair = False``, the forward given the int left window
        (on the call and on its problem)."""
        forward = super().route()
        if self.window_pair is not False:
            return forward

        def left_window(call: PagedCall) -> AttentionOutput:
            window = call.sliding_window
            return forward(call if window is None else
                           call.replace(sliding_window=window[0], problem=_left_window(call.problem)))

        left_window.__name__ = getattr(forward, "__name__", "forward")
        return left_window

    def validate(self, q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lengths: Any, *,
                prepare: bool = False, **features: Any) -> PagedCall:
        """The validated ``PagedCall`` of these arguments under this impl's metadata."""
        return resolve_paged_call(q, k_pages, v_pages, page_table, kv_lengths, metadata=self.metadata,
                                  prepare=prepare, **features)

    def supports(self, q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lengths: Any, *,
                 needs_grad: bool = False, **features: Any) -> list[str]:
        """Every reason this backend cannot run the call (arrays or ShapeDtypeStructs); [] if it can.

        Takes the ragged form's keywords: ``cu_q_lens``, ``num_seqs`` (required), ``kv_pages``,
        ``queries_per_seq``, ``sliding_window``, ``softmax_scale``, ``logits_soft_cap``,
        ``softmax_aux``, ``k_scale``, ``v_scale``.
        """
        problem = self.validate(q, k_pages, v_pages, page_table, kv_lengths, **features).problem
        if needs_grad:
            problem = dataclasses.replace(problem, needs_grad=True)
        return self.reasons_to_decline(problem) + self.direct_reasons(problem)

    # -- running ----------------------------------------------------------------------------
    def __call__(self, q: Any, k_pages: Any, v_pages: Any, page_table: Any, kv_lengths: Any,
                 **features: Any) -> AttentionOutput:
        """Validate (once, into a ``PagedCall``), check support (one error with every reason),
        then run on this device."""
        return self.run(self.validate(q, k_pages, v_pages, page_table, kv_lengths, prepare=True, **features))

    def output_shape(self, problem: PagedProblem) -> tuple[int, ...]:
        return (problem.num_tokens, problem.heads_q, problem.head_dim_v)
