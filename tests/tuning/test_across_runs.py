"""The same cache gives the same pick in every process (real plugins, fresh interpreters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jaxattn
from jaxattn.selection.tuning import Measurement
from jaxattn_bench.store import TuningStore

pytestmark = pytest.mark.slow

PROBE = """
import json, jax, jax.numpy as jnp, jaxattn
x = jax.ShapeDtypeStruct((2, 100, 4, 16), jnp.float32)
exp = jaxattn.explain(x, x, x, causal=True)
print(json.dumps({"chosen": exp.chosen, "ranked": [c.name for c in exp.candidates if c.accepted]}))
"""


def probe(cache_dir: Path) -> dict[str, object]:
    env = {**os.environ, "JAXATTN_CACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_pick_is_the_same_in_every_process(cache_dir: Path) -> None:
    x = jax.ShapeDtypeStruct((2, 100, 4, 16), jnp.float32)
    accepted = [c.name for c in jaxattn.explain(x, x, x, causal=True).candidates if c.accepted]
    if len(accepted) < 2:
        pytest.skip("needs two installed backends that run this call (jaxattn[cpu]: vanilla and sdpa)")
    declared_first, slower = accepted[:2]  # no measurements yet: declared order
    here = {i.name: i for i in jaxattn.list_impls() if i.usable_here}
    problem = jaxattn.AttentionProblem.from_inputs(x, x, x, causal=True)
    cache = TuningStore.load()
    # measured: the declared-second backend is the faster one
    cache.record(problem, [
        Measurement(slower, here[slower].distribution, here[slower].version, fwd_ms=1.0, fwdbwd_ms=3.0),
        Measurement(declared_first, here[declared_first].distribution, here[declared_first].version,
                    fwd_ms=2.0, fwdbwd_ms=6.0),
    ])
    cache.save()
    first, second = probe(cache_dir), probe(cache_dir)
    assert first == second
    assert first["chosen"] == slower
    (cache_dir / "tuning.json").write_text("{broken")
    broken = probe(cache_dir)  # a corrupt cache: declared order again, no error
    assert broken["chosen"] == declared_first
