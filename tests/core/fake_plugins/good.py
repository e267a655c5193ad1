from __future__ import annotations

import jaxattn


@jaxattn.hookimpl
def jaxattn_register_impls() -> list[jaxattn.ImplRef]:
    # Lazy: the module below is imported only when the impl is asked for.
    return [jaxattn.ImplRef("tests.core.toy_impls:PlainImpl", names=("plain", "plain_alias"),
                            platforms=("cpu", "gpu", "tpu"))]
