"""``autoregressive_decodeattn``: the impl (``impl``). Its kernel is the split-K paged kernel, reading
the dense cache as one page per sequence (``jaxattn_triton.paged.ops.dense_decode``)."""
