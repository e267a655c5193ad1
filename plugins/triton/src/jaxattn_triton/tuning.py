"""Tile sizes, warps and pipeline stages per device and shape.

``tiles_for`` answers in this order: explicit overrides (``AttentionMetadata.block_*``,
``num_warps``, ``num_stages``), a tuning result for this device and shape class, then a
table of defaults measured on Hopper (see the plugin README for the figures). ``tune`` times
candidate configurations on the current GPU and stores the winner, so the measurement is paid
once per device and shape class, not once per process.

Tuning results live in jaxattn's one tuning cache, in this plugin's object (``SECTION``) of
the environment's section: read through ``jaxattn.selection.tuning.plugin_section``, written
through jaxattn-bench's ``TuningStore`` (storing is measuring: ``tune`` needs jaxattn-bench).

Nothing here imports triton or jax at module level.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import Any

from jaxattn_triton.flash.launch import DQ_ATOMIC, DQ_KERNEL, KernelTiles, Tiles
from jaxattn_triton.spec import AttnSpec, block_dim

#: This plugin's object in each section of jaxattn's tuning cache: ``{device kind|shape class: tiles}``.
SECTION = "jaxattn-triton"

_lock = threading.Lock()
_memory: dict[str, Tiles] = {}


def _pow2_at_most(n: int, cap: int) -> int:
    """The largest tile <= cap that does not exceed the sequence by more than one power of two."""
    tile = cap
    while tile > 16 and tile // 2 >= n:
        tile //= 2
    return tile


def _fit(t: KernelTiles, seq_m: int, seq_n: int) -> KernelTiles:
    return dataclasses.replace(t, block_m=_pow2_at_most(seq_m, t.block_m), block_n=_pow2_at_most(seq_n, t.block_n))


def default_tiles(spec: AttnSpec, compute_capability: str | None) -> Tiles:
    """Defaults by head dim and features, measured on an H200 (sm_90); conservative elsewhere.

    Masks and biases are tiles of their own that the pipeline stages in shared memory too,
    so those calls get fewer stages and narrower key tiles to stay within 227 KB.
    """
    d = max(block_dim(spec.head_dim), block_dim(spec.head_dim_v))
    hopper = compute_capability is not None and compute_capability.startswith("9")
    dense_extra = spec.mask_shape is not None or spec.bias_shape is not None
    # Figures: H200, bf16, B = 4, S = 4k, H = 32 (16 at D = 256), full / causal, one
    # launch each (plugins/triton/benchmarks/triton_gpu_check.py --tune).
    dq_mode, split = DQ_KERNEL, False
    if hopper and d <= 64:
        # 128-row query tiles: 1.44 / 0.77 ms against 1.66 / 1.01 ms with 256 rows at D = 64.
        fwd = KernelTiles(128, 64, 8, 3)
        dkdv = KernelTiles(64, 128, 8, 3)
        # The atomic dQ loses here: 4.73 / 2.58 ms against 3.05 + 1.42 / 1.73 + 0.81 ms.
        dq = KernelTiles(128, 64, 8, 3)
    elif hopper and d <= 128:
        # 256-row query tiles (two warpgroups of 128 rows): 2.26 / 1.33 ms against
        # 2.32 / 1.36 ms for 128 x 128; a sliding window wastes less with 128 rows.
        fwd = KernelTiles(128, 64, 8, 3) if spec.window_left is not None else KernelTiles(256, 64, 8, 3)
        dkdv = KernelTiles(64, 128, 8, 3)
        dq = KernelTiles(128, 64, 8, 3)
        # dQ by atomic adds from the dK/dV kernel (five products instead of seven):
        # 7.26 / 3.97 ms against 4.86 + 2.85 / 2.64 + 1.53 ms for the two kernels.
        # Dense masks and biases narrow the tiles, where that was not measured.
        dq_mode = DQ_KERNEL if dense_extra else DQ_ATOMIC
    elif hopper:
        fwd = KernelTiles(128, 64, 8, 2)
        # dK/dV in one kernel spill at D = 256 (registers: 2 x 64 x 256 float32
        # accumulators); dV and dK in two launches of 128 keys x 32 queries do not:
        # 9.22 / 4.39 ms against 9.63 / 4.83 ms for the best single kernel (64 x 64).
        dkdv = KernelTiles(32, 128, 8, 2) if not dense_extra else KernelTiles(64, 64, 8, 2)
        split = not dense_extra
        # 3.04 / 1.71 ms against 6.22 / 3.32 ms for (64, 64, 8, 2).
        dq = KernelTiles(128, 32, 8, 3)
    elif d <= 128:
        fwd = KernelTiles(128, 64, 4, 3)
        dkdv = KernelTiles(64, 64, 4, 2)
        dq = KernelTiles(64, 64, 4, 2)
    else:
        fwd = KernelTiles(64, 32, 4, 2)
        dkdv = KernelTiles(32, 32, 4, 1)
        dq = KernelTiles(32, 32, 4, 1)
    if dense_extra:
        fwd, dkdv, dq = (
            KernelTiles(t.block_m, min(t.block_n, 64), t.num_warps, min(t.num_stages, 2)) for t in (fwd, dkdv, dq)
        )
    return Tiles(
        fwd=_fit(fwd, spec.seq_q, spec.seq_k),
        dkdv=_fit(dkdv, spec.seq_q, spec.seq_k),
        dq=_fit(dq, spec.seq_q, spec.seq_k),
        dq_mode=dq_mode,
        dkdv_split=split,
    )


# The interpreter's cost is per tile operation, so larger tiles are faster there; a long
# sequence gets tiles as large as keep it within INTERPRET_MAX_TILES of them (still many
# tiles and a partial last one: every boundary the kernels handle).
INTERPRET_TILES = KernelTiles(32, 32, 4, 1)
INTERPRET_MAX_TILES = 16


def _interpret_tile(n: int) -> int:
    tile = INTERPRET_TILES.block_m
    while -(-n // tile) > INTERPRET_MAX_TILES:
        tile *= 2
    return tile


def shape_class(spec: AttnSpec) -> str:
    """What a tuning result is valid for: tile choice depends on these, not on exact sizes."""

    def bucket(n: int) -> int:
        return 1 << max(0, (n - 1).bit_length())

    feats = [
        name
        for name, on in (
            ("causal", spec.window_right is not None),
            ("window", spec.window_left is not None),
            ("mask", spec.mask_shape is not None),
            ("bias", spec.bias_shape is not None),
            ("seg", spec.segments),
            ("mod", spec.mod_shape is not None),
            ("alibi", spec.alibi),
            ("cap", spec.softcap is not None),
        )
        if on
    ]
    return (
        f"{spec.dtype}-d{block_dim(spec.head_dim)}-dv{block_dim(spec.head_dim_v)}"
        f"-g{spec.group}-t{bucket(spec.seq_q)}-s{bucket(spec.seq_k)}-{'+'.join(feats) or 'plain'}"
    )


def _key(device_kind: str, spec: AttnSpec) -> str:
    return f"{device_kind}|{shape_class(spec)}"


def _tiles_to_json(t: Tiles) -> dict[str, list[int]]:
    out = {k: list(dataclasses.astuple(getattr(t, k))) for k in ("fwd", "dkdv", "dq")}
    out["dq_mode"] = [t.dq_mode]
    out["dkdv_split"] = [int(t.dkdv_split)]
    return out


def _tiles_from_json(d: Any) -> Tiles:
    mode = d.get("dq_mode", [DQ_KERNEL])[0]
    if mode not in (DQ_KERNEL, DQ_ATOMIC):
        raise KeyError(mode)
    split = bool(d.get("dkdv_split", [0])[0])
    return Tiles(KernelTiles(*d["fwd"]), KernelTiles(*d["dkdv"]), KernelTiles(*d["dq"]), dq_mode=mode, dkdv_split=split)


def load_cached(device_kind: str, spec: AttnSpec) -> Tiles | None:
    """The tiles ``tune`` stored for this device kind and shape class, or None."""
    from jaxattn.backend import plugin_section

    key = _key(device_kind, spec)
    with _lock:
        if key in _memory:
            return _memory[key]
        entry = plugin_section(SECTION).get(key)  # the core checked the file; the entry is ours to check
        if entry is None:
            return None
        try:
            tiles = _tiles_from_json(entry)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None  # written by an older layout: ignore, the next tune rewrites it
        _memory[key] = tiles
        return tiles


def store(device_kind: str, spec: AttnSpec, tiles: Tiles) -> None:
    """Keep ``tiles`` for this device kind and shape class in jaxattn's tuning cache (atomic write)."""
    try:
        from jaxattn_bench.store import TuningStore
    except ImportError as err:
        raise ImportError("storing tuned tiles writes jaxattn's tuning cache, which jaxattn-bench does: "
                          "pip install jaxattn-bench (or jaxattn[bench])") from err
    key = _key(device_kind, spec)
    with _lock:
        _memory[key] = tiles
        cache = TuningStore.load()
        cache.update_plugin(SECTION, {key: _tiles_to_json(tiles)})
        cache.save()


