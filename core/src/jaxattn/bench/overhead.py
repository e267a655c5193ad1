"""``jaxattn bench --overhead``: what "auto" costs per call beyond the impl it picks.

"auto" chooses at trace time. Under ``jax.jit`` it should cost nothing per call: the program
is the chosen kernel's own (checked by comparing the lowered programs' text). Eager calls
re-enter Python every time; there the choice must be a memo lookup, so "auto" should add
only microseconds over calling the chosen impl by name. A tiny shape keeps the kernel's own
time small, so the Python overhead is visible.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from ..metadata import AttentionMetadata
from .shapes import BenchShape

__all__ = ["OverheadReport", "measure_overhead"]


@dataclasses.dataclass
class OverheadReport:
    shape: BenchShape
    chosen: str
    rows: list[tuple[str, float]]  # (what, microseconds per call)
    jit_identical: bool
    device: str

    def to_dict(self) -> dict[str, Any]:
        return {"shape": self.shape.to_dict(), "chosen": self.chosen, "device": self.device,
                "per_call_us": dict(self.rows), "jit_programs_identical": self.jit_identical}


def _per_call_us(fn: Callable[[], Any], calls: int) -> float:
    """Median over 5 batches of ``calls`` calls (the batch absorbs timer resolution)."""
    import jax

    jax.block_until_ready(fn())  # warm: compiles, fills caches
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        batches.append((time.perf_counter() - start) / calls * 1e6)
    return float(statistics.median(batches))


def _lowered_text(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    import jax

    def attention_program(q: Any, k: Any, v: Any) -> Any:  # one name, so module names match
        return fn(q, k, v)

    return str(jax.jit(attention_program).lower(*args).as_text())


def measure_overhead(shape: BenchShape, metadata: AttentionMetadata | None = None,
                     calls: int = 200) -> OverheadReport:
    import jax

    import jaxattn

    from ..dispatch import _evaluate, choose
    from ..problem import AttentionProblem
    from .timing import make_inputs

    md = metadata or AttentionMetadata()
    q, k, v, _ = make_inputs(shape.structs())
    causal = shape.causal
    problem = AttentionProblem.from_inputs(q, k, v, causal=causal)
    chosen, _ = choose(problem, md)
    if chosen is None:
        raise jaxattn.UnsupportedError("auto", [f"no impl accepts {shape.label} here"])
    direct = jaxattn.get_impl(chosen, md)

    def by_impl() -> Any:
        return direct(q, k, v, causal=causal).attention_outputs

    def by_name() -> Any:
        return jaxattn.attention(q, k, v, impl=chosen, causal=causal, metadata=md)

    def by_auto() -> Any:
        return jaxattn.attention(q, k, v, impl="auto", causal=causal, metadata=md)

    jit_direct = jax.jit(lambda q, k, v: direct(q, k, v, causal=causal).attention_outputs)
    jit_auto = jax.jit(lambda q, k, v: jaxattn.attention(q, k, v, impl="auto", causal=causal, metadata=md))
    rows = [
        ("choose(): memo hit", _per_call_us(lambda: choose(problem, md), calls * 10)),
        ("choose(): every impl asked (what the memo saves)", _per_call_us(lambda: _evaluate(problem, md), calls)),
        (f"eager: {chosen} impl object", _per_call_us(by_impl, calls)),
        (f"eager: attention(impl={chosen!r})", _per_call_us(by_name, calls)),
        ("eager: attention(impl='auto')", _per_call_us(by_auto, calls)),
        (f"jit: {chosen} impl object", _per_call_us(lambda: jit_direct(q, k, v), calls)),
        ("jit: attention(impl='auto')", _per_call_us(lambda: jit_auto(q, k, v), calls)),
    ]
    identical = _lowered_text(by_auto_fn(md, causal), (q, k, v)) == _lowered_text(
        lambda q, k, v: direct(q, k, v, causal=causal).attention_outputs, (q, k, v))
    return OverheadReport(shape, chosen, rows, identical, jaxattn.detect_device().label)


def by_auto_fn(md: AttentionMetadata, causal: bool) -> Callable[[Any, Any, Any], Any]:
    import jaxattn

    return lambda q, k, v: jaxattn.attention(q, k, v, impl="auto", causal=causal, metadata=md)
