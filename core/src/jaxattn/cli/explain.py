"""``jaxattn explain``: for a call described by shapes and flags, which impl runs and why.

Nothing is computed: the call is built from ``jax.ShapeDtypeStruct``s and handed to
``jaxattn.explain`` (or ``jaxattn.explain_paged`` with ``--paged`` / ``--ragged``), which asks
every implementation of the call's kind for its reasons.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..backend.quantize import KV_DTYPE_FLAGS
from ._args import float_dtype, mesh_axes, nonneg_window, positive_float, positive_int, probability
from ._output import Printer, Table, dump_json
from ._plugins import is_plugin_row

HELP = "show which implementation a call would use, and every other one's reasons"

# Broadcast patterns for --mask / --bias: one letter per dim of (B, Hq, T, S), "1" = broadcast.
_DIMS = "bhts"


def _pattern(text: str) -> str:
    text = text.lower()
    if len(text) != 4 or any(c not in (d, "1") for c, d in zip(text, _DIMS, strict=True)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give 4 characters, each the dim letter of (b, h, t, s) or 1, e.g. b11s")
    return text


#: ``--mask-mod`` terms: name -> (how many integers may follow ``=``, the smallest, its form).
_MOD_TERMS = {"causal": (0, 0, 0, "causal takes no value"), "window": (1, 2, 0, "window=L[,R] with L, R >= 0"),
              "chunked": (1, 1, 1, "chunked=C with C >= 1"), "documents": (1, 1, 1, "documents=N with N >= 1"),
              "prefix": (1, 1, 1, "prefix=P with P >= 1")}


def _mask_mod_spec(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``causal+documents=8``: jaxattn.masks constructors ANDed (``window=L[,R]``, ``chunked=C``,
    ``documents=N`` equal packed documents a row, ``prefix=P`` for every row)."""
    terms = []
    for term in text.split("+"):
        name, _, values = term.strip().partition("=")
        if name not in _MOD_TERMS:
            raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(_MOD_TERMS)} (e.g. causal+window=8)")
        low, high, least, form = _MOD_TERMS[name]
        try:
            ints = tuple(int(v) for v in values.split(",")) if values else ()
        except ValueError:
            ints = (-1,)
        if not low <= len(ints) <= high or any(n < least for n in ints):
            raise argparse.ArgumentTypeError(f"{term!r}: {form}")
        terms.append((name, ints))
    return tuple(terms)


