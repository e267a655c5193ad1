"""Registration: the entry point, lazy references that match the classes, a jax-free plugin module."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import jaxattn
from jaxattn.discovery.plugins import plugin_records
from jaxattn_sdpa import plugin


def test_entry_point_names_the_plugin_module() -> None:
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="jaxattn.plugins")}
    assert eps["sdpa"].value == "jaxattn_sdpa.plugin"
    assert eps["sdpa"].dist is not None and eps["sdpa"].dist.name == "jaxattn-sdpa"
    record = {r.name: r for r in plugin_records()}["sdpa"]
    assert record.status == "ok" and sorted(record.impl_names) == ["cudnn", "sdpa"]


def test_lazy_references_match_the_classes() -> None:
    for ref in (plugin.SDPA, plugin.CUDNN):
        cls = ref.load()
        assert cls.names() == ref.names
        assert set(cls.platforms) == set(ref.platforms)
        assert cls.priority == ref.priority and cls.description == ref.description
    assert plugin.CUDNN.names == ("cudnn", "cuda_flash_attn2")
    rows = {row.name: row for row in jaxattn.list_impls()}
    assert rows["cudnn"].aliases == ("cuda_flash_attn2",) and rows["cudnn"].distribution == "jaxattn-sdpa"


def test_discovery_imports_no_jax() -> None:
    code = (
        "import sys, jaxattn_sdpa.plugin as p; p.jaxattn_register_impls(); "
        "print(sorted(m for m in ('jax', 'jaxlib', 'jaxattn_sdpa.impl') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
