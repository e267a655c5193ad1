"""Session-wide test settings.

Numerics tests compare against a float64 oracle with float32 tolerances; on GPUs and TPUs
XLA's default float32 matrix product is TF32 / bf16-pass, about 1e-3 off. Tests check the
math, so they run float32 products at full precision everywhere (users keep jax's default).

Under pytest-xdist's ``--dist loadgroup`` (what ``run.py test`` uses) the scheduler below
sends tests that share compiled programs or session fixtures to one worker, where they are
built once:

* the variants of a test that differ only in the value poisoning a cache (``nan``, ``inf``,
  ``-inf`` in the id): the same shapes, so the same programs;
* the cases of a conformance class's ``test_forward_eager_and_default_jit`` (or a paged one's
  ``test_unread_positions``) in one dtype, whose runs under ``jax.jit`` at XLA's defaults are one
  program (``BATCHED_TESTS``);
* the modules that name an ``xdist_group`` in their ``pytestmark`` (the fresh-venv tests: one
  wheelhouse and one dependency base per session). xdist reads that marker into the test id,
  which pytest 9.2 no longer lets it change, so the group is read off the module here.

Spread over two workers, about half of those programs (and both fixtures) were built twice.
Groups with more tests start first (xdist's ``--loadscope-reorder``, on by default), then the
longest single tests (``LONG_TESTS``), so none is left running alone at the end. The order
the tests run in changes; nothing a test checks does. (Grouping the tests of one conformance
case, which share a compiled program through the suites' per-process cache, measured no
faster: 160 Triton-interpreter conformance tests took 84-90 s grouped, 79-80 s not.)

Compiling, not running, is most of the suite's time on a CPU (about 65 ms an XLA:CPU compile
even of one small op, and an eager call compiles each op it meets). The workers, and the
subprocesses the tests start, share one XLA persistent compilation cache for the session
(``pytest_configure`` below), so that a program compiled once, by any of them, is not
compiled again: the same op at the same shapes reached by several backends' eager runs, the
same forward under two tests. A hit loads the executable that XLA built for the identical
program and options, so what a test checks does not change.

Tests that can only skip on this machine (a ``skip`` mark, or a ``skipif`` whose condition is
already true when the test is collected: the GPU-only suites on a host without a GPU) are
deselected at collection (``pytest_collection_modifyitems``): on a CPU host 1,835 of the
7,073 tests (2026-12-01), each otherwise set up only to be skipped. Where the condition is false (the GPU suites on a
GPU) they are collected and run as before. ``JAXATTN_TEST_KEEP_SKIPPED=1`` collects them
anyway (reported as skipped, with their reasons).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import pytest

from jaxattn.testing.quick_jit import CPU_TEST_COMPILER_OPTIONS_IF_KNOWN, xla_flags_for_tests

jax.config.update("jax_default_matmul_precision", "highest")

#: XLA:CPU flags of every compile in the suite's processes on a CPU (the workers and the
#: subprocesses the tests start inherit ``XLA_FLAGS``): the kit's test options
#: (``jaxattn.testing.quick_jit``), so that eager ops and plain ``jax.jit`` compile as the kits'
#: test programs do: LLVM's optimisations off (the flax tests 109 -> 63 and the drop-in tests
#: 76 -> 52 test-seconds in the whole suite, 2026-12-02) and XLA:CPU's elemental emitters rather
#: than its fusion emitters, about a third less CPU time in the conformance suites (pallas
#: 139 -> 92 s, vanilla paged 90 -> 63 s, 2026-12-02), compiling being most of it. Both are
#: XLA's own code paths; the default one stays checked where a test asks for XLA's defaults
#: (the conformance suites' forward-only ``jax.jit`` runs, the decode miscompile's and the
#: property test's jits: ``quick_jit.default_compiler_options``).
SUITE_XLA_FLAGS = tuple(xla_flags_for_tests())
#: Set to 0 to compile with XLA's defaults throughout.
SUITE_XLA_FLAGS_SWITCH = "JAXATTN_TEST_XLA_FLAGS"
_PROBE = "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready(); print(jax.default_backend())"


def _with_suite_xla_flags() -> None:
    """Add ``SUITE_XLA_FLAGS`` to ``XLA_FLAGS`` before jax parses them (at its first compile),
    where this jaxlib knows them and the suite runs on a CPU: XLA aborts the process on an
    unknown flag, and on an accelerator nothing would ask for its defaults back, so a child
    process tries them first (once per session: the workers find them set)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    missing = [f for f in SUITE_XLA_FLAGS if f.split("=")[0] not in {g.split("=")[0] for g in flags}]
    if os.environ.get(SUITE_XLA_FLAGS_SWITCH) == "0" or not missing:
        return
    optional = {f"--{name}" for name in CPU_TEST_COMPILER_OPTIONS_IF_KNOWN}
    for tried in (missing, [f for f in missing if f.split("=")[0] not in optional]):
        env = {**os.environ, "XLA_FLAGS": " ".join([*flags, *tried])}
        probe = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                               check=False, timeout=300)
        if probe.returncode == 0:
            if probe.stdout.split()[-1:] == ["cpu"]:
                os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]
            return


