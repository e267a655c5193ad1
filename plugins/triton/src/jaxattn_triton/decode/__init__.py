"""``autoregressive_decodeattn``: the impl (``impl``), its JAX entry points (``ops``: ``dense_decode``,
``decode_with_flash_grad``) and their NumPy reference (``reference``). The kernel is the split-K
kernel of ``paged``, reading the dense cache in place in its dense layout (no page table)."""
