"""``Candidate``: one implementation's answer for one call, as "auto" and ``explain`` rank them."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Candidate"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One implementation's answer for one call."""

    name: str
    origin: str
    priority: int
    platforms: tuple[str, ...]
    reasons: tuple[str, ...] = ()
    fallback: tuple[str, ...] = ()  # set when it would fall back on another impl
    fallback_impl: str | None = None
    notes: tuple[str, ...] = ()  # how an accepted impl would run the call
    here: bool = True
    chosen: bool = False
    # Why it holds its place in auto's ranking: declared priority, or a measurement.
    rank_reason: str = ""
    measured: bool = False
    # Set on auto's pick when differentiated calls run another impl: its own backward cannot
    # run the call (``grad_reasons`` says why), or measurements found another one faster.
    grad_impl: str | None = None
    grad_reasons: tuple[str, ...] = ()

    @property
    def accepted(self) -> bool:
        return self.here and not self.reasons

    @property
    def status(self) -> str:
        if self.chosen:
            return "chosen"
        if not self.here:
            return "other platform"
        if self.reasons:
            return "declined"
        if self.fallback:
            return f"via {self.fallback_impl}"
        return "accepted"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(status=self.status, accepted=self.accepted)
        return out
