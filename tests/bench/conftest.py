from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from jaxattn_bench import records as cache_module


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Never read or write the user's tuning cache."""
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path / "cache"))
    cache_module.reload()
    yield tmp_path / "cache"
    cache_module.reload()
