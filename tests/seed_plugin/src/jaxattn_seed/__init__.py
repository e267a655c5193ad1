"""Example third-party jaxattn backend in the seed's style (see docs/write-a-backend.md)."""
