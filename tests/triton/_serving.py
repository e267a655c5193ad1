"""What the serving-backend tests share: a paged decode problem on an H100-sized pool (the
``kernels_installed`` fixture is in conftest.py)."""

from __future__ import annotations

from typing import Any

from jaxattn.backend.problem import PagedProblem

# NumPy warns on log2(0) in the interpreter's tile arithmetic for empty rows.
LOG2_WARNING = "ignore:divide by zero encountered in log2:RuntimeWarning"


def paged_problem(**kw: Any) -> PagedProblem:
    """16 decode sequences, GQA 32/8, D 128, bf16, pages of 16 in a 4096-page pool; ``kw`` changes fields."""
    base: dict[str, Any] = {
        "num_seqs": 16, "num_tokens": 16, "queries_per_seq": 1, "heads_q": 32, "heads_kv": 8, "head_dim": 128,
        "head_dim_v": 128, "dtype": "bfloat16", "page_size": 16, "num_pages": 4096, "pages_per_seq": 256,
    }  # fmt: skip
    return PagedProblem(**{**base, **kw})
