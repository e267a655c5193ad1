from __future__ import annotations

import jaxattn


@jaxattn.hookimpl
def jaxattn_register_impls() -> list[jaxattn.ImplRef]:
    return [jaxattn.ImplRef("tests.core.fake_plugins.no_such_module:Impl", names=("ghost",), platforms=("cpu",))]
