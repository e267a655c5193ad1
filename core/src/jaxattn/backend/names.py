"""The implementation names every jaxattn release understands (the seed's ``AttentionMechanisms``).

A name is *known* when it is a member here or a name ``DISTRIBUTIONS`` lists, whether or not an
installed plugin provides it: asking for a known name that nothing here provides says which
distributions bring it and how to install them, instead of "unknown attention impl".
"""

from __future__ import annotations

import re
from enum import StrEnum

__all__ = ["DISTRIBUTIONS", "FIRST_PARTY", "AttentionMechanisms", "install_hint", "normalize_name"]


class AttentionMechanisms(StrEnum):
    """Well-known implementation names; anywhere a name is accepted, these are too."""

    AUTO = "auto"
    VANILLA = "vanilla"
    SDPA = "sdpa"
    CUDNN = "cudnn"
    CUDA_FLASH_ATTN2 = "cuda_flash_attn2"
    FLASH_ATTN2 = "flash_attn2"
    SPLASH = "splash"
    BLOCKSPARSE = "blocksparse"
    RING = "ring"
    BLOCKWISE = "blockwise"
    REGRESSIVE_DECODE = "autoregressive_decodeattn"
    PAGED_ATTENTION = "page_attention"
    RAGGED_PAGE_ATTENTION_V2 = "ragged_page_attention_v2"
    RAGGED_PAGE_ATTENTION_V3 = "ragged_page_attention_v3"
    RAGGED_PAGE_ATTENTION = "ragged_page_attention"  # EasyDeL's unversioned name of the same op


_PAGED = ("page_attention", "ragged_page_attention_v2", "ragged_page_attention_v3", "ragged_page_attention")

#: The names each of this project's distributions provides, for a name that no installed plugin
#: provides: the one thing the core must know of a plugin that is not there. Each plugin declares
#: its names itself (its ``ImplRef``s); tests/architecture/test_declarations.py holds this table
#: to those declarations. Where each runs and how to install it is not restated here: the
#: ``jaxattn`` distribution's extras say which bring it (``install_hint``).
_NAMES: dict[str, tuple[str, ...]] = {
    "jaxattn-vanilla": ("vanilla", "blockwise", "vanilla_paged", "autoregressive_decodeattn", *_PAGED),
    "jaxattn-sdpa": ("sdpa", "cudnn", "cuda_flash_attn2"),
    "jaxattn-triton": ("flash_attn2", "triton_flash_attn2", "autoregressive_decodeattn", *_PAGED),
    "jaxattn-pallas": ("flash_attn2", *_PAGED),
    "jaxattn-mosaic": ("mosaic_flash",),
    "jaxattn-splash": ("splash", "blocksparse"),
    "jaxattn-ring": ("ring",),
}

#: The first-party distributions that provide each name, by name (third parties may add more).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    name: tuple(dist for dist, declared in _NAMES.items() if name in declared) for names in _NAMES.values()
    for name in names
}

#: This project's plugin distributions. A name one of them provides is a built-in name: another
#: distribution's provider of it is rejected unless it declares the takeover (``ImplRef.overrides``).
FIRST_PARTY: frozenset[str] = frozenset(_NAMES)


def _extras() -> dict[str, list[str]]:
    """The ``jaxattn`` distribution's extras and the distributions each requires (its metadata;
    empty where it is not installed, as in a bare source checkout)."""
    import importlib.metadata

    try:
        requires = importlib.metadata.requires("jaxattn") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    extras: dict[str, list[str]] = {}
    for requirement in requires:  # e.g. "jaxattn-triton[gpu]; extra == 'gpu'"
        if found := re.match(r"\s*([\w.-]+)[^;]*;.*\bextra\s*==\s*['\"]([^'\"]+)", requirement):
            extras.setdefault(found.group(2), []).append(found.group(1).lower().replace("_", "-"))
    return extras


def install_hint(distributions: tuple[str, ...]) -> str:
    """How to install each of ``distributions``: ``pip install 'jaxattn[gpu]'`` for the first extra
    of ``jaxattn`` that brings it (the others that do named after it; ``pip install <distribution>``
    where none does), then the runtime extras (those that bring only jax: ``jaxattn[cuda12]``...)."""
    extras = _extras()
    hints = []
    for dist in distributions:
        first, *others = [e for e, dists in extras.items() if dist in dists and e != "all"] or [""]
        also = f" (also in {', '.join(f'jaxattn[{e}]' for e in others)})" if others else ""
        hints.append(f"{dist}: pip install " + (f"'jaxattn[{first}]'{also}" if first else dist))
    runtimes = ", ".join(f"jaxattn[{e}]" for e, dists in extras.items() if set(dists) == {"jax"})
    return "; ".join(hints) + (f". An accelerator's runtime is an extra of its own: {runtimes}" if runtimes else "")


def normalize_name(name: object, argument: str = "impl") -> str:
    """Accept a str or an ``AttentionMechanisms`` member; names are case-insensitive.

    Anything else raises ``InvalidTypeError`` (also a ``TypeError``) naming ``argument``."""
    if isinstance(name, AttentionMechanisms):
        return name.value
    if not isinstance(name, str):
        from ..errors import InvalidTypeError

        raise InvalidTypeError(argument, f"expected a name (str or AttentionMechanisms), got {type(name).__name__} "
                               f"{name!r}", "e.g. 'auto', 'vanilla'; `jaxattn list` shows every name")
    return name.strip().lower()
