"""``autoregressive_decodeattn``: pure-JAX split-K decode over a dense KV cache (``kernel``) and its impl
(``impl``)."""
