"""jaxattn-bench: ``jaxattn bench`` (every backend side by side, in one process), ``jaxattn tune``
(the tuning cache's measurements, ``store``) and ``jaxattn demo``, added through the
``jaxattn_register_commands`` hook (``plugin``).

``run_bench(BenchConfig(...))`` is the library entry point; ``jaxattn_bench.cli`` is the
command. Importing this package is cheap: jax loads when something runs.
"""

from __future__ import annotations

from .results import BenchConfig, BenchReport, BenchResult
from .runner import run_bench
from .shapes import BenchShape, default_matrix, quick_matrix

__all__ = ["BenchConfig", "BenchReport", "BenchResult", "BenchShape", "default_matrix", "quick_matrix", "run_bench"]
