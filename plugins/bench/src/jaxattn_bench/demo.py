"""``jaxattn demo``: attention through the registry, with the reasons for the choice.

It uses only the public API, as a user would: ``list_impls`` for what is installed,
``explain`` for which backend runs a call and why the others do not, ``attention`` to
compute it, ``get_impl`` to run every other backend that accepts the call, and the float64
oracle of ``jaxattn.testing`` to check each result. Exit status 1 if any result is wrong.
``python -m jaxattn_bench.demo`` runs it too (what ``python3 run.py demo`` runs is ``jaxattn demo``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["HELP", "add_arguments", "build_parser", "main", "run"]

TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2, "float16": 5e-3}


HELP = "compute attention through the registry: which backend ran, why, and its error against the oracle"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxattn.cli import positive_int

    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--seq", type=positive_int, default=256, help="T = S")
    parser.add_argument("--heads-q", type=positive_int, default=8)
    parser.add_argument("--heads-kv", type=positive_int, default=2, help="< heads-q: grouped-query attention")
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--impl", default=None, help="ask for one impl instead of auto")


def build_parser() -> argparse.ArgumentParser:
    from jaxattn.cli import OneLineParser

    parser = OneLineParser(prog="python -m jaxattn_bench.demo", description=HELP)
    add_arguments(parser)
    return parser


def _heads_error(args: argparse.Namespace) -> str | None:
    if args.heads_q % args.heads_kv:
        return (f"argument --heads-kv: --heads-q {args.heads_q} must be a multiple of --heads-kv "
                f"{args.heads_kv}, e.g. --heads-q 8 --heads-kv 2")
    return None


def _max_error(out: Any, reference: Any) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(out, dtype=np.float64) - reference)))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxattn_bench.demo``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    refused = _heads_error(args)
    if refused:
        parser.error(refused)
    from jaxattn.backend import JaxattnError

    try:
        return run(args)
    except JaxattnError as err:  # as `jaxattn demo` reports it: one line, exit 2
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    refused = _heads_error(args)
    if refused:  # the one-line form of a parser error (exit status 2), as for every option
        print(f"jaxattn demo: error: {refused}", file=sys.stderr)
        return 2
    if args.impl is not None:  # an unknown name: "unknown impl", not "nothing can run this call"
        from jaxattn.cli import check_impl_names

        args.impl = args.impl.strip().lower()
        check_impl_names("--impl", [args.impl], "dense")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxattn
    from jaxattn.cli import Printer
    from jaxattn.testing import oracle

    # Plain text wrapped at spaces to the terminal's width ($COLUMNS; 80 when piped).
    say = Printer(plain=True).line
    device = jaxattn.detect_device()
    say(f"jaxattn {jaxattn.__version__} on {device.label} (jax {jax.__version__})")
    rows = jaxattn.list_impls()
    say("installed:")
    for row in rows:
        where = "usable here" if row.usable_here else (row.reason or row.status)
        aliases = f" (aliases: {', '.join(row.aliases)})" if row.aliases else ""
        say(f"  {row.name}{aliases} from {row.distribution or row.plugin}: {where}")

    dtype = jnp.dtype(args.dtype)
    shape_q = (args.batch, args.seq, args.heads_q, args.head_dim)
    shape_kv = (args.batch, args.seq, args.heads_kv, args.head_dim)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], shape_q, dtype)
    k = jax.random.normal(keys[1], shape_kv, dtype)
    v = jax.random.normal(keys[2], shape_kv, dtype)

    say()
    explanation = jaxattn.explain(q, k, v, impl=args.impl, causal=args.causal)
    for line in str(explanation).splitlines():
        say(line)
    if explanation.chosen is None:
        print("\nno installed backend can run this call; see the reasons above", file=sys.stderr)
        return 1

    chosen = next(c for c in explanation.candidates if c.chosen)
    if explanation.requested == "auto":
        runners_up = [c.name for c in explanation.candidates if c.accepted and not c.chosen]
        say(f"\nwhy: {chosen.name} (priority {chosen.priority}, from {chosen.origin}) is the "
              f"highest-ranked impl that accepts this call on {device.platform}"
              + (f"; also accepted: {', '.join(runners_up)}" if runners_up else ""))
    else:
        say(f"\nwhy: impl={explanation.requested!r} was asked for, and it accepts this call")

    reference = oracle.attention(np.asarray(q, np.float64), np.asarray(k, np.float64),
                                 np.asarray(v, np.float64), causal=args.causal).output
    tolerance = TOLERANCE[args.dtype]
    if device.platform != "cpu":
        # float32 matmuls on GPUs (TF32) and TPUs (bfloat16 passes) are not float32-exact
        # under JAX's default precision; a wrong result is still orders of magnitude off.
        tolerance = max(tolerance, 1e-2)
    # jit: the registry picks the backend while tracing, so the compiled program is its own.
    run = jax.jit(lambda q, k, v: jaxattn.attention(q, k, v, impl=args.impl, causal=args.causal))
    out = run(q, k, v)
    error = _max_error(out, reference)
    ok = error <= tolerance
    say(f"\nran {explanation.chosen}: output {tuple(out.shape)}, "
          f"max |error| vs the float64 oracle {error:.2e} (tolerance {tolerance:g}): "
          f"{'OK' if ok else 'WRONG'}")

    # Every other backend that accepts the call, run explicitly by name, checked the same way.
    for candidate in explanation.candidates:
        if candidate.accepted and not candidate.chosen:
            impl = jaxattn.get_impl(candidate.name)
            other = impl(q, k, v, causal=args.causal).attention_outputs
            err = _max_error(other, reference)
            ok = ok and err <= tolerance
            say(f"also ran {candidate.name}: max |error| {err:.2e}: "
                  f"{'OK' if err <= tolerance else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
