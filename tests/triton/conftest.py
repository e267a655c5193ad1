"""Sets up the Triton interpreter before any test module imports a kernel (see ``_env``)."""

from . import _env  # noqa: F401  # import for its effect: TRITON_INTERPRET on CPU hosts
