"""Sets up the Triton interpreter before any test module imports a kernel (see ``_env``)."""

import os
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
    from jaxattn_triton.flash import impl as impl_module

    monkeypatch.setattr(impl_module, "_installed", lambda module: True)


@pytest.fixture(autouse=True)
def _triton_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    # jax_triton sets TRITON_CACHE_DIR="" when imported (it keeps kernels in memory); triton's
    # own launcher (the torch launches of the kernel tests, on a GPU) then cannot cache and
    # fails. Every test of this folder gets a cache dir back, whichever test imported it first.
    if os.environ.get("TRITON_CACHE_DIR") == "":
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
