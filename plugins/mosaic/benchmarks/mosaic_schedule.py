"""How evenly a causal persistent launch spreads its work over the SMs: the snake of a head's
tiles against ``Config.scheduled``'s schedule, on any host (no GPU; the kernel module only lowers).

    python3 plugins/mosaic/benchmarks/mosaic_schedule.py [--sms 132]

For each causal shape of the matrix below 16k keys (the default tiles), the busiest CTA's key
blocks over the mean (each tile costing its blocks plus one), under the snake the persistent
kernel used before and under the schedule (``kernel.tile_schedule``, what the kernel runs). Then the
schedule, made with that cost model, counted under others: no cost per tile, three blocks per tile,
and the diagonal block at twice the cost. A launch ends with its busiest CTA, so the spread
is what balance costs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "plugins" / "mosaic" / "src"))

from jaxattn_mosaic.kernel import SCHEDULE_TILE_COST, default_config, schedule_work, tile_schedule

#: (B, S, Hq, D): the causal rows of mosaic_bench.py and of the tuned matrix below 16k keys.
SHAPES = [(4, 4096, 32, 128), (2, 8192, 16, 128), (1, 8192, 32, 128), (4, 2048, 32, 128), (8, 1024, 32, 128),
          (16, 1024, 32, 128), (4, 4096, 32, 64), (2, 8192, 16, 64), (16, 1024, 32, 64)]  # fmt: skip


def spread(work: list[float]) -> float:
    """The busiest CTA's work over the mean, less 1."""
    return max(work) / (sum(work) / len(work)) - 1


def snake_work(costs: tuple[int, ...], pairs: int, n_ctas: int, per_tile: float) -> list[float]:
    """Each CTA's work under the snake of a head's tiles together: CTA ``c`` takes the ``c``-th
    tile of even rounds and the ``c``-th from the end of odd ones (heaviest tile of a head first)."""
    n_q = len(costs)
    work = [0.0] * n_ctas
    for t in range(pairs * n_q):
        r, c = divmod(t, n_ctas)
        work[c if r % 2 == 0 else n_ctas - 1 - c] += costs[t % n_q] + per_tile
    return work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132, help="CTAs of the persistent launch (an H100 SXM's SMs)")
    a = ap.parse_args()
    # The cost of a tile beside its blocks: the schedule's own (SCHEDULE_TILE_COST), then others.
    models = {"model": SCHEDULE_TILE_COST, "no cost a tile": 0, "3 a tile": 3, "diagonal x2": SCHEDULE_TILE_COST + 1}
    print(f"causal, {a.sms} CTAs: the busiest CTA's key blocks over the mean (a tile: its blocks + 1)")
    print("| B, S, Hq, D | tiles a head | heads a group | snake | schedule | " + " | ".join(list(models)[1:]) + " |")
    print("|---" * (4 + len(models)) + "|")
    for b, s, hq, d in SHAPES:
        cfg = default_config(d, causal=True, kv_len=s)
        scheduled = tile_schedule(cfg, batch=b, heads=hq, t_len=s, s_len=s, causal=True, sms=a.sms)
        if scheduled is None:
            continue
        schedule, costs = scheduled
        n_q = len(costs)
        cells = [f"{100 * spread(snake_work(costs, b * hq, schedule.shape[0], SCHEDULE_TILE_COST)):.1f}%"]
        # A diagonal block at twice the cost is one more block a tile (every tile has one).
        cells += [f"{100 * spread(schedule_work(schedule, costs, per_tile)):.2f}%" for per_tile in models.values()]
        print(f"| {b}, {s}, {hq}, {d} | {n_q} | {max(1, round(schedule.shape[0] / n_q))} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
