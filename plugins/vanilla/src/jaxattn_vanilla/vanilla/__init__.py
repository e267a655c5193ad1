"""``vanilla``: the pure-JAX reference attention (``reference``) and its impl (``impl``)."""
