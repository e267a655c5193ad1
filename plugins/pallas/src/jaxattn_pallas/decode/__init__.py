"""``page_attention`` on JAX's Pallas TPU ``paged_attention`` kernel (one query per sequence): its
impl (``impl``), the kernel wrapper (``kernel``) and its rules (``rules``)."""
