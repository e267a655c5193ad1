"""On/off environment variables (``JAXATTN_TUNING``, ``JAXATTN_STRICT_PLUGINS``): one spelling rule.

A typo must never silently mean "off" (or "on"): a value that is neither is refused with an error
naming the variable and the values it takes.
"""

from __future__ import annotations

import os

from ..errors import InvalidInputError

__all__ = ["OFF", "ON", "flag"]

ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")


def flag(variable: str, *, default: bool, meaning: str) -> bool:
    """``$variable`` as a bool: unset or empty gives ``default``; ``meaning`` says what "on" does."""
    raw = os.environ.get(variable, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise InvalidInputError(f"${variable}", f"{raw!r} is neither on nor off",
                            f"set it to 1 (or on, true, yes) to {meaning}, to 0 (or off, false, no) or unset it "
                            f"for the default ({'on' if default else 'off'})")