def _mods(args: argparse.Namespace, b: int, t: int, s: int, hq: int) -> dict[str, Any]:
    """``mask_mod`` / ``score_mod`` of ``--mask-mod`` / ``--score-mod``: concrete captures, so that
    ``explain`` shows the tiles they leave (documents of equal length over the S keys)."""
    import numpy as np

    from jaxattn import masks

    def documents(n: int) -> Any:  # n equal runs over each side's positions
        return masks.document(*(np.broadcast_to(np.arange(m) * n // m, (b, m)).astype(np.int32) for m in (t, s)))

    make = {"causal": lambda n: masks.causal(), "window": lambda n: masks.sliding_window(*n),
            "chunked": lambda n: masks.chunked_causal(n[0]), "documents": lambda n: documents(n[0]),
            "prefix": lambda n: masks.prefix_lm(np.full(b, n[0], np.int32))}
    out: dict[str, Any] = {}
    if args.mask_mod:
        out["mask_mod"] = masks.and_(*(make[name](ints) for name, ints in args.mask_mod))
    if args.score_mod == "alibi":
        out["score_mod"] = masks.alibi(np.exp2(-8.0 * np.arange(1, hq + 1) / hq).astype(np.float32))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shapes = parser.add_argument_group("shapes (BTHD layout)")
    shapes.add_argument("--batch", "-b", type=positive_int, default=1, help="B (default 1)")
    shapes.add_argument("--seq-q", "-t", type=positive_int, default=1024, help="T, query length (default 1024)")
    shapes.add_argument("--seq-k", "-s", type=positive_int, help="S, key length (default: T)")
    shapes.add_argument("--heads-q", type=positive_int, default=8, help="Hq (default 8)")
    shapes.add_argument("--heads-kv", type=positive_int, help="Hkv (default: Hq); Hq %% Hkv == 0")
    shapes.add_argument("--head-dim", "-d", type=positive_int, default=128, help="D (default 128)")
    shapes.add_argument("--head-dim-v", type=positive_int, help="Dv, value head dim (default: D)")
    shapes.add_argument("--dtype", default="bfloat16", type=float_dtype,
                        help="dtype of q, k, v (default bfloat16)")

    features = parser.add_argument_group("features")
    features.add_argument("--causal", action="store_true", help="causal (aligned bottom-right)")
    features.add_argument("--window", type=nonneg_window, metavar="W|L,R", help="sliding window")
    features.add_argument("--mask", type=_pattern, nargs="?", const="b1ts", metavar="PATTERN",
                          help="boolean mask; optional broadcast pattern (default b1ts)")
    features.add_argument("--bias", type=_pattern, nargs="?", const="bhts", metavar="PATTERN",
                          help="additive bias; optional broadcast pattern (default bhts)")
    features.add_argument("--segment-ids", action="store_true", help="packed sequences")
    features.add_argument("--soft-cap", type=positive_float, metavar="C", help="logits soft cap")
    features.add_argument("--sinks", action="store_true", help="attention sinks (softmax_aux)")
    features.add_argument("--dropout", type=probability, default=0.0, metavar="P", help="dropout prob")
    features.add_argument("--mask-mod", type=_mask_mod_spec, metavar="TERM+...",
                          help="a mask_mod of jaxattn.masks terms ANDed: causal, window=L[,R], chunked=C, "
                               "documents=N (equal packed documents), prefix=P; e.g. causal+documents=8")
    features.add_argument("--score-mod", choices=("alibi",), help="a score_mod: masks.alibi, slopes 2^(-8h/Hq)")
    features.add_argument("--grad", action="store_true", help="the call is differentiated")
    features.add_argument("--kv-lengths", action="store_true",
                          help="per-sequence key lengths: k and v are a dense KV cache of capacity S")
    features.add_argument("--kv-dtype", choices=tuple(KV_DTYPE_FLAGS),
                          help="a quantized KV cache (fp8 = float8_e4m3fn) with float32 k_scale, v_scale per token")

    paged = parser.add_argument_group(
        "paged KV cache (--paged: T queries per sequence, as paged_attention; --ragged: a ragged batch of "
        "-t query rows, as ragged_paged_attention); -b is the number of sequences, -s each one's capacity")
    kinds = paged.add_mutually_exclusive_group()
    kinds.add_argument("--paged", action="store_true", help="a decode step over a paged cache")
    kinds.add_argument("--ragged", action="store_true", help="a ragged batch over a paged cache")
    paged.add_argument("--page-size", type=positive_int, default=16, help="tokens per page (default 16)")
    paged.add_argument("--combined", action="store_true", help="JAX's combined kv_pages layout")

    choice = parser.add_argument_group("choice")
    choice.add_argument("--impl", help="explicit impl name or alias (default: use_impl/"
                                       "$JAXATTN_IMPL/auto, as for jaxattn.attention)")
    choice.add_argument("--platform", choices=["cpu", "gpu", "tpu", "cuda", "rocm"],
                        help="AttentionMetadata(platform=...) override")
    choice.add_argument("--interpret", action="store_true",
                        help="AttentionMetadata(interpret=True): TPU kernels in interpret mode")
    choice.add_argument("--runtime-dtype", type=float_dtype, help="AttentionMetadata(runtime_dtype=...)")
    choice.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                        help="AttentionMetadata(extra={KEY: VALUE}), repeatable; e.g. ring_comm=all_gather")

    mesh = parser.add_argument_group(
        "sharding (a mesh's shape only: nothing runs, so this machine needs none of its devices)")
    mesh.add_argument("--mesh", type=mesh_axes, metavar="AXIS=N,...", help="mesh axes and sizes, e.g. data=2,seq=4")
    mesh.add_argument("--batch-axis", metavar="AXIS", help="AttentionMetadata(batch_axis=...)")
    mesh.add_argument("--head-axis", metavar="AXIS", help="AttentionMetadata(head_axis=...)")
    mesh.add_argument("--sequence-axis", metavar="AXIS",
                      help="AttentionMetadata(sequence_axis=...): ring attention over that axis")


def _dtype(name: str) -> Any:
    import jax.numpy as jnp

    import jaxattn

    try:
        return jnp.dtype(name)
    except TypeError as err:
        raise jaxattn.InvalidInputError("--dtype", f"unknown dtype {name!r}", "e.g. bfloat16, float16, float32") \
            from err


def metadata(args: argparse.Namespace) -> Any:
    """The ``AttentionMetadata`` the options describe (an abstract mesh with ``--mesh``)."""
    import jaxattn
    from jaxattn.sharding.compat import abstract_mesh

    extra = {}
    for item in args.extra:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise jaxattn.InvalidInputError("--extra", f"{item!r} is not KEY=VALUE",
                                            "e.g. --extra ring_comm=all_gather")
        extra[key.strip()] = value.strip()
    axes = {"batch_axis": args.batch_axis, "head_axis": args.head_axis, "sequence_axis": args.sequence_axis}
    if args.mesh is None and any(axes.values()):
        named = ", ".join(f"--{k.replace('_', '-')}" for k, v in axes.items() if v)
        raise jaxattn.InvalidInputError(named, "names a mesh axis, but no --mesh gives the axes",
                                        "add e.g. --mesh seq=4 --sequence-axis seq")
    try:
        return jaxattn.AttentionMetadata(platform=args.platform, interpret=args.interpret,
                                         runtime_dtype=args.runtime_dtype, extra=extra,
                                         mesh=None if args.mesh is None else abstract_mesh(args.mesh), **axes)
    except jaxattn.InvalidInputError as err:
        if not err.argument.endswith("_axis"):
            raise
        raise jaxattn.InvalidInputError("--mesh", str(err), "name the axes of --mesh") from None  # not one of its axes


def build_call(args: argparse.Namespace) -> tuple[tuple[Any, Any, Any], dict[str, Any]]:
    """ShapeDtypeStructs for q, k, v and the keyword arguments of ``jaxattn.explain``."""
    import jax
    import jax.numpy as jnp

    b, t, hq, d = args.batch, args.seq_q, args.heads_q, args.head_dim
    s = args.seq_k if args.seq_k is not None else t
    hkv = args.heads_kv if args.heads_kv is not None else hq
    dv = args.head_dim_v if args.head_dim_v is not None else d
    dtype = _dtype(args.dtype)
    spec = jax.ShapeDtypeStruct
    full = {"b": b, "h": hq, "t": t, "s": s}

    def broadcast(pattern: str, dt: Any) -> Any:
        return spec(tuple(full[c] if c != "1" else 1 for c in pattern), dt)

    kwargs: dict[str, Any] = {"causal": args.causal, "needs_grad": args.grad, **_shared(args, (b, s, hkv))}
    if args.mask is not None:
        kwargs["mask"] = broadcast(args.mask, jnp.bool_)
    if args.bias is not None:
        kwargs["bias"] = broadcast(args.bias, dtype)
    if args.segment_ids:
        kwargs["q_segment_ids"] = spec((b, t), jnp.int32)
        kwargs["kv_segment_ids"] = spec((b, s), jnp.int32)
    if args.kv_lengths:
        kwargs["kv_lengths"] = spec((b,), jnp.int32)
    kwargs.update(_mods(args, b, t, s, hq))
    if args.dropout:
        kwargs["dropout_prob"] = args.dropout
        kwargs["dropout_rng"] = spec((2,), jnp.uint32)  # a raw PRNG key; only its presence counts
    cache = _dtype(KV_DTYPE_FLAGS[args.kv_dtype]) if args.kv_dtype else dtype
    qkv = (spec((b, t, hq, d), dtype), spec((b, s, hkv, d), cache), spec((b, s, hkv, dv), cache))
    return qkv, kwargs


def _shared(args: argparse.Namespace, lead: tuple[int, ...]) -> dict[str, Any]:
    """The keyword arguments dense and paged calls share: metadata, impl, window, soft cap, sinks,
    and a --kv-dtype cache's scales (one per token and head: the granularity changes no choice)
    for a cache whose shape without its last axis is ``lead``."""
    import jax

    out: dict[str, Any] = {"metadata": metadata(args)}
    if args.impl is not None:
        out["impl"] = args.impl
    if args.window is not None:
        out["sliding_window"] = args.window
    if args.soft_cap is not None:
        out["logits_soft_cap"] = args.soft_cap
    if args.sinks:
        out["softmax_aux"] = jax.ShapeDtypeStruct((args.heads_q,), "float32")
    if args.kv_dtype:
        out["k_scale"] = out["v_scale"] = jax.ShapeDtypeStruct(lead, "float32")
    return out


def build_paged_call(args: argparse.Namespace) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """ShapeDtypeStructs of a paged call and the keyword arguments of ``jaxattn.explain_paged``."""
    import jax
    import jax.numpy as jnp

    b, t, hq, d = args.batch, args.seq_q, args.heads_q, args.head_dim
    hkv = args.heads_kv if args.heads_kv is not None else hq
    dv = args.head_dim_v if args.head_dim_v is not None else d
    capacity = args.seq_k if args.seq_k is not None else max(t, 1)
    per_seq = -(-capacity // args.page_size)
    spec = jax.ShapeDtypeStruct
    dtype = _dtype(args.dtype)
    pool = (b * per_seq, args.page_size)
    cache = _dtype(KV_DTYPE_FLAGS[args.kv_dtype]) if args.kv_dtype else dtype
    k_pages = v_pages = kv_pages = None
    if args.combined:
        kv_pages = spec((*pool, 2 * hkv, d), cache)
    else:
        k_pages, v_pages = spec((*pool, hkv, d), cache), spec((*pool, hkv, dv), cache)
    table, lengths = spec((b, per_seq), jnp.int32), spec((b,), jnp.int32)
    kwargs: dict[str, Any] = {"kv_pages": kv_pages, **_shared(args, (*pool, hkv))}
    if args.ragged:  # -t query rows in all, packed over the sequences
        q = spec((t, hq, d), dtype)
        kwargs.update(cu_q_lens=spec((b + 1,), jnp.int32), num_seqs=spec((1,), jnp.int32))
    else:
        q = spec((b, t, hq, d), dtype)
    return (q, k_pages, v_pages, table, lengths), kwargs


def _kinds_by_name() -> dict[str, set[str]]:
    """Every registered name and alias (and "auto") -> the op kinds it names."""
    import jaxattn

    kinds: dict[str, set[str]] = {"auto": {"dense", "paged"}}
    for row in jaxattn.list_impls():
        if not is_plugin_row(row):  # a broken or disabled plugin's row names no impl
            for name in (row.name, *row.aliases):
                kinds.setdefault(name, set()).add(row.kind)
    return kinds


def _check_impl(args: argparse.Namespace) -> None:
    """An --impl that names nothing, or only impls of the other kind: say so, not "nothing can run"."""
    import jaxattn

    kinds = _kinds_by_name()
    name = args.impl.strip().lower()
    if name not in kinds:
        raise jaxattn.ImplNotFoundError(
            f"no attention impl is named {args.impl!r}; installed: {', '.join(sorted(kinds))}")
    kind = "paged" if args.paged or args.ragged else "dense"
    if kind not in kinds[name]:
        other = "/".join(sorted(kinds[name]))
        raise jaxattn.InvalidInputError(
            "--impl", f"{args.impl!r} is a {other} impl and this is a {kind} call",
            "add --paged (a decode step over a paged KV cache) or --ragged to explain its calls, as "
            "paged_attention / ragged_paged_attention make them" if kind == "dense"
            else "drop --paged / --ragged to explain a dense call, as attention makes it")


def run(args: argparse.Namespace) -> int:
    import jaxattn

    if args.impl is not None:
        _check_impl(args)
    if args.paged or args.ragged:
        unused = [flag for flag, on in (("--causal", args.causal), ("--mask", args.mask), ("--bias", args.bias),
                                        ("--segment-ids", args.segment_ids), ("--dropout", args.dropout),
                                        ("--grad", args.grad), ("--kv-lengths", args.kv_lengths)) if on]
        if unused:
            raise jaxattn.InvalidInputError(", ".join(unused), "does not apply to paged calls (always causal per "
                                            "sequence, forward-only, lengths in the call)")
        if args.mask_mod or args.score_mod:
            raise jaxattn.InvalidInputError("--mask-mod, --score-mod", "describe dense calls only",
                                            "a ragged call's mask_mod (seq, h, q_pos, kv_pos) is passed to "
                                            "ragged_paged_attention(mask_mod=) in Python (docs/masks.md)")
        arrays, kwargs = build_paged_call(args)
        explanation = jaxattn.explain_paged(*arrays, **kwargs)
    else:
        (q, k, v), kwargs = build_call(args)
        explanation = jaxattn.explain(q, k, v, **kwargs)
    if args.json:
        dump_json(explanation.to_dict())
    else:
        render(explanation, Printer.from_args(args))
    # Scripts can test the exit status: 0 when something runs the call, 1 when nothing does.
    return 0 if explanation.chosen else 1


def _nothing(explanation: Any) -> str:
    """What "runs" says when nothing does: a named impl that declines is not "nothing can run"."""
    if explanation.requested == "auto":
        return "nothing can run this call"
    others = [c.name for c in explanation.candidates if c.here and c.accepted]
    return (f"{explanation.requested} cannot run this call (" + (f"these can: {', '.join(others)}; or --impl auto)"
            if others else "nor can any other installed impl)"))


def render(explanation: Any, out: Printer) -> None:
    out.pairs([
        ("device", explanation.device),
        ("call", explanation.problem.describe()),
        ("requested", explanation.requested),
        ("runs", explanation.chosen or _nothing(explanation)),
        *[("differentiated", c.grad_impl) for c in explanation.candidates if c.chosen and c.grad_impl],
    ])
    out.line()
    table = Table("Implementations, best first", ["", "impl", "status", "priority", "from", "reasons"])
    for c in explanation.candidates:
        # Why it holds its place: declared priority, or a measurement from the tuning cache.
        # How the chosen one runs it (its layout, kernel, backward: impl.notes) follows.
        notes = ([c.rank_reason] if c.rank_reason else []) + list(c.reasons) + (list(c.notes) if c.chosen else [])
        if c.fallback and not c.reasons:
            notes += [f"falls back on {c.fallback_impl}: {r}" for r in c.fallback]
        table.add("*" if c.chosen else "", c.name, c.status, c.priority, c.origin,
                  "\n".join(notes) or None)
    out.table(table)
