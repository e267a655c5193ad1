"""Sets up the Triton interpreter before any test module imports a kernel (see ``_env``)."""

from pathlib import Path

import pytest

from . import _env  # noqa: F401  # import for its effect: TRITON_INTERPRET on CPU hosts

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The "triton" marker names this group: `-m "not triton"` (run.py test --no-torch) runs
    # the rest without torch and triton.
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.triton)


@pytest.fixture
def kernels_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin believes its kernel libraries are installed (nothing is imported)."""
    from jaxattn_triton import impl as impl_module

    monkeypatch.setattr(impl_module, "_installed", lambda module: True)
