"""Where the real files from other people's projects are, for the tests that read them.

They live beside the checkout, in ``../shared/reference/external`` (a worktree one or two
levels deeper finds the same folder), or in the folder ``GPUDASH_EXTERNAL`` names. Users clone
gpudash without them: the tests that read them skip, saying so. They are never copied into
the project.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["EXTERNAL", "MISSING"]


def _external() -> Path:
    named = os.environ.get("GPUDASH_EXTERNAL")
    if named:
        return Path(named)
    here = Path(__file__).resolve()
    for up in here.parents[1:4]:
        found = up / "shared" / "reference" / "external"
        if found.is_dir():
            return found
    return here.parents[2] / "shared" / "reference" / "external"   # absent: tests skip


#: The folder (it may not exist: check ``EXTERNAL.is_dir()``).
EXTERNAL = _external()
#: The skip reason of a test that needs it.
MISSING = "../shared/reference/external is not here"
