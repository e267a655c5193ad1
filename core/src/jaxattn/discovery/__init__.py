"""Discovery: the hook, entry points, the registry of providers (docs/architecture.md)."""
