"""jaxattn-mosaic: an FA3-style attention forward in Pallas Mosaic GPU for Hopper (``mosaic_flash``).

Importing the package imports no kernel library (not even jax): ``jaxattn_mosaic.kernel`` is
the JAX entry point, ``jaxattn_mosaic.impl.MosaicFlashAttention`` the registered impl.
"""

__version__ = "0.1.0"
