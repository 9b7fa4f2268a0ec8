"""``python -m gpudash``: the same as the ``gpudash`` command."""

import sys

from .cli import main

sys.exit(main())
