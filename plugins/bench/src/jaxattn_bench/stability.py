"""Whether a set of timings is fit to store: the noise check ``jaxattn tune`` applies per shape.

A busy machine (a shared CPU, another process on the GPU) slows whatever runs while it is
busy. One slowed stretch made ``jaxattn tune`` store ``sdpa`` forward at 0.818 ms against
about 0.2 ms for its peers, and auto's pick flipped. ``tune`` therefore times the candidates
in several interleaved rounds (a b c, c b a, ...) and stores a shape's timings only when

- every candidate's **spread** is small: its per-round medians lie within
  :data:`MAX_SPREAD` of each other (``max / min - 1``), so no round was slowed much more
  than the others; and
- the **ranking holds in every round**: two candidates whose medians differ by more than
  their noise (the larger spread of the two, and at least the refiner's tie tolerance) are
  ordered the same way in each round. Candidates closer than that are a tie within noise,
  and their order in one round proves nothing.

Otherwise nothing is written for that shape and the reasons say why (run ``tune`` again on
a quieter machine, or with more ``--rounds``). Standard library only.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from jaxattn.backend import TIE_TOLERANCE

__all__ = ["MAX_SPREAD", "MIN_ROUNDS", "spread", "unstable_reasons"]

#: Largest accepted ``max / min - 1`` of one candidate's per-round medians. On an idle CPU
#: rounds agree within a few percent; a round slowed by other work shows as tens of percent.
MAX_SPREAD = 0.25

#: Fewest rounds that can show a ranking holds (one round cannot disagree with itself).
MIN_ROUNDS = 2


def spread(round_medians: Sequence[float]) -> float:
    """``max / min - 1`` of per-round medians (0 for a single round)."""
    low = min(round_medians)
    return max(round_medians) / low - 1 if low > 0 else float("inf")


def unstable_reasons(rounds: Mapping[str, Sequence[Sequence[float]]], *, max_spread: float = MAX_SPREAD,
                     tie_tolerance: float = TIE_TOLERANCE) -> list[str]:
    """Why the candidates' timings should not be stored; ``[]`` when they may be.

    ``rounds`` maps a candidate's name to its samples (ms), one list per round, rounds in the
    same order for every candidate. Rounds without samples are left out.
    """
    medians = {name: [statistics.median(r) for r in per_round if r] for name, per_round in rounds.items()}
    medians = {name: m for name, m in medians.items() if m}
    if not medians:
        return []
    count = min(len(m) for m in medians.values())
    if count < MIN_ROUNDS:
        return [f"{count} round: at least {MIN_ROUNDS} are needed to tell a ranking from noise (--rounds)"]
    reasons = []
    spreads = {name: spread(m) for name, m in medians.items()}
    for name, s in sorted(spreads.items()):
        if s > max_spread:
            m = medians[name]
            reasons.append(f"{name}: round medians {min(m):.3g}-{max(m):.3g} ms differ by {s:.0%} "
                           f"(more than {max_spread:.0%})")
    overall = {name: statistics.median(sample for r in rounds[name] for sample in r) for name in medians}
    names = sorted(medians, key=lambda n: (overall[n], n))
    for i, fast in enumerate(names):
        for slow in names[i + 1:]:
            noise = max(tie_tolerance, spreads[fast], spreads[slow])
            if overall[slow] <= overall[fast] * (1 + noise):
                continue  # a tie within noise: their order in one round means nothing
            flipped = [k + 1 for k in range(count) if medians[slow][k] < medians[fast][k]]
            if flipped:
                reasons.append(f"{slow} beat {fast} in round {', '.join(map(str, flipped))} of {count}, though "
                               f"{overall[slow] / overall[fast]:.2f}x slower overall")
    return reasons
