"""The views a live source opens without importing them.

A framework monitor's :meth:`~gpudash.monitors.Monitor.dashboard` shows its devices in gpudash's
dashboard, which lives in the layer above (:mod:`gpudash.widgets`, an anywidget). The live
layer names no view: the layer above registers a factory under a name
(:func:`register_view`; gpudash's package registers ``"dashboard"``, the anywidget
:class:`gpudash.widgets.Dashboard`, when it is imported) and a source asks for it by that
name (:func:`open_view`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import GpudashError

__all__ = ["register_view", "open_view"]

_FACTORIES: dict[str, Callable[..., Any]] = {}


def register_view(name: str, factory: Callable[..., Any]) -> None:
    """Let sources open ``factory(source, **options)`` as the view called ``name`` (a later
    registration of the same name replaces the earlier one)."""
    if not callable(factory):
        raise TypeError(f"the factory of the {name!r} view must be callable; got "
                        f"{type(factory).__name__}")
    _FACTORIES[name] = factory


def open_view(name: str, source: Any, **options: Any) -> Any:
    """The view ``name`` of ``source`` (what its registered factory makes of them).

    Raises
    ------
    GpudashError
        No view of that name is registered.
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        raise GpudashError(f"no {name!r} view is registered (registered: "
                           f"{', '.join(sorted(_FACTORIES)) or 'none'})")
    return factory(source, **options)
