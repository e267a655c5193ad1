"""The implementation names every jaxattn release understands (the seed's ``AttentionMechanisms``).

A name is *known* when it is a member here, whether or not an installed plugin provides it:
asking for a known name that nothing here provides says which distributions bring it and how
to install them, instead of "unknown attention impl".
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum

__all__ = ["FIRST_PARTY", "PROVIDERS", "AttentionMechanisms", "MechanismSource", "normalize_name"]


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


@dataclasses.dataclass(frozen=True)
class MechanismSource:
    """A distribution that provides a mechanism, where it runs, and how to install it."""

    distribution: str
    platforms: str
    install: str


_VANILLA = MechanismSource("jaxattn-vanilla", "every platform", "pip install 'jaxattn[cpu]'")
_SDPA = MechanismSource("jaxattn-sdpa", "every platform (cuDNN on NVIDIA GPUs)", "pip install 'jaxattn[cpu]'")
_CUDNN = MechanismSource("jaxattn-sdpa", "NVIDIA GPUs", "pip install 'jaxattn[gpu,cuda12]'")
_TRITON = MechanismSource("jaxattn-triton", "NVIDIA GPUs", "pip install 'jaxattn[gpu,cuda12]'")
_PALLAS = MechanismSource("jaxattn-pallas", "TPUs", "pip install 'jaxattn[tpu,libtpu]'")
_MOSAIC = MechanismSource("jaxattn-mosaic", "NVIDIA Hopper GPUs (sm_90)", "pip install 'jaxattn[gpu,cuda12]'")
_SPLASH = MechanismSource("jaxattn-splash", "TPUs", "pip install 'jaxattn[tpu,libtpu]'")
_RING = MechanismSource("jaxattn-ring", "every platform, over a device mesh", "pip install 'jaxattn[ring]'")

#: Which first-party distributions provide each known mechanism (third parties may add more).
PROVIDERS: dict[str, tuple[MechanismSource, ...]] = {
    "vanilla": (_VANILLA,),
    "sdpa": (_SDPA,),
    "cudnn": (_CUDNN,),
    "cuda_flash_attn2": (_CUDNN,),
    "flash_attn2": (_TRITON, _PALLAS),
    "mosaic_flash": (_MOSAIC,),
    "splash": (_SPLASH,),
    "blocksparse": (_SPLASH,),
    "ring": (_RING,),
    "blockwise": (_VANILLA,),
    "autoregressive_decodeattn": (_VANILLA, _TRITON),
    "page_attention": (_VANILLA, _TRITON, _PALLAS),
    "ragged_page_attention_v2": (_VANILLA, _TRITON, _PALLAS),
    "ragged_page_attention_v3": (_VANILLA, _TRITON, _PALLAS),
    "ragged_page_attention": (_VANILLA, _TRITON, _PALLAS),
}

#: This project's plugin distributions. A name one of them provides is a built-in name: another
#: distribution's provider of it is rejected unless it declares the takeover (``ImplRef.overrides``).
FIRST_PARTY: frozenset[str] = frozenset(src.distribution for sources in PROVIDERS.values() for src in sources)


def normalize_name(name: object, argument: str = "impl") -> str:
    """Accept a str or an ``AttentionMechanisms`` member; names are case-insensitive.

    Anything else raises ``InvalidTypeError`` (also a ``TypeError``) naming ``argument``."""
    if isinstance(name, AttentionMechanisms):
        return name.value
    if not isinstance(name, str):
        from .errors import InvalidTypeError

        raise InvalidTypeError(argument, f"expected a name (str or AttentionMechanisms), got {type(name).__name__} "
                               f"{name!r}", "e.g. 'auto', 'vanilla'; `jaxattn list` shows every name")
    return name.strip().lower()
