"""``flash_attn2`` on the Pallas TPU flash-attention kernel: its impl (``impl``), the kernel wrapper
(``kernel``) and its tile rules (``rules``)."""
