"""``python -m jaxattn`` runs the ``jaxattn`` command."""

import sys

from jaxattn.cli import main

sys.exit(main())
