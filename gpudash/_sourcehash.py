"""The fingerprint of the compiled core's sources (``_core.pyx`` and ``_csrc/*.pxi``).

``setup.py`` builds it into :mod:`gpudash._core` (``SOURCE_HASH``); at import,
:mod:`gpudash._accel` compares it with the sources beside the package, so that an extension
left over from older sources (a ``git pull`` without a rebuild) is not used. No imports
beyond the standard library: ``setup.py`` runs this file before gpudash is installed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def source_hash(package_dir: str | Path) -> str | None:
    """sha256 of the core's source files under ``package_dir``, or None without them."""
    root = Path(package_dir)
    files = [root / "_core.pyx", *sorted((root / "_csrc").glob("*.pxi"))]
    if not files[0].is_file():
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()
