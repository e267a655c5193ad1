from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import jaxattn
import jaxattn.selection.tuning
from jaxattn.backend import device as device_module
from jaxattn.backend.device import DeviceInfo
from jaxattn.discovery.plugins import isolated_registry, register_plugin
from jaxattn_bench import plugin as bench_plugin
from jaxattn_bench import records as cache_module
from jaxattn_bench import runner as runner_module
from jaxattn_bench.timing import samples_per_round

from .helpers import FakeTimer, Timer
from .toys import ALL, reset_calls


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own tuning cache folder and forgets what earlier tests read."""
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("JAXATTN_TUNING", raising=False)
    jaxattn.selection.tuning._warned.clear()
    cache_module.reload()
    yield tmp_path / "cache"
    cache_module.reload()


@pytest.fixture
def toys() -> Iterator[None]:
    """A registry holding only the toy impls, and jaxattn-bench's commands (``jaxattn tune``)."""
    with isolated_registry(discover=False):
        register_plugin(bench_plugin, name="bench")
        for cls in ALL:
            jaxattn.register_impl(cls)
        reset_calls()
        yield


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch) -> Callable[[DeviceInfo], DeviceInfo]:
    """Pretend the host is another device: ``fake_device(DeviceInfo(...))``."""

    def use(info: DeviceInfo) -> DeviceInfo:
        monkeypatch.setattr(device_module, "_detect", lambda: info)
        cache_module.reload()
        return info

    return use


@pytest.fixture
def fake_timer(monkeypatch: pytest.MonkeyPatch) -> FakeTimer:
    """``fake_timer({impl: timer}, repeats, rounds)``: the benchmark runner's samples come from
    the timers (what a quiet or a noisy machine would give), never from a clock."""
    names: dict[int, str] = {}
    counts: dict[int, int] = {}
    rng = random.Random(0)
    timers: dict[str, Timer] = {}
    per_round: list[int] = []
    real_compile = runner_module.compile_program

    def compile_program(fn: Any, mode: str, args: Any) -> Any:
        program = real_compile(fn, mode, args)
        program.key = None  # never deduplicated: each impl keeps its own fake times
        # bench.backends builds fn as a closure over the impl's name
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))
        names[id(program)] = cells["name"]
        return program

    def run_sample(program: Any, args: Any, number: int) -> float:
        n = counts[id(program)] = counts.get(id(program), -1) + 1
        round_ = next(k for k in range(len(per_round)) if n < sum(per_round[:k + 1]))
        name = names[id(program)]
        return timers[name](name, round_, rng)

    monkeypatch.setattr(runner_module, "compile_program", compile_program)
    monkeypatch.setattr(runner_module, "run_sample", run_sample)

    def use(impl_timers: dict[str, Timer], repeats: int, rounds: int) -> None:
        timers.update(impl_timers)
        per_round[:] = samples_per_round(repeats, rounds)

    return use
