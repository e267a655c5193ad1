"""Check an installed jaxattn from the outside, as a user would meet it.

    python smoke_install.py cpu      # after: pip install "jaxattn[cpu]" (see TARGETS)

Run by ``nox -s isolated-*`` and the packaging tests inside a fresh environment that got
jaxattn from wheels. It checks that jaxattn comes from site-packages (not a checkout), that
discovery and listing import no kernel library, that exactly the expected plugin
distributions provide implementations, that the expected names resolve, that all are
healthy, that each one that accepts a plain call here matches the float64 oracle, and that with no
backend installed a call fails with an error that says what to install. Prints one line
per check; exits non-zero on the first failure.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

# What each install target must bring: (requirement, distributions that provide impls,
# names or aliases that must exist). The nox isolated-* sessions are generated from this.
TARGETS: dict[str, tuple[str, frozenset[str], frozenset[str]]] = {
    "core": ("jaxattn", frozenset(), frozenset()),
    "cpu": ("jaxattn[cpu]", frozenset({"jaxattn-vanilla", "jaxattn-sdpa"}),
            frozenset({"vanilla", "sdpa", "cudnn", "cuda_flash_attn2"})),
    "gpu": ("jaxattn[gpu]", frozenset({"jaxattn-vanilla", "jaxattn-sdpa", "jaxattn-triton", "jaxattn-mosaic"}),
            frozenset({"vanilla", "sdpa", "cudnn", "flash_attn2", "mosaic_flash"})),
    "tpu": ("jaxattn[tpu]", frozenset({"jaxattn-vanilla", "jaxattn-pallas", "jaxattn-splash"}),
            frozenset({"vanilla", "flash_attn2", "splash", "blocksparse"})),
    "ring": ("jaxattn[ring]", frozenset({"jaxattn-vanilla", "jaxattn-ring"}), frozenset({"vanilla", "ring"})),
    "vanilla": ("jaxattn-vanilla", frozenset({"jaxattn-vanilla"}), frozenset({"vanilla"})),
}

# Distributions a target brings besides the backends: the accelerator extras bring jaxattn-bench,
# whose plugin adds commands to the `jaxattn` program and no impl.
TOOLS: dict[str, frozenset[str]] = {target: frozenset({"jaxattn-bench"}) for target in ("cpu", "gpu", "tpu")}
BENCH_COMMANDS = frozenset({"bench", "tune", "demo"})

# Modules that only a kernel build may import (never discovery or listing).
KERNEL_MODULES = ("triton", "jax_triton", "torch", "jax.experimental.pallas")


def _kernel_modules_loaded() -> list[str]:
    return sorted(m for m in sys.modules if any(m == k or m.startswith(k + ".") for k in KERNEL_MODULES))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", choices=sorted(TARGETS), help="what was installed")
    args = parser.parse_args()
    _, dists, expected = TARGETS[args.target]

    preloaded = _kernel_modules_loaded()
    import jaxattn

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(jaxattn.__file__).resolve()
    assert where.is_relative_to(site), f"jaxattn imported from {where}, not from {site}"
    print(f"ok: jaxattn {jaxattn.__version__} imported from {where.parent}")

    rows = jaxattn.list_impls()
    loaded = sorted(set(_kernel_modules_loaded()) - set(preloaded))
    assert not loaded, f"discovery and listing imported kernel libraries: {loaded}"
    print("ok: discovery and listing imported no kernel library")

    unhealthy = [f"{r.name}: {r.status} {r.reason}" for r in rows if r.status != "ok"]
    assert not unhealthy, f"unhealthy plugins or impls: {unhealthy}"
    providers = {r.distribution for r in rows}
    assert providers == dists, f"impls come from {sorted(map(str, providers))}, expected {sorted(dists)}"
    names = {n for r in rows for n in (r.name, *r.aliases)}
    assert expected <= names, f"missing impls {sorted(expected - names)}; installed: {sorted(names)}"
    print(f"ok: impls {sorted(names) or 'none'} from {sorted(dists) or 'no plugin'}")

    # What `jaxattn info` reports: each plugin installed from a wheel, loaded from site-packages;
    # and still no kernel library imported.
    from jaxattn.cli.info import collect

    info = collect()
    for plugin in info["plugins"]:
        assert plugin["install"] == "wheel", f"info says {plugin['name']} is {plugin['install']!r}, not 'wheel'"
        assert Path(plugin["path"]).resolve().is_relative_to(site), f"{plugin['name']} loaded from {plugin['path']}"
    loaded = sorted(set(_kernel_modules_loaded()) - set(preloaded))
    assert not loaded, f"jaxattn info imported kernel libraries: {loaded}"
    if not rows:
        assert info["default"]["impl"] is None and "nothing can run" in info["default"]["error"], info["default"]
    print(f"ok: info reports {len(info['plugins'])} plugins installed from wheels, imports no kernel library")

    # The commands come from the plugins: jaxattn-bench's where it is installed, none otherwise.
    from jaxattn.cli import CORE_COMMANDS, commands

    names = {c.name for c in commands()}
    extra = BENCH_COMMANDS if "jaxattn-bench" in TOOLS.get(args.target, ()) else frozenset()
    assert names == {*CORE_COMMANDS, *extra}, f"jaxattn's commands are {sorted(names)}"
    print(f"ok: commands {sorted(names)}")

    import jax.numpy as jnp
    import numpy as np

    from jaxattn.testing import oracle

    # NumPy draws the values: jax.random.normal would compile a program per shape in every venv.
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((1, 16, 4, 32), (1, 16, 2, 32), (1, 16, 2, 32)))
    if not rows:
        try:
            jaxattn.attention(q, k, v)
        except jaxattn.JaxattnError as err:
            message = str(err)
        else:
            raise AssertionError("attention() ran with no backend installed")
        assert "jaxattn[cpu]" in message, f"the error does not say what to install: {message}"
        print("ok: with no backend, attention() says what to install")
        return 0

    reference = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True).output
    # Every impl that accepts this call here (ring, say, needs a mesh and declines it).
    accepted = sorted(c.name for c in jaxattn.explain(q, k, v, causal=True).candidates if c.accepted)
    assert accepted, "no installed impl accepts a plain causal call on this device"
    for name in ["auto", *accepted]:
        out = jaxattn.attention(q, k, v, impl=name, causal=True)
        error = float(np.max(np.abs(np.asarray(out, np.float64) - reference)))
        assert error < 1e-4, f"{name}: max |error| {error:.2e} vs the oracle"
        print(f"ok: {name} matches the oracle (max |error| {error:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
