"""Example third-party jaxattn backend (see docs/write-a-backend.md)."""
