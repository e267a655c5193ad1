"""``jaxattn.backend``: the SDK, the one module a plugin imports from the core.

Besides the user API of ``jaxattn`` itself, a plugin needs nothing else of the core:
``tests/architecture/test_public_surface.py`` fails when any distribution imports another's
private module or name. The names come in groups, each a step further from a basic backend:

- **a backend** (docs/write-a-backend.md): ``ImplRef`` (the declaration), ``hookimpl`` (the
  registration hook), ``AttentionImpl`` / ``PagedAttentionImpl`` (the class, with one
  ``forward(call)``), ``AttentionCall`` / ``PagedCall`` (what the forward reads),
  ``AttentionOutput`` (what it returns), ``Feature`` (what it declares it runs);
- **the protocol around it**: ``Backend`` (what both kinds share), ``AttentionProblem`` /
  ``PagedProblem`` (what reasons read), ``AttentionMetadata``, ``DeviceInfo`` /
  ``detect_device`` / ``resolve_platform``, ``ALL_FEATURES``, the errors;
- **helpers kernels share**: attention sinks (``split_absorbing_sinks``, ``zero_absorbed_heads``),
  unread cache positions and keys (``zero_past_lengths``, ``zero_unseen_keys``), quantized
  reads (``dequantize_visible``, ``quantize_kv``, ...), paging (``pages_in_address_order``),
  tracing (``traced_under``, ``x64_off``), validation (``resolve_call``, ``window_pair``);
- **composition**, for plugins that run other impls (ring): ``get_impl``, ``available_here``,
  and the mesh helpers of ``jaxattn.sharding``;
- **tuning**: what the ``jaxattn_tuning_records`` hook returns and how a plugin reads its
  section of the tuning cache; the key of a call class (``problem_key``), a record's check
  (``parse_measurement``), and the files a ``jaxattn_tuning_priors`` hook returns
  (``package_priors``);
- **selection probes**, for tools that measure auto: ``choose``, ``evaluate``, ``AutoAttention``.

``import jaxattn.backend`` imports no jax: every name loads on first use (module
``__getattr__``), from the core module that defines it. The core's own modules import those
modules directly, never this one (``tests/architecture/test_layers.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> the core module (relative to ``jaxattn``) that defines it, by group.
_EXPORTS: dict[str, str] = {name: module for module, names in (
    # a backend
    ("backend.declaration", "ImplRef"),
    ("discovery.hookspecs", "hookimpl"),
    ("backend.impl", "AttentionImpl"),
    ("backend.paged_impl", "PagedAttentionImpl"),
    ("backend.call", "AttentionCall PagedCall"),
    ("backend.output", "AttentionOutput"),
    ("backend.capabilities", "Feature"),
    # the protocol around it
    ("backend.capabilities", "ALL_FEATURES"),
    ("backend.base", "Backend Composition Forward Plan refuse_gradients resolve_platform"),
    ("backend.declaration", "DeclarationError"),
    ("backend.problem", "AttentionProblem PagedProblem"),
    ("backend.metadata", "AttentionMetadata axis_tuple describe_axes"),
    ("backend.device", "DeviceInfo detect_device"),
    ("errors", "JaxattnError InvalidInputError InvalidTypeError UnsupportedError ImplNotFoundError PluginError"),
    # helpers kernels share
    ("backend.sinks", "split_absorbing_sinks zero_absorbed_heads"),
    ("backend.unread", "zero_past_lengths zero_unseen_keys"),
    ("backend.quantize", "GRANULARITIES KV_DTYPE_FLAGS dequantize_kv dequantize_visible quantize_kv"),
    ("backend.paging", "pages_in_address_order"),
    ("backend.tracing", "traced_under x64_off"),
    ("backend.validation", "resolve_call window_pair"),
    # composition
    ("api.calls", "get_impl"),
    ("selection.lookup", "available_here"),
    ("sharding.specs", "AttentionSpecs"),
    ("sharding.axes", "MeshAxes kv_head_repeat mesh_axes"),
    ("sharding.compat", "axis_size shard_map"),
    ("sharding.wrap", "check_batch_heads local_metadata"),
    # tuning
    ("selection.tuning", "Measurement TuningRecords TuningCacheWarning TIE_TOLERANCE plugin_section warn_once"),
    ("selection.tuning", "reload_tuning package_priors parse_measurement problem_key seq_bucket"),
    # selection probes
    ("selection.dispatch", "AutoAttention choose evaluate"),
) for name in names.split()}

#: Names whose defining module spells them differently.
_RENAMED = {"reload_tuning": "reload"}

__all__ = [
    "ALL_FEATURES", "GRANULARITIES", "KV_DTYPE_FLAGS", "TIE_TOLERANCE", "AttentionCall", "AttentionImpl",
    "AttentionMetadata", "AttentionOutput", "AttentionProblem", "AttentionSpecs", "AutoAttention", "Backend",
    "Composition", "DeclarationError", "DeviceInfo", "Feature", "Forward", "ImplNotFoundError", "ImplRef",
    "InvalidInputError", "InvalidTypeError", "JaxattnError", "Measurement", "MeshAxes", "PagedAttentionImpl",
    "PagedCall", "PagedProblem", "Plan", "PluginError", "TuningCacheWarning", "TuningRecords", "UnsupportedError",
    "available_here", "axis_size", "axis_tuple", "check_batch_heads", "choose", "dequantize_kv",
    "dequantize_visible", "describe_axes", "detect_device", "evaluate", "get_impl", "hookimpl", "kv_head_repeat",
    "local_metadata", "mesh_axes", "package_priors", "pages_in_address_order", "parse_measurement", "plugin_section",
    "problem_key", "quantize_kv", "refuse_gradients", "reload_tuning", "resolve_call", "resolve_platform",
    "seq_bucket", "shard_map", "split_absorbing_sinks", "traced_under", "warn_once", "window_pair", "x64_off",
    "zero_absorbed_heads", "zero_past_lengths", "zero_unseen_keys",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxattn.backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jaxattn.{module}"), _RENAMED.get(name, name))
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from jaxattn.api.calls import get_impl
    from jaxattn.backend.base import Backend, Composition, Forward, Plan, refuse_gradients, resolve_platform
    from jaxattn.backend.call import AttentionCall, PagedCall
    from jaxattn.backend.capabilities import ALL_FEATURES, Feature
    from jaxattn.backend.declaration import DeclarationError, ImplRef
    from jaxattn.backend.device import DeviceInfo, detect_device
    from jaxattn.backend.impl import AttentionImpl
    from jaxattn.backend.metadata import AttentionMetadata, axis_tuple, describe_axes
    from jaxattn.backend.output import AttentionOutput
    from jaxattn.backend.paged_impl import PagedAttentionImpl
    from jaxattn.backend.paging import pages_in_address_order
    from jaxattn.backend.problem import AttentionProblem, PagedProblem
    from jaxattn.backend.quantize import GRANULARITIES, KV_DTYPE_FLAGS, dequantize_kv, dequantize_visible, quantize_kv
    from jaxattn.backend.sinks import split_absorbing_sinks, zero_absorbed_heads
    from jaxattn.backend.tracing import traced_under, x64_off
    from jaxattn.backend.unread import zero_past_lengths, zero_unseen_keys
    from jaxattn.backend.validation import resolve_call, window_pair
    from jaxattn.discovery.hookspecs import hookimpl
    from jaxattn.errors import (
        ImplNotFoundError,
        InvalidInputError,
        InvalidTypeError,
        JaxattnError,
        PluginError,
        UnsupportedError,
    )
    from jaxattn.selection.dispatch import AutoAttention, choose, evaluate
    from jaxattn.selection.lookup import available_here
    from jaxattn.selection.tuning import (
        TIE_TOLERANCE,
        Measurement,
        TuningCacheWarning,
        TuningRecords,
        package_priors,
        parse_measurement,
        plugin_section,
        problem_key,
        seq_bucket,
        warn_once,
    )
    from jaxattn.selection.tuning import reload as reload_tuning
    from jaxattn.sharding.axes import MeshAxes, kv_head_repeat, mesh_axes
    from jaxattn.sharding.compat import axis_size, shard_map
    from jaxattn.sharding.specs import AttentionSpecs
    from jaxattn.sharding.wrap import check_batch_heads, local_metadata