def _device() -> tuple[str, str | None]:
    import jax

    dev = jax.devices()[0]
    return str(getattr(dev, "device_kind", dev.platform)), getattr(dev, "compute_capability", None)


def tiles_for(
    spec: AttnSpec,
    *,
    interpret: bool = False,
    overrides: dict[str, int] | None = None,
    device: tuple[str, str | None] | None = None,
) -> Tiles:
    """The tiles to launch ``spec`` with (see the module docstring for the order)."""
    if interpret:
        tiles = dataclasses.replace(INTERPRET_TILES, block_m=_interpret_tile(spec.seq_q),
                                    block_n=_interpret_tile(spec.seq_k))
        base = Tiles(*(_fit(tiles, spec.seq_q, spec.seq_k),) * 3)
    else:
        kind, cc = device if device is not None else _device()
        base = load_cached(kind, spec) or default_tiles(spec, cc)
    return apply_overrides(base, overrides or {})


def apply_overrides(tiles: Tiles, o: dict[str, int]) -> Tiles:
    """``block_q``/``block_k`` set the forward tiles, ``*_bwd`` both backward kernels'."""

    def patch(t: KernelTiles, bm: str, bn: str) -> KernelTiles:
        return dataclasses.replace(
            t,
            block_m=o.get(bm, t.block_m),
            block_n=o.get(bn, t.block_n),
            num_warps=o.get("num_warps", t.num_warps),
            num_stages=o.get("num_stages", t.num_stages),
        )

    return Tiles(
        patch(tiles.fwd, "block_q", "block_k"),
        patch(tiles.dkdv, "block_q_bwd", "block_k_bwd"),
        patch(tiles.dq, "block_q_bwd", "block_k_bwd"),
        dq_mode=tiles.dq_mode,
        dkdv_split=tiles.dkdv_split,
    )


