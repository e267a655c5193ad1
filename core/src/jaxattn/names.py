"""The implementation names every jaxattn release understands (the seed's ``AttentionMechanisms``)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["AttentionMechanisms", "normalize_name"]


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


def normalize_name(name: object) -> str:
    """Accept a str or an ``AttentionMechanisms`` member; names are case-insensitive."""
    if isinstance(name, AttentionMechanisms):
        return name.value
    if not isinstance(name, str):
        raise TypeError(f"impl: expected a name (str or AttentionMechanisms), got {type(name).__name__}")
    return name.strip().lower()
