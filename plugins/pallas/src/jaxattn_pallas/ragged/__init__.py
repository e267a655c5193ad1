"""``ragged_page_attention_v3`` on JAX's Pallas TPU ragged paged-attention kernel: its impl
(``impl``), the kernel wrapper (``kernel``), its rules (``rules``) and the paged decode
``(num_seqs, T, ...)`` on that kernel (``decode``)."""
