"""jaxattn: one attention API for JAX, with the fastest correct backend for each device.

Backends are plugins (entry-point group ``jaxattn.plugins``). ``import jaxattn`` is cheap: it
imports neither jax nor any kernel library; names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "AttentionCall": "call",
    "PagedCall": "call",
    "AttentionImpl": "impl",
    "PagedAttentionImpl": "paged_impl",
    "PagedProblem": "problem",
    "paged_attention": "api",
    "ragged_paged_attention": "api",
    "explain_paged": "api",
    "pages_in_address_order": "paging",
    "quantize_kv": "quantize",
    "dequantize_kv": "quantize",
    "AttentionMetadata": "metadata",
    "AttentionOutput": "output",
    "AttentionProblem": "problem",
    "AttentionMechanisms": "names",
    "Feature": "capabilities",
    "ImplRef": "declaration",
    "ImplInfo": "registry",
    "DeviceInfo": "device",
    "detect_device": "device",
    "tpu_version_check": "device",
    "hookimpl": "hookspecs",
    "get_impl": "api",
    "list_impls": "lookup",
    "register_impl": "lookup",
    "register_plugin": "plugins",
    "list_plugins": "plugins",
    "PluginRecord": "plugins",
    "attention": "api",
    "dot_product_attention": "dropin",
    "explain": "dispatch",
    "Explanation": "dispatch",
    "use_impl": "dispatch",
    "get_optimal_config": "dispatch",
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
    from .api import attention, explain_paged, get_impl, paged_attention, ragged_paged_attention
    from .call import AttentionCall, PagedCall
    from .capabilities import Feature
    from .declaration import ImplRef
    from .device import DeviceInfo, detect_device, tpu_version_check
    from .dispatch import Explanation, explain, get_optimal_config, use_impl
    from .dropin import dot_product_attention
    from .errors import (
        ImplNotFoundError,
        InvalidInputError,
        InvalidTypeError,
        JaxattnError,
        PluginError,
        UnsupportedError,
    )
    from .hookspecs import hookimpl
    from .impl import AttentionImpl
    from .lookup import list_impls, register_impl
    from .masks import BlockMask
    from .metadata import AttentionMetadata
    from .names import AttentionMechanisms
    from .output import AttentionOutput
    from .paged_impl import PagedAttentionImpl
    from .paging import pages_in_address_order
    from .plugins import PluginRecord, list_plugins, register_plugin
    from .problem import AttentionProblem, PagedProblem
    from .quantize import dequantize_kv, quantize_kv
    from .registry import ImplInfo
