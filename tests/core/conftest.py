from __future__ import annotations

from collections.abc import Iterator

import pytest

from jaxattn.discovery.plugins import isolated_registry


@pytest.fixture
def empty_registry() -> Iterator[None]:
    """A registry with nothing discovered: only what the test registers."""
    with isolated_registry(discover=False):
        yield
