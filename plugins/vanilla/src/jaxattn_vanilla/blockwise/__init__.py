"""``blockwise``: pure-JAX blockwise attention with a custom VJP (``kernel``) and its impl (``impl``)."""
