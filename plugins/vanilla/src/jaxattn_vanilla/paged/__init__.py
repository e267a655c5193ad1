"""``vanilla_paged``: the paged mechanisms' pure-JAX reference (``reference``: gather the pages, then
attend) and its impl (``impl``)."""
