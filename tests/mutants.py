"""Deliberate bugs the test suite must catch: ``python tests/mutants.py`` (from the repository root).

Each mutant is one textual edit of a backend's source (a causal mask off by one, NaN read from
an unread page, a query head mapped to the wrong KV head, a soft cap dropped, the scale applied
twice). For each, this script applies the edit, runs the few tests of the suite that must fail
on it (``-x``, one process), reports ``caught`` or ``MISSED``, and restores the file, whatever
happens (Ctrl-C included). It exits 1 if any mutant was missed or could not be applied. Not
part of the default run (pytest does not collect this file); run it after changing the
conformance suite, the oracle or the test layout, to check the suite still bites::

    python tests/mutants.py                 # every mutant
    python tests/mutants.py soft_cap_dropped gqa_head_triton   # some, by name
    python tests/mutants.py --list

The tests run with this interpreter (activate the project's venv first, or use
``.venv/bin/python tests/mutants.py``); the Triton mutants need torch and triton (skipped with
a note otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VANILLA = "plugins/vanilla/src/jaxattn_vanilla/vanilla/reference.py"
PAGED = "plugins/vanilla/src/jaxattn_vanilla/paged/reference.py"
TRITON_FORWARD = "plugins/triton/src/jaxattn_triton/flash/forward.py"
DENSE = "tests/vanilla/test_conformance.py::TestVanillaConformance"
PAGED_SUITE = "tests/vanilla/test_paged_conformance.py::TestVanillaPaged"
TRITON_SUITE = "tests/triton/test_conformance.py::TestTritonFlashInterpreted"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids; at least one must fail
    needs: tuple[str, ...] = ()  # modules the tests need

    def describe(self) -> str:
        return f"{self.path}: {self.old.strip()!r} -> {self.new.strip()!r}"


MUTANTS = (
    Mutant("causal_off_by_one", VANILLA,
           "visible = _and(visible, j <= aligned)", "visible = _and(visible, j < aligned)",
           (f"{DENSE}::test_forward[causal-float32]", f"{DENSE}::test_forward[decode-float32]")),
    Mutant("unread_page_not_selected", PAGED,
           "k, v = k_seq[sr], jnp.where(live[:, None, None], v_seq[sr], jnp.zeros((), v_seq.dtype))",
           "k, v = k_seq[sr], v_seq[sr]",
           (f"{PAGED_SUITE}::test_unread_positions[decode-float32]",
            f"{PAGED_SUITE}::test_unread_positions[ragged_mixed-float32]")),
    Mutant("gqa_head_paged", PAGED,
           'jnp.einsum("kgd,skd->kgs", qr.reshape(hkv, groups, d), k,',
           'jnp.einsum("kgd,skd->kgs", qr.reshape(groups, hkv, d).swapaxes(0, 1), k,',  # head h reads KV h % Hkv
           (f"{PAGED_SUITE}::test_forward[ragged_mixed-float32]", f"{PAGED_SUITE}::test_forward[sinks-float32]")),
    Mutant("gqa_head_triton", TRITON_FORWARD,
           "hkv64 = (h // GROUP).to(tl.int64)", "hkv64 = (h % (HQ // GROUP)).to(tl.int64)",
           (f"{TRITON_SUITE}::test_forward[gqa-float32]", f"{TRITON_SUITE}::test_forward[mqa_causal-float32]"),
           needs=("torch", "triton")),
    Mutant("soft_cap_dropped", VANILLA,
           "logits = cap * jnp.tanh(logits / cap)", "logits = logits + 0 * cap",
           (f"{DENSE}::test_forward[soft_cap-float32]",)),
    Mutant("scale_twice", PAGED,
           "logits = logits * jnp.asarray(scale, sdtype)\n",
           "logits = logits * jnp.asarray(scale, sdtype) * jnp.asarray(scale, sdtype)\n",
           (f"{PAGED_SUITE}::test_forward[ragged_mixed-float32]",)),  # ragged: uniform calls take vanilla's path
    Mutant("scale_twice_with_bias", VANILLA,
           "factor = jnp.asarray(scale if unscaled else 1.0, sdtype)", "factor = jnp.asarray(scale, sdtype)",
           (f"{DENSE}::test_forward[bias-float32]",)),
)


def run_mutant(mutant: Mutant, verbose: bool) -> str:
    """``caught``, ``MISSED``, or why it could not be judged; the file is restored in any case."""
    missing = [m for m in mutant.needs if importlib.util.find_spec(m) is None]
    if missing:
        return f"skipped (needs {', '.join(missing)})"
    path = ROOT / mutant.path
    original = path.read_text()
    if original.count(mutant.old) != 1:
        return f"NOT APPLIED: {mutant.old.strip()!r} occurs {original.count(mutant.old)} times in {mutant.path}"
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", *mutant.tests]
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    finally:
        path.write_text(original)
    if verbose:
        print(done.stdout[-3000:] + done.stderr[-2000:])
    if done.returncode == 1:  # tests ran and failed
        return "caught"
    if done.returncode == 0:
        return "MISSED"
    return f"ERROR (pytest exit code {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and the tests that must catch them")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each pytest run's output")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutants {unknown}; known: {', '.join(by_name)}")
    chosen = [by_name[n] for n in args.names] or list(MUTANTS)
    if args.list:
        for m in chosen:
            print(f"{m.name}\n  {m.describe()}\n  " + "\n  ".join(m.tests))
        return 0
    failures = 0
    for m in chosen:
        start = time.monotonic()
        verdict = run_mutant(m, args.verbose)
        failures += not verdict.startswith(("caught", "skipped"))
        print(f"{m.name:28s} {verdict}  ({time.monotonic() - start:.0f} s)", flush=True)
    print(f"{len(chosen) - failures} of {len(chosen)} mutants caught or skipped", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
