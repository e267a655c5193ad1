"""What surrounds a kernel when ``jaxattn.get_impl`` builds the impl: fallback and sharding.

An impl decides once per problem how its calls run (``Backend.plan``); the instances
``jaxattn.get_impl`` returns carry :data:`COMPOSED`, which gives that plan two steps a backend
constructed directly declines:

* **fallback**: a call the impl accepts only by falling back on ``fallback_impl``
  (``fallback_reasons`` non-empty) runs on that impl, logged once;
* **sharding**: with ``metadata.mesh`` set (and an impl that does not shard the sequence
  itself, as ring does), the kernel runs under ``shard_map`` over the batch and head axes
  (``jaxattn.sharding.wrap``); a paged kernel over the head axis only, each device holding
  its KV heads' pages.
"""

from __future__ import annotations

import logging
from typing import Any

from ..backend.base import Backend, Composition, Forward
from ..backend.impl import AttentionImpl
from ..backend.paged_impl import PagedAttentionImpl
from ..backend.problem import Problem
from ..errors import JaxattnError
from ..selection.lookup import impl_for
from ..sharding.wrap import sharded_forward, sharded_paged_forward

__all__ = ["COMPOSED"]

logger = logging.getLogger("jaxattn")

#: Fallbacks already logged: (impl, target, reasons).
_logged: set[tuple[str, str, tuple[str, ...]]] = set()


def _fallback(impl: Backend[Any], problem: Problem, why: list[str]) -> Backend[Any]:
    target = impl.fallback_impl
    if target is None:  # the core has no fallback of its own: the backend declares one
        raise JaxattnError(
            f"{impl.name()} gives fallback_reasons for {problem.describe()} but declares no fallback_impl; "
            f"set fallback_impl = 'NAME' on {type(impl).__name__} (the impl it falls back on for such calls), "
            "or decline the call in not_supported_reasons instead")
    key = (impl.name(), target, tuple(why))
    if key not in _logged:
        _logged.add(key)
        logger.info("jaxattn: %s falls back on %s for %s: %s", impl.name(), target, problem.describe(), "; ".join(why))
    # The platform override and interpret mode were for the falling-back impl's kernel.
    return impl_for(target, impl.metadata.replace(platform=None, interpret=False))


def _shard(impl: Backend[Any]) -> Forward:
    if isinstance(impl, AttentionImpl):
        return sharded_forward(impl)
    assert isinstance(impl, PagedAttentionImpl)  # paged calls shard their KV heads only
    return sharded_paged_forward(impl)


#: The composition of the impls ``jaxattn.get_impl`` builds.
COMPOSED = Composition(fallback=_fallback, shard=_shard)