_with_suite_xla_flags()

ROOT = Path(__file__).resolve().parents[1]
#: The session's XLA cache: every program, however fast it compiled. Set in jax's config and
#: in the environment, which the workers and subprocesses inherit (jax reads it at start).
XLA_CACHE_SETTINGS: dict[str, float | int] = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    # -1: no minimum size, and jax may not raise it for the filesystem (0 lets it).
    "jax_persistent_cache_min_entry_size_bytes": -1,
}
#: Names the cache's directory; made (and removed at the end) by the first process without it.
XLA_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
#: Set to 0 to compile everything afresh (no cache).
XLA_CACHE_SWITCH = "JAXATTN_TEST_XLA_CACHE"
_OWN_CACHE = pytest.StashKey[str]()
# Ids of the values a poisoned-cache test tries; the rest of its id fixes the shapes.
_POISON_IDS = frozenset({"nan", "inf", "-inf"})
_MODULE_GROUP = re.compile(r"^pytestmark\s*=.*xdist_group\(\s*[\"']([^\"']+)[\"']", re.M)


@functools.cache
def _module_group(path: str) -> str | None:
    try:
        found = _MODULE_GROUP.search((ROOT / path).read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _id_tokens(param_id: str) -> list[str]:
    """``"vanilla--inf-eager"`` -> ``["vanilla", "-inf", "eager"]`` (ids are joined by ``-``)."""
    tokens: list[str] = []
    pending = ""
    for part in param_id.split("-"):
        if part == "" and not pending:
            pending = "-"
            continue
        tokens.append(pending + part)
        pending = ""
    return tokens


#: Tests whose cases share one program per suite class and dtype (the conformance kits'
#: runs under ``jax.jit`` at XLA's defaults: ``ConformanceSuite._default_jit_forward``,
#: ``PagedConformanceSuite._unread_batch``).
BATCHED_TESTS = ("::test_forward_eager_and_default_jit", "::test_unread_positions")


def shared_program_scope(nodeid: str) -> str:
    """The unit of work (a worker runs all of it) that ``nodeid`` belongs to."""
    path = nodeid.split("::", 1)[0]
    group = _module_group(path)
    if group is not None:
        return group
    name, bracket, param_id = nodeid.partition("[")
    if not bracket or not param_id.endswith("]"):
        return nodeid
    param_id = param_id[:-1]
    if name.endswith(BATCHED_TESTS):  # one program per class and dtype: the dtype ends the id
        return f"{name}[{param_id.rsplit('-', 1)[-1]}:batch]"
    tokens = _id_tokens(param_id)
    kept = [t for t in tokens if t not in _POISON_IDS]
    if len(kept) < len(tokens):  # the same test with another poison value
        return f"{name}[{'-'.join(kept)}:poisons]"
    return nodeid


#: Tests that take a minute or more of a CI worker (seconds in a 2-core CI run, 2026-11-27):
#: the multi-device checks (check_ring 337, the others 32-36), the example plugin's conformance
#: run (70), the random-call property test (44). (Ring's eager gradient through infinite sinks
#: took 52 there; since ring jits its shard_map, 1.6 s standalone.)
LONG_TESTS = (
    "tests/sharding/test_multidevice.py::",
    "tests/packaging/test_example_plugin.py::test_passes_the_conformance_suite_as_a_third_party",
    "tests/property/test_random_calls.py::",
)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(XLA_CACHE_SWITCH) == "0":
        return
    if not os.environ.get(XLA_CACHE_DIR):  # the controller (or a lone process) makes it
        os.environ[XLA_CACHE_DIR] = config.stash[_OWN_CACHE] = tempfile.mkdtemp(prefix="jaxattn-xla-cache-")
    jax.config.update(XLA_CACHE_DIR.lower(), os.environ[XLA_CACHE_DIR])
    for name, value in XLA_CACHE_SETTINGS.items():
        os.environ[name.upper()] = str(value)
        jax.config.update(name, value)


#: Set to 1 to collect the tests that can only skip here (they are then reported as skipped).
KEEP_SKIPPED = "JAXATTN_TEST_KEEP_SKIPPED"
_DESELECTED = pytest.StashKey[dict[str, int]]()


def skip_reason_before_running(item: pytest.Item) -> str | None:
    """Why ``item`` skips before it runs, known at collection: a ``skip`` mark or a ``skipif``
    whose condition is already true; None if it may run. (String conditions, evaluated by
    pytest when the test runs, are left to pytest.)"""
    for mark in item.iter_markers(name="skipif"):
        conditions = (mark.kwargs["condition"],) if "condition" in mark.kwargs else mark.args
        reason = str(mark.kwargs.get("reason", ""))
        if not conditions or any(not isinstance(c, str) and bool(c) for c in conditions):
            return reason or "skipif"
    for mark in item.iter_markers(name="skip"):
        return str(mark.kwargs.get("reason", mark.args[0] if mark.args else "skip"))
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(KEEP_SKIPPED) == "1":
        return
    kept, deselected, reasons = [], [], {}
    for item in items:
        reason = skip_reason_before_running(item)
        if reason is None:
            kept.append(item)
        else:
            deselected.append(item)
            reasons[reason] = reasons.get(reason, 0) + 1
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
        config.stash[_DESELECTED] = reasons


#: How many files the end-of-run summary lists (their tests' seconds, all phases summed).
SLOWEST_FILES = 10


#: Seconds of each test file's tests (setup, call and teardown), for the end-of-run summary.
_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Every report reaches the process that prints the summary (under xdist, the controller).
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if _file_seconds:
        total = sum(_file_seconds.values())
        slowest = sorted(_file_seconds.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]
        terminalreporter.write_line(f"test seconds by file (all workers; {total:.0f} s in {len(_file_seconds)} "
                                    f"files), the {len(slowest)} slowest:")
        for path, seconds in slowest:
            terminalreporter.write_line(f"  {seconds:7.1f}  {path}")
    reasons = config.stash.get(_DESELECTED, None)
    if reasons:
        terminalreporter.write_line(f"not collected, as they can only skip here ({KEEP_SKIPPED}=1 collects them):")
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"  {count:5d}  {reason}")


def pytest_unconfigure(config: pytest.Config) -> None:
    own = config.stash.get(_OWN_CACHE, None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)
        os.environ.pop(XLA_CACHE_DIR, None)


def starts_early(scope: str) -> bool:
    """Whether a unit of work is one of :data:`LONG_TESTS` (scheduled right after the first units)."""
    return scope.startswith(LONG_TESTS)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SharedProgramScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # a group xdist did read into the id
                return super()._split_scope(nodeid)
            return shared_program_scope(nodeid)

        def schedule(self) -> None:
            super().schedule()
            # The longest single tests next after the first units: started late, one of them
            # keeps a worker busy while the other has nothing left.
            for scope in [s for s in self.workqueue if starts_early(s)][::-1]:
                self.workqueue.move_to_end(scope, last=False)

    return SharedProgramScheduling(config, log)