def candidates(spec: AttnSpec) -> dict[str, list[KernelTiles]]:
    """Per-kernel candidates the tuner times (each kernel is tuned independently).

    ``dkdv_atomic`` are dK/dV tiles for the backward that sums dQ with atomic adds
    (``DQ_ATOMIC``, no dQ kernel); ``dkdv_split`` are tiles for dV and dK in two launches
    (``Tiles.dkdv_split``). Lists are short on purpose: each candidate is a compilation,
    and configurations whose registers spill in the sm_90 build
    (``cuobjdump --dump-resource-usage``) are left out.
    """
    d = max(block_dim(spec.head_dim), block_dim(spec.head_dim_v))
    if d <= 128:
        fwd = [(256, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 3)]
        dkdv = [(64, 128, 8, 3), (64, 128, 8, 2)]
        dq = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3)]
        atomic = [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3)]
        split: list[tuple[int, int, int, int]] = []
    else:
        fwd = [(128, 64, 8, 2), (128, 32, 8, 3)]
        dkdv = [(64, 64, 8, 2), (32, 64, 8, 3)]
        dq = [(128, 32, 8, 3), (64, 64, 8, 2), (128, 32, 8, 2)]
        atomic = [(32, 64, 8, 3)]
        split = SPLIT_CANDIDATES_D256
    return {
        name: list(dict.fromkeys(_fit(KernelTiles(*c), spec.seq_q, spec.seq_k) for c in cs))
        for name, cs in (("fwd", fwd), ("dkdv", dkdv), ("dq", dq), ("dkdv_atomic", atomic), ("dkdv_split", split))
    }


