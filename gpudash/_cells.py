"""A notebook cell's name for the file name Python gives its code.

In a Jupyter kernel a cell's code runs from a file named by a hash of its text
(``/tmp/ipykernel_4242/3605273128.py``); IPython knows which cell each such name is and writes
``Cell In[5]`` in its own tracebacks. :func:`display_name` asks the running IPython, so that a
holder's line reads ``Cell In[5]:7 train`` beside the notebook the user is looking at, not a
temporary file's name. Outside IPython, and for any file IPython did not compile, it gives
the file name back unchanged. IPython is never imported here: only an IPython already
running in this process is asked.
"""

from __future__ import annotations

import os
import sys

__all__ = ["cell_name", "display_name"]


def cell_name(filename: str) -> str | None:
    """``"Cell In[5]"`` where ``filename`` is the code of a cell this process's IPython ran,
    else None."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    if get is None:
        return None
    try:
        shell = get()
        named = shell.compile.format_code_name(filename) if shell is not None else None
    except Exception:  # noqa: BLE001 - an IPython without it: the file name stands
        return None
    if not named:
        return None
    label, name = named
    return f"{label} {name}"


def display_name(filename: str) -> str:
    """A frame's file as the user knows it: a notebook cell's name (:func:`cell_name`),
    else the file's base name."""
    return cell_name(filename) or os.path.basename(filename)
