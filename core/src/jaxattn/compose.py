"""What runs around a kernel when ``jaxattn.get_impl`` builds the impl: hand-off and sharding.

An ``AttentionImpl`` validates a call and routes it to its ``forward_<platform>``; it does not
decide what surrounds the kernel. The instances ``jaxattn.get_impl`` returns carry
:data:`COMPOSED` as their runner, which decides it per call:

* **hand-off**: a call the impl accepts only by handing it to ``fallback_impl``
  (``fallback_reasons`` non-empty) runs on that impl, logged once;
* **sharding**: with ``metadata.mesh`` set (and an impl that does not shard the sequence
  itself, as ring does), the kernel runs under ``shard_map`` over the batch and head axes
  (``jaxattn.sharding.wrap``).
"""

from __future__ import annotations

import logging
from typing import Any

from .backend import Backend, Call, Forward
from .errors import JaxattnError
from .impl import AttentionImpl
from .lookup import impl_for
from .output import AttentionOutput
from .problem import Problem
from .sharding.wrap import sharded_forward

__all__ = ["COMPOSED", "ComposedRunner"]

logger = logging.getLogger("jaxattn")


def _shard(impl: Backend[Any], forward: Forward) -> Forward:
    assert isinstance(impl, AttentionImpl)  # only dense calls run on a mesh (paged ones decline it)
    return sharded_forward(impl, forward.__name__)


class ComposedRunner:
    """Hands calls to ``fallback_impl`` where the impl says so; shards kernels over a mesh."""

    def __init__(self) -> None:
        self._logged: set[tuple[str, str, tuple[str, ...]]] = set()

    def reasons(self, impl: Backend[Any], problem: Problem) -> list[str]:
        return []  # hand-off and sharding are both available here

    def run(self, impl: Backend[Any], problem: Problem, call: Call) -> AttentionOutput:
        why = impl.fallback_reasons(problem)
        if why:
            target = impl.fallback_impl
            if target is None:  # the core has no fallback of its own: the backend declares one
                raise JaxattnError(
                    f"{impl.name()} gives fallback_reasons for {problem.describe()} but declares no fallback_impl; "
                    f"set fallback_impl = 'NAME' on {type(impl).__name__} (the impl it hands such calls to), "
                    "or decline the call in not_supported_reasons instead")
            key = (impl.name(), target, tuple(why))
            if key not in self._logged:
                self._logged.add(key)
                logger.info("jaxattn: %s hands %s to %s: %s", impl.name(), problem.describe(), target, "; ".join(why))
            # The platform override and interpret mode were for the handing impl's kernel.
            impl = impl_for(target, impl.metadata.replace(platform=None, interpret=False))
        wrap = _shard if impl.metadata.mesh is not None and not impl.sequence_parallel and impl.kind == "dense" \
            else None
        return impl.run_kernel(problem, call, wrap)


#: The runner of the impls ``jaxattn.get_impl`` builds.
COMPOSED = ComposedRunner()
