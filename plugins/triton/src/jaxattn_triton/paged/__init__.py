"""``page_attention`` and ``ragged_page_attention_v3``: the split-K paged kernel (``kernel``, imported only
when a kernel is launched), the widening of quantized caches (``widen``), their launch
descriptions (``launch``), the JAX entry points (``ops``; the dense decode's are in ``decode``) and the impls
(``impl``)."""
