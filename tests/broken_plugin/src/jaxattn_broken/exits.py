"""Registration module that calls ``sys.exit()`` at import, as a careless or hostile plugin may.

``SystemExit`` is no ``Exception``: discovery must isolate it like any other failure, or it
would end every program that uses jaxattn (issue 18 item 10).
"""

from __future__ import annotations

import sys

sys.exit("jaxattn_broken.exits: exiting at import")
