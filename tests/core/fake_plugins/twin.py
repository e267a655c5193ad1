from __future__ import annotations

import jaxattn


@jaxattn.hookimpl
def jaxattn_register_impls() -> list[jaxattn.ImplRef]:
    return [jaxattn.ImplRef("tests.core.toy_impls:PlainImpl", names=("plain",), platforms=("cpu",))]
