"""pytest plugin of the conformance suite: the ``--jaxattn-conformance`` option.

Load it from the rootdir ``conftest.py`` (``pytest_plugins = ["jaxattn.testing.pytest_plugin"]``)
or with ``pytest -p jaxattn.testing.pytest_plugin``. Without it the suite reads the level
from ``$JAXATTN_CONFORMANCE``. Importing this module imports neither jax nor the suite.
"""

from __future__ import annotations

import pytest

__all__ = ["pytest_addoption"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("jaxattn", "jaxattn conformance suite")
    group.addoption(
        "--jaxattn-conformance",
        dest="jaxattn_conformance",
        choices=("default", "full"),
        default=None,
        help="size of the conformance matrix: 'default' (seconds per backend) or 'full' "
        "(larger shapes and more feature combinations); default: $JAXATTN_CONFORMANCE or 'default'",
    )
