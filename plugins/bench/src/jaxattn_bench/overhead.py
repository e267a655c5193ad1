"""``jaxattn bench --overhead``: what "auto" costs per call beyond the impl it picks.

"auto" chooses at trace time. Under ``jax.jit`` it should cost nothing per call: the program
is the chosen kernel's own (checked by comparing the lowered programs' text). Eager calls
re-enter Python every time; there the choice must be a memo lookup, so "auto" should add
only microseconds over calling the chosen impl by name. A tiny shape keeps the kernel's own
time small; even so, eager totals vary by more than auto's own work from run to run, so
that work (building the call key, one dict lookup) is also timed by itself.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from jaxattn.backend import AttentionMetadata

from .shapes import BenchShape

__all__ = ["AUTO_OWN", "OverheadReport", "measure_overhead"]

AUTO_OWN = "auto's own work on a repeated call (its plan's memo lookup)"


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


def _per_call_us(fns: dict[str, Callable[[], Any]], batch_s: float, rounds: int = 7) -> dict[str, float]:
    """Median per-call time of each function, in batches of about ``batch_s`` seconds.

    Rounds interleave the functions (a, b, c, a, b, c, ...), so that drift in the machine's
    load hits every function alike instead of whichever happened to run during it.
    """
    import jax

    calls: dict[str, int] = {}
    for name, fn in fns.items():
        jax.block_until_ready(fn())  # warm: compiles, fills caches
        start = time.perf_counter()
        jax.block_until_ready(fn())
        calls[name] = max(3, min(100_000, int(batch_s / max(time.perf_counter() - start, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                out = fn()
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / calls[name] * 1e6)
    return {name: float(statistics.median(times)) for name, times in samples.items()}


def _lowered_text(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    import jax

    def attention_program(q: Any, k: Any, v: Any) -> Any:  # one name, so module names match
        return fn(q, k, v)

    return str(jax.jit(attention_program).lower(*args).as_text())


def measure_overhead(shape: BenchShape, metadata: AttentionMetadata | None = None,
                     batch_s: float = 0.2) -> OverheadReport:
    import jax

    import jaxattn
    from jaxattn.backend import AttentionProblem, AutoAttention, choose, evaluate

    from .timing import make_inputs

    md = metadata or AttentionMetadata()
    q, k, v, _ = make_inputs(shape.structs())
    kw = shape.call_kwargs
    problem = AttentionProblem.from_inputs(q, k, v, **kw)
    chosen, _ = choose(problem, md)
    if chosen is None:
        raise jaxattn.UnsupportedError("auto", [f"no impl accepts {shape.label} here"])
    auto = jaxattn.get_impl("auto", md)
    assert isinstance(auto, AutoAttention)
    direct = auto.select(problem)  # what auto runs: the chosen impl, or its measured fwd/grad split

    def by_impl() -> Any:
        return direct(q, k, v, **kw).attention_outputs

    def by_name() -> Any:
        return jaxattn.attention(q, k, v, impl=chosen, metadata=md, **kw)

    def by_auto() -> Any:
        return jaxattn.attention(q, k, v, impl="auto", metadata=md, **kw)

    jit_direct = jax.jit(lambda q, k, v: direct(q, k, v, **kw).attention_outputs)
    jit_auto = jax.jit(lambda q, k, v: jaxattn.attention(q, k, v, impl="auto", metadata=md, **kw))
    rows = list(_per_call_us({
        AUTO_OWN: lambda: auto.memoised_plan(problem),  # what auto adds to a named impl's path
        "choose(): memo hit": lambda: choose(problem, md),
        "choose(): every impl asked (what the memo saves)": lambda: evaluate(problem, md),
    }, batch_s).items())
    rows += _per_call_us({
        f"eager: {chosen} impl object": by_impl,
        f"eager: attention(impl={chosen!r})": by_name,
        "eager: attention(impl='auto')": by_auto,
    }, batch_s).items()
    rows += _per_call_us({
        f"jit: {chosen} impl object": lambda: jit_direct(q, k, v),
        "jit: attention(impl='auto')": lambda: jit_auto(q, k, v),
    }, batch_s).items()
    identical = _lowered_text(jit_auto, (q, k, v)) == _lowered_text(jit_direct, (q, k, v))
    return OverheadReport(shape, chosen, rows, identical, jaxattn.detect_device().label)
