from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import jaxattn
from jaxattn import device as device_module
from jaxattn.device import DeviceInfo
from jaxattn.plugins import isolated_registry
from jaxattn.tuning import cache as cache_module

from .toys import ALL, reset_calls


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own tuning cache folder and forgets what earlier tests read."""
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("JAXATTN_TUNING", raising=False)
    cache_module._warned.clear()
    cache_module.reload()
    yield tmp_path / "cache"
    cache_module.reload()


@pytest.fixture
def toys() -> Iterator[None]:
    """A registry holding only the toy impls."""
    with isolated_registry(discover=False):
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
