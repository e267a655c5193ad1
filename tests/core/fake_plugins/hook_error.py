from __future__ import annotations

import jaxattn


@jaxattn.hookimpl
def jaxattn_register_impls() -> list[object]:
    raise RuntimeError("hook exploded")