SPLIT_CANDIDATES_D256 = [(64, 64, 8, 2), (32, 128, 8, 2), (32, 64, 8, 3)]


def tune(
    spec: AttnSpec,
    measure: Callable[[Tiles, str], float],
    *,
    device_kind: str | None = None,
    log: Callable[[str], Any] | None = None,
) -> Tiles:
    """Time each kernel's candidates and cache the fastest.

    ``measure(tiles, kernel)`` returns the seconds of one launch of ``kernel`` (``fwd``,
    ``dkdv`` or ``dq``) with those tiles; for ``dkdv_atomic`` (``tiles.dq_mode`` is
    ``DQ_ATOMIC``) the seconds of that whole backward but the preprocess, and for
    ``dkdv_split`` (``tiles.dkdv_split``) of its two dK/dV launches. It raises when a
    configuration does not build or launch (too much shared memory, say); such
    candidates are skipped. The backward kept is the fastest of: best ``dkdv`` or
    ``dkdv_split``, plus best ``dq``; or best ``dkdv_atomic``. On a GPU,
    ``lambda t, n: bench_util.measure_kernels(spec, t, (n,))[n]`` is the measure.
    """
    kind = device_kind if device_kind is not None else _device()[0]
    start = load_cached(kind, spec) or default_tiles(spec, _device()[1])
    best = dataclasses.replace(start, dq_mode=DQ_KERNEL, dkdv_split=False)
    fastest: dict[str, tuple[float, KernelTiles]] = {}
    for name, cands in candidates(spec).items():
        slot = "dkdv" if name.startswith("dkdv") else name
        mode = DQ_ATOMIC if name == "dkdv_atomic" else DQ_KERNEL
        split = name == "dkdv_split"
        if name == "dkdv_atomic":
            current = start.dkdv if start.dq_mode == DQ_ATOMIC else None
        elif name == "dkdv_split":
            current = start.dkdv if start.dkdv_split else None
        elif name == "dkdv":
            current = start.dkdv if start.dq_mode == DQ_KERNEL and not start.dkdv_split else None
        else:
            current = getattr(start, name)
        timings: list[tuple[float, KernelTiles]] = []
        for cand in _with_current(cands, current):
            trial = dataclasses.replace(_with_tile(best, slot, cand), dq_mode=mode, dkdv_split=split)
            try:
                seconds = measure(trial, name)
            except Exception as err:  # a config that fails to build is not a winner
                if log:
                    log(f"{name} {cand}: failed ({type(err).__name__}: {err})")
                continue
            timings.append((seconds, cand))
            if log:
                log(f"{name} {cand}: {seconds * 1e3:.3f} ms")
        if timings:
            fastest[name] = min(timings, key=lambda x: x[0])
            if name in ("fwd", "dkdv", "dq"):
                best = _with_tile(best, name, fastest[name][1])
    inf = (float("inf"), best.dkdv)
    plain, split_t = fastest.get("dkdv", inf), fastest.get("dkdv_split", inf)
    if split_t[0] < plain[0]:
        best = dataclasses.replace(best, dkdv=split_t[1], dkdv_split=True)
    separate = min(plain[0], split_t[0]) + fastest.get("dq", inf)[0]
    if fastest.get("dkdv_atomic", inf)[0] < separate:
        best = dataclasses.replace(best, dkdv=fastest["dkdv_atomic"][1], dq_mode=DQ_ATOMIC, dkdv_split=False)
    if log:
        log(f"backward: {best}")
    store(kind, spec, best)
    return best


def _with_tile(tiles: Tiles, slot: str, tile: KernelTiles) -> Tiles:
    if slot == "fwd":
        return dataclasses.replace(tiles, fwd=tile)
    if slot == "dkdv":
        return dataclasses.replace(tiles, dkdv=tile)
    return dataclasses.replace(tiles, dq=tile)


def _with_current(cands: Iterable[KernelTiles], current: KernelTiles | None) -> list[KernelTiles]:
    return list(dict.fromkeys([current, *cands] if current is not None else cands))
