"""docs/masks.md's code blocks run as written (the packed-documents Flax NNX model among them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "masks.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_code() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_code_block_runs(index: int) -> None:
    exec(compile(BLOCKS[index], f"{PAGE}:block{index}", "exec"), {"__name__": "__masks_doc__"})
