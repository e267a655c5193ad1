"""Plugin modules for in-process discovery tests (entry points are built in the test)."""
