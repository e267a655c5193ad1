"""The public API: the calls a user makes, and how impls compose (docs/architecture.md)."""
