"""jaxattn: one attention API for JAX, with the fastest correct backend for each device.

Backends are plugins (entry-point group ``jaxattn.plugins``). ``import jaxattn`` is cheap: it
imports neither jax nor any kernel library; names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "AttentionCall": "backend.call",
    "PagedCall": "backend.call",
    "AttentionImpl": "backend.impl",
    "PagedAttentionImpl": "backend.paged_impl",
    "PagedProblem": "backend.problem",
    "paged_attention": "api.calls",
    "ragged_paged_attention": "api.calls",
    "explain_paged": "api.calls",
    "pages_in_address_order": "backend.paging",
    "quantize_kv": "backend.quantize",
    "dequantize_kv": "backend.quantize",
    "AttentionMetadata": "backend.metadata",
    "AttentionOutput": "backend.output",
    "AttentionProblem": "backend.problem",
    "AttentionMechanisms": "backend.names",
    "Feature": "backend.capabilities",
    "ImplRef": "backend.declaration",
    "ImplInfo": "discovery.registry",
    "DeviceInfo": "backend.device",
    "detect_device": "backend.device",
    "tpu_version_check": "backend.device",
    "hookimpl": "discovery.hookspecs",
    "get_impl": "api.calls",
    "list_impls": "selection.lookup",
    "register_impl": "selection.lookup",
    "register_plugin": "discovery.plugins",
    "list_plugins": "discovery.plugins",
    "PluginRecord": "discovery.plugins",
    "attention": "api.calls",
    "dot_product_attention": "api.dropin",
    "explain": "selection.dispatch",
    "Explanation": "selection.dispatch",
    "use_impl": "selection.dispatch",
    "get_optimal_config": "selection.dispatch",
    "JaxattnError": "errors",
    "InvalidInputError": "errors",
    "InvalidTypeError": "errors",
    "UnsupportedError": "errors",
    "ImplNotFoundError": "errors",
    "PluginError": "errors",
    "BlockMask": "masks",
}

__all__ = [
    "AttentionCall",
    "AttentionImpl",
    "AttentionMechanisms",
    "AttentionMetadata",
    "AttentionOutput",
    "AttentionProblem",
    "BlockMask",
    "DeviceInfo",
    "Explanation",
    "Feature",
    "ImplInfo",
    "ImplNotFoundError",
    "ImplRef",
    "InvalidInputError",
    "InvalidTypeError",
    "JaxattnError",
    "PagedAttentionImpl",
    "PagedCall",
    "PagedProblem",
    "PluginError",
    "PluginRecord",
    "UnsupportedError",
    "__version__",
    "attention",
    "dequantize_kv",
    "detect_device",
    "dot_product_attention",
    "explain",
    "explain_paged",
    "get_impl",
    "get_optimal_config",
    "hookimpl",
    "list_impls",
    "list_plugins",
    "masks",
    "paged_attention",
    "pages_in_address_order",
    "quantize_kv",
    "ragged_paged_attention",
    "register_impl",
    "register_plugin",
    "tpu_version_check",
    "use_impl",
]


def __getattr__(name: str) -> Any:
    if name == "masks":  # the submodule (mask_mod constructors, BlockMask): cheap, jax loads inside it
        return importlib.import_module(".masks", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxattn' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from . import masks
    from .api.calls import attention, explain_paged, get_impl, paged_attention, ragged_paged_attention
    from .api.dropin import dot_product_attention
    from .backend.call import AttentionCall, PagedCall
    from .backend.capabilities import Feature
    from .backend.declaration import ImplRef
    from .backend.device import DeviceInfo, detect_device, tpu_version_check
    from .backend.impl import AttentionImpl
    from .backend.metadata import AttentionMetadata
    from .backend.names import AttentionMechanisms
    from .backend.output import AttentionOutput
    from .backend.paged_impl import PagedAttentionImpl
    from .backend.paging import pages_in_address_order
    from .backend.problem import AttentionProblem, PagedProblem
    from .backend.quantize import dequantize_kv, quantize_kv
    from .discovery.hookspecs import hookimpl
    from .discovery.plugins import PluginRecord, list_plugins, register_plugin
    from .discovery.registry import ImplInfo
    from .errors import (
        ImplNotFoundError,
        InvalidInputError,
        InvalidTypeError,
        JaxattnError,
        PluginError,
        UnsupportedError,
    )
    from .masks import BlockMask
    from .selection.dispatch import Explanation, explain, get_optimal_config, use_impl
    from .selection.lookup import list_impls, register_impl
